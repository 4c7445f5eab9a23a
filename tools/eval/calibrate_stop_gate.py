#!/usr/bin/env python3
"""Re-fit a checkpoint's STOP gate distance on the head's own predictions at the goal; writes a new checkpoint.

The gate lets a sampled STOP through only where its view head predicts the named object within the checkpoint's
stopping distance (``verl_omni/models/wnm/stop_gate.py``). Training fits that distance on the expert's *label*
distances over every state that stops within 8 steps, so it is about the distance from which the expert will
stop soon, not where it stops; measured on Stage-II checkpoints it lets most STOPs asked 0.5-1 m short of the
goal through. This tool fits it instead on the quantity the gate compares, the head's prediction, at states
where a STOP would succeed: a quantile of the predicted distance over the calls of a STOP probe
(``tools/eval/stop_probe.py --stop-gate``) whose true geodesic distance is within the success radius.

Run the probe on a *validation* seed, never on the held-out seed you report (the tool refuses a probe report whose
seed is ``--heldout-seed``, 2000 by default, or that records no seed, unless ``--allow-heldout-seed``):

    python tools/eval/stop_probe.py --checkpoint CKPT --stop-gate --level two_rooms --synthesize 40 --seed 1000 \\
        --episodes 120 --goal-point nearest --execute-steps 3 --output-dir PROBE
    python tools/eval/calibrate_stop_gate.py --checkpoint CKPT --probe-report PROBE/report.json --output CKPT_CAL

The new checkpoint is the old one byte for byte except ``stop_gate/config.json`` (distance, quantile,
``fitted_on``), ``README.md`` (a calibration section) and the manifest (its provenance records the probe). The
table printed, and kept in the README and the provenance, gives per distance band of the probe the share of calls
whose gate would let a STOP through at the old and at the new distance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl_omni.data.cli_common import CliError, fraction, run_cli  # noqa: E402

PROBE_FORMAT = "wnm-stop-probe/1"
# The probe's settings kept in the new checkpoint's provenance.
PROBE_KEYS = ("level", "seed", "synthesize", "episodes", "goal_point", "execute_steps", "num_steps", "success_radius")
# The held-out evaluation seed reported across docs/results; a gate fitted on its episodes has seen the test set.
DEFAULT_HELDOUT_SEED = 2000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="WNM checkpoint with a stop_gate/")
    p.add_argument("--probe-report", type=Path, required=True, help="stop_probe.py --stop-gate report.json")
    p.add_argument("--label", help="the checkpoint's label in the report (default: the one with this path)")
    p.add_argument("--quantile", type=fraction, default=0.9, help="share of at-goal states to let through (0.9)")
    p.add_argument("--output", type=Path, required=True, help="new checkpoint folder (must not exist)")
    p.add_argument(
        "--heldout-seed",
        type=int,
        default=DEFAULT_HELDOUT_SEED,
        help=f"held-out evaluation seed; a probe report drawn from it is refused ({DEFAULT_HELDOUT_SEED})",
    )
    p.add_argument(
        "--allow-heldout-seed",
        action="store_true",
        help="accept a probe on the held-out seed, or one that records no seed (analysis only; "
        "results reported on that seed are then no longer held out)",
    )
    return p


def check_probe_seed(report: dict, heldout_seed: int, allow: bool, where: Path) -> None:
    """Refuses a probe report drawn from the held-out evaluation seed, or one that does not say its seed.

    Fitting the STOP distance on the held-out episodes leaks the test set into the checkpoint, so the success rate
    later reported on that seed would no longer be a held-out number.

    Args:
        report: The parsed ``stop_probe.py`` report; its seed is ``report["arguments"]["seed"]``.
        heldout_seed: The seed reported as held out (``--heldout-seed``).
        allow: ``--allow-heldout-seed``: warn on stderr instead of refusing.
        where: The report's path, for messages.

    Raises:
        CliError: (exit 2) the seed is the held-out one or absent, and ``allow`` is false.
    """
    seed = (report.get("arguments") or {}).get("seed")
    if seed is None:
        problem = (f"--probe-report {where}: field 'arguments.seed' is missing, so it cannot be checked against the "
                   f"held-out seed {heldout_seed}")  # fmt: skip
    elif seed == heldout_seed:
        problem = (f"--probe-report {where}: the probe's episodes were drawn from seed {seed}, the held-out "
                   "evaluation seed (--heldout-seed); calibrating on them leaks the test set")  # fmt: skip
    else:
        return
    if not allow:
        raise CliError(f"{problem}. Run stop_probe.py again with a validation --seed (e.g. 1000), or pass "
                       "--allow-heldout-seed for a deliberate analysis")  # fmt: skip
    print(f"warning: {problem}; going on because of --allow-heldout-seed (do not report results on seed "
          f"{heldout_seed} for this checkpoint as held out)", file=sys.stderr)  # fmt: skip


def _pick_label(report: dict, checkpoint: Path, label: str | None, where: Path) -> str:
    checkpoints = report.get("checkpoints") or {}
    if label is not None:
        if label not in checkpoints:
            raise CliError(f"--label {label!r}: not in {where} (labels: {sorted(checkpoints)})")
        return label
    mine = [k for k, v in checkpoints.items() if Path(v).resolve() == checkpoint.resolve()]
    if len(mine) == 1:
        return mine[0]
    if len(checkpoints) == 1:
        return next(iter(checkpoints))
    raise CliError(
        f"{where}: probes {sorted(checkpoints)} and none (or several) has the path {checkpoint}; name it with --label"
    )


def band_pass_rates(calls: list[dict], distance_m: float) -> list[dict]:
    """Per distance band of :data:`verl_omni.sim.stop_probe.DISTANCE_BANDS`: calls and the share whose gate lets a
    STOP through at ``distance_m`` (logit > 0 and predicted distance <= it)."""
    from verl_omni.sim.stop_probe import DISTANCE_BANDS, band_label

    rows = []
    for lo, hi in DISTANCE_BANDS:
        band = [c for c in calls if lo < c["geodesic_m"] - c["success_radius"] <= hi]
        passes = sum(1 for c in band if c["gate_visible_logit"] > 0 and c["gate_distance_m"] <= distance_m)
        share = passes / len(band) if band else None
        rows.append({"band": band_label(lo, hi), "calls": len(band), "gate_allows": share})
    return rows


def _readme_section(old_m: float, new_m: float, quantile: float, probe_args: dict, rows_old, rows_new) -> str:
    lines = [
        "",
        "## STOP gate calibration",
        "",
        f"The STOP gate's stopping distance was re-fitted by `tools/eval/calibrate_stop_gate.py`: {old_m:.3f} m "
        f"(training's fit on label distances) -> **{new_m:.3f} m**, the {quantile:g} quantile of the gate head's "
        "predicted object distance over the probe's calls within the success radius where it sees the object.",
        f"Probe: `tools/eval/stop_probe.py`, level {probe_args.get('level')}, seed {probe_args.get('seed')}, "
        f"{probe_args.get('episodes')} episodes, goal point {probe_args.get('goal_point')}, "
        f"{probe_args.get('execute_steps')} steps a call. Weights are unchanged (byte for byte).",
        "",
        *pass_rate_table(rows_old, rows_new),
    ]
    return "\n".join(lines) + "\n"


def pass_rate_table(rows_old: list[dict], rows_new: list[dict]) -> list[str]:
    """Markdown lines: per band, the calls and the gate's pass rate before and after."""

    def share(v):
        return "-" if v is None else f"{v:.2f}"

    lines = ["| distance beyond the success radius | probe calls | gate lets STOP through, before | after |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for a, b in zip(rows_old, rows_new, strict=True):
        lines.append(f"| {a['band']} | {a['calls']} | {share(a['gate_allows'])} | {share(b['gate_allows'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output.exists():
        raise CliError(f"--output {args.output}: already exists; choose a new folder (checkpoints are never "
                       "overwritten)")  # fmt: skip
    try:
        report = json.loads(args.probe_report.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"--probe-report {args.probe_report}: cannot read it as JSON ({e})") from e
    if not isinstance(report, dict) or report.get("format") != PROBE_FORMAT:
        raise CliError(f"--probe-report {args.probe_report}: field 'format' must be {PROBE_FORMAT!r} (stop_probe.py)")
    if not (report.get("arguments") or {}).get("stop_gate"):
        raise CliError(f"--probe-report {args.probe_report}: the probe ran without --stop-gate; run it again with it")
    check_probe_seed(report, args.heldout_seed, args.allow_heldout_seed, args.probe_report)

    from verl_omni.contracts import CONFIG_NAME, read_manifest
    from verl_omni.models.wnm import CheckpointError
    from verl_omni.models.wnm.checkpoint import derive_checkpoint
    from verl_omni.models.wnm.stop_gate import FIT_PREDICTIONS, GATE_DIR, calibrate_stop_distance, load_stop_gate

    try:
        gate = load_stop_gate(args.checkpoint)
        manifest = read_manifest(args.checkpoint)
    except CheckpointError as e:
        raise CliError(f"--checkpoint {args.checkpoint}: {e}") from e
    if gate is None:
        raise CliError(f"--checkpoint {args.checkpoint}: has no {GATE_DIR}/ (trained without --view-aux-weight)")
    label = _pick_label(report, args.checkpoint, args.label, args.probe_report)
    calls = [c for c in report.get("calls", []) if c.get("checkpoint") == label]
    if not calls or any(c.get("gate_distance_m") is None for c in calls):
        raise CliError(f"--probe-report {args.probe_report}: no gate records for {label!r}")
    try:
        new_m = calibrate_stop_distance(
            np.array([c["gate_distance_m"] for c in calls]),
            np.array([c["gate_visible_logit"] for c in calls]),
            np.array([c["geodesic_m"] for c in calls]),
            np.array([c["success_radius"] for c in calls]),
            args.quantile,
        )
    except ValueError as e:
        raise CliError(f"--probe-report {args.probe_report}: {e}") from e
    at_goal = sum(1 for c in calls if c["geodesic_m"] <= c["success_radius"] and c["gate_visible_logit"] > 0)
    rows_old, rows_new = band_pass_rates(calls, gate.stop_distance_m), band_pass_rates(calls, new_m)
    print(f"{label}: {len(calls)} probe calls, {at_goal} within the success radius with the object in view")
    print(f"stopping distance {gate.stop_distance_m:.3f} m -> {new_m:.3f} m (quantile {args.quantile:g})")
    print("\n".join(pass_rate_table(rows_old, rows_new)))

    config_name = f"{GATE_DIR}/{CONFIG_NAME}"
    config = json.loads((args.checkpoint / config_name).read_text())
    config.update({"stop_distance_m": new_m, "quantile": args.quantile, "fitted_on": FIT_PREDICTIONS})
    probe_args = report.get("arguments") or {}
    readme_path = args.checkpoint / "README.md"
    replace = {config_name: (json.dumps(config, indent=1, sort_keys=True) + "\n").encode()}
    if "README.md" in manifest["files"]:
        section = _readme_section(gate.stop_distance_m, new_m, args.quantile, probe_args, rows_old, rows_new)
        replace["README.md"] = (readme_path.read_text() + section).encode()
    provenance = {
        "stop_gate_calibration": {
            "tool": "tools/eval/calibrate_stop_gate.py",
            "previous_stop_distance_m": gate.stop_distance_m,
            "stop_distance_m": new_m,
            "quantile": args.quantile,
            "at_goal_calls": at_goal,
            "probe": {k: probe_args.get(k) for k in PROBE_KEYS},
            "probe_label": label,
            # Kept so a checkpoint fitted on the held-out seed under --allow-heldout-seed says so.
            "heldout_seed": args.heldout_seed,
            "allow_heldout_seed": args.allow_heldout_seed,
            "pass_rates_before": rows_old,
            "pass_rates_after": rows_new,
        }
    }
    try:
        out = derive_checkpoint(args.checkpoint, args.output, replace, provenance)
    except (CheckpointError, FileExistsError) as e:
        raise CliError(f"--output {args.output}: {e}") from e
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
