#!/usr/bin/env python3
"""Closed-loop runs side by side on the same episodes: each run's rates, and its paired differences from the first.

Every run must cover the same episodes (matched by episode id, in any order); reports are ``closed_loop_eval.py``
``report.json`` files (every run in them) or the per-checkpoint files of ``scripts/train_stage2.py``
(``<workdir>/eval/<name>.json``). Give a run a name with ``NAME=PATH`` (needed when two files hold runs of the
same label, e.g. one checkpoint evaluated with different ``--execute-steps``). Differences are ``run - first``,
with paired Student-t intervals. A second table counts each run's premature STOPs (episodes a STOP ended outside the
success radius) by the geodesic distance left beyond the radius (``--stop-bins``): a STOP just short of the goal
and one in the wrong room are both "premature", but only the first is what a distance-scaled STOP penalty barely
charges.

Example:

    python tools/eval/paired_reports.py x8=ev8/report.json x4=ev4/report.json bearing=eval_gb/report.json \\
      --output paired.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl_omni.sim.eval_metrics import (  # noqa: E402
    METRIC_LABELS,
    aggregate,
    format_estimate,
    paired_differences,
    premature_stop_bin_labels,
    premature_stop_bins,
    report_runs,
)
from verl_omni.utils.run_layout import atomic_write_text  # noqa: E402

# The compact table's columns: a chosen few of the registered metrics (verl_omni.sim.eval_metrics.METRICS), with
# their registered labels; the JSON output carries every metric.
COLUMNS = tuple(
    (name, METRIC_LABELS[name])
    for name in ("success", "oracle_success", "collisions", "premature_stop", "progress", "path_length", "spl")
)


class CliError(Exception):
    """A user error; the message says what to change."""


def _bin_edges(text: str) -> tuple[float, ...]:
    try:
        edges = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected increasing metres separated by commas, e.g. 0.5,1.5"
        ) from None
    if not edges or any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected increasing positive metres, e.g. 0.5,1.5")
    return edges


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+", help="[NAME=]PATH of an evaluation report; the first run is the base")
    p.add_argument("--output", type=Path, help="also write the rates and differences as JSON here (never overwritten)")
    p.add_argument(
        "--stop-bins",
        type=_bin_edges,
        default=(0.5, 1.5),
        help="metres beyond the success radius that bound the premature-STOP bins (default 0.5,1.5)",
    )
    return p.parse_args(argv)


def load_success_radii(specs: list[str]) -> dict[str, float] | None:
    """``{episode id: success radius}`` from the first report that carries episode specs (None if none does)."""
    for spec in specs:
        path = spec.rpartition("=")[2] if "=" in spec else spec
        _, carried = report_runs(Path(path))
        if carried:
            missing = [s.get("episode_id") for s in carried if "success_radius" not in s]
            if missing:
                raise CliError(f"{path}: episode specs {missing[:5]} have no 'success_radius'")
            return {s["episode_id"]: float(s["success_radius"]) for s in carried}
    return None


def format_stop_bins(bins: dict[str, list[int]], edges: tuple[float, ...], episodes: int) -> str:
    """Markdown table of :func:`premature_stop_bins` per run."""
    heads = premature_stop_bin_labels(edges)
    lines = [f"Premature STOPs of the {episodes} episodes, by geodesic distance left beyond the success radius:", ""]
    lines += ["| run | " + " | ".join(heads) + " | all |", "| --- |" + " --- |" * (len(heads) + 1)]
    lines += [f"| {n} | " + " | ".join(str(c) for c in counts) + f" | {sum(counts)} |" for n, counts in bins.items()]
    return "\n".join(lines)


def load_runs(specs: list[str]) -> dict[str, list[dict]]:
    """``{name: per-episode records sorted by episode id}`` of every run in the given ``[NAME=]PATH`` reports."""
    runs: dict[str, list[dict]] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        try:
            found, _ = report_runs(Path(path))
        except ValueError as e:
            raise CliError(str(e)) from e
        if name and len(found) > 1:
            raise CliError(f"{spec}: NAME= names one run, but {path} holds {len(found)} ({sorted(found)})")
        for label, episodes in found.items():
            key = name or label
            if key in runs:
                raise CliError(f"{spec}: a run named {key!r} was given already; name this one with NAME={path}")
            runs[key] = sorted(episodes, key=lambda e: e["episode_id"])
    ids = {k: [e["episode_id"] for e in v] for k, v in runs.items()}
    first = next(iter(ids))
    for k, v in ids.items():
        if v != ids[first]:
            raise CliError(
                f"run {k!r} covers other episodes than {first!r} ({len(v)} vs {len(ids[first])}, "
                f"{len(set(v) ^ set(ids[first]))} differ): pair only evaluations of the same held-out episodes"
            )
    return runs


def compare(runs: dict[str, list[dict]]) -> dict:
    """``{"base": name, "runs": {name: aggregate}, "paired": {name: run - base}}`` for runs from :func:`load_runs`."""
    base = next(iter(runs))
    return {
        "base": base,
        "runs": {k: aggregate(v) for k, v in runs.items()},
        "paired": {k: paired_differences(runs[base], v) for k, v in runs.items() if k != base},
    }


def format_tables(result: dict) -> str:
    """Markdown tables: each run's rates, then its paired differences from the base."""
    names = list(result["runs"])
    cols = [(k, h) for k, h in COLUMNS if all(k in result["runs"][n] for n in names)]
    lines = [f"{result['runs'][names[0]]['episodes']} episodes, 95% intervals", ""]
    lines += ["| run | " + " | ".join(h for _, h in cols) + " |", "| --- |" + " --- |" * len(cols)]
    for n in names:
        agg = result["runs"][n]
        lines.append(f"| {n} | " + " | ".join(format_estimate(agg[k]) for k, _ in cols) + " |")
    if result["paired"]:
        lines += ["", f"Paired differences, run - {result['base']}:", ""]
        lines += ["| run | " + " | ".join(h for _, h in cols) + " |", "| --- |" + " --- |" * len(cols)]
        for n, diff in result["paired"].items():
            cells = [format_estimate(diff[k]) if k in diff else "-" for k, _ in cols]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        if args.output is not None and args.output.exists():
            raise CliError(f"--output {args.output}: exists; choose another path (results are never overwritten)")
        runs = load_runs(args.reports)
        result = compare(runs)
        radii = load_success_radii(args.reports)
    except CliError as e:
        print(f"paired_reports.py: {e}", file=sys.stderr)
        return 2
    print(format_tables(result))
    first = next(iter(runs.values()))
    if radii is not None and any(e["episode_id"] not in radii for e in first):
        print("\n(no premature-STOP table: the episode specs do not cover every evaluated episode)")
    elif radii is None or not all("ne" in e and "premature_stop" in e for v in runs.values() for e in v):
        print("\n(no premature-STOP table: the reports carry no episode specs, or no 'ne' and 'premature_stop')")
    else:
        result["premature_stop_bins"] = {
            "edges_beyond_radius_m": list(args.stop_bins),
            "counts": {k: premature_stop_bins(v, radii, args.stop_bins) for k, v in runs.items()},
        }
        print(
            "\n"
            + format_stop_bins(result["premature_stop_bins"]["counts"], args.stop_bins, len(next(iter(runs.values()))))
        )
    if args.output is not None:
        atomic_write_text(args.output, json.dumps(result, indent=1))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
