#!/usr/bin/env python3
"""A closed-loop evaluation at a tighter STOP-gate distance, from an existing run plus a replay of the episodes it
changes.

With one sample per call (``--stop-votes 1``), lowering the gate's stopping distance changes an episode only where
a STOP that the gate let through ended it: the gate now vetoes that STOP, the call executes the same chunk with its
stop channel cleared, and the episode goes on. A STOP the gate let through but that lay beyond the executed steps
ended nothing, and vetoing it leaves the executed motion unchanged. Every other episode keeps its trajectory (bit
for bit with ``--exact-batching``; otherwise up to the rounding of which episodes share a batch). So the run at the
tighter distance is the base run with those episodes evaluated again:

    python tools/eval/gate_replay.py affected BASE/report.json --stop-gate-distance D --output ids.txt
    python tools/eval/closed_loop_eval.py <BASE's flags> --stop-gate-distance D --only-episodes ids.txt \\
        --output-dir REPLAY
    python tools/eval/gate_replay.py merge BASE/report.json REPLAY/report.json --label NAME --output merged.json
    python tools/eval/paired_reports.py base=BASE/report.json NAME=merged.json

``affected`` refuses a distance that is not tighter than the base run's (a looser one would let through STOPs the
base run vetoed, which end episodes elsewhere) and a base run with several STOP votes (there a veto switches to
another vote's motion). ``merge`` refuses a replay evaluated with other episode, task or sampler settings than the
base run (:data:`REPLAY_SETTINGS`; every differing one is named) or with episodes drawn differently; the replay's
checkpoint may differ from the base's (base = trained gate, replay = calibrated gate), and ``--expect-checkpoint-sha``
checks that it is the intended one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl_omni.data.cli_common import CliError, run_cli  # noqa: E402

# closed_loop_eval.py arguments that decide the episodes, the task and the sampler whatever the checkpoint: the replay
# must match the base run in all of them, or its episodes are not the base run's episodes at another gate distance.
# Left out: the checkpoint(s), --stop-gate-distance (differs on purpose), --only-episodes, and where or how the run
# was executed or written (--device, --workers, --policy, --plot-episodes, --output-dir, --no-progress).
REPLAY_SETTINGS = (
    "scenes",
    "synthesize",
    "seed",
    "level",
    "episodes",
    "max_steps",
    "execute_steps",
    "collision",
    "success_radius",
    "min_goal_distance",
    "goal_point",
    "fov_deg",
    "scene_size_m",
    "max_rooms",
    "num_steps",
    "shift",
    "dtype",
    "exact_batching",
    "stop_votes",
    "stop_gate",
)
SHA_SHOWN = 12  # hex digits of a manifest sha256 printed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("affected", help="list the episodes a tighter gate distance changes")
    a.add_argument("report", type=Path, help="closed_loop_eval.py report.json of the base run (with --stop-gate)")
    a.add_argument("--stop-gate-distance", type=float, required=True, help="the tighter distance, metres")
    a.add_argument("--run", help="the run's label in the report (default: its only checkpoint run)")
    a.add_argument("--output", type=Path, required=True, help="episode ids, one per line (must not exist)")
    m = sub.add_parser("merge", help="the base run with the replayed episodes swapped in")
    m.add_argument("report", type=Path, help="the base run's report.json")
    m.add_argument("replay", type=Path, help="closed_loop_eval.py --only-episodes report.json of the replay")
    m.add_argument("--run", help="the base run's label (default: its only checkpoint run)")
    m.add_argument("--label", required=True, help="name of the merged run")
    m.add_argument("--output", type=Path, required=True, help="merged per-episode records (must not exist)")
    m.add_argument(
        "--expect-checkpoint-sha",
        metavar="PREFIX",
        help="refuse unless the replay's checkpoint manifest sha256 starts with PREFIX (closed_loop_eval.py records "
        "it as runs.checkpoint.checkpoint.manifest_sha256)",
    )
    return p


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict) or not data["runs"]:
        raise CliError(f"{path}: not a closed_loop_eval.py report (no 'runs')")
    return data


def _run(data: dict, label: str | None, path: Path) -> dict:
    runs = {k: v for k, v in data["runs"].items() if isinstance(v, dict) and "episodes" in v}
    if label is None:
        if len(runs) != 1:
            raise CliError(f"{path}: runs {sorted(runs)}; name one with --run")
        return next(iter(runs.values()))
    if label not in runs:
        raise CliError(f"{path}: no run {label!r} (runs: {sorted(runs)})")
    return runs[label]


def ended_by_gated_stop(episode: dict) -> dict | None:
    """The gate note of the call whose STOP ended ``episode`` (the last note, let through), or None when the
    episode did not end by a STOP the gate let through."""
    notes = [n for n in episode.get("policy_notes") or [] if n and n.get("stop_asked")]
    if episode.get("end_reason") != "stop" or not notes:
        return None
    last = max(notes, key=lambda n: n["call"])
    return last if last.get("stop_allowed") else None


def affected_episodes(episodes: list[dict], distance_m: float, execute_steps: int) -> list[str]:
    """Ids of the episodes that a gate distance of ``distance_m`` would change (see the module docstring).

    Args:
        episodes: Per-episode records of a run evaluated with the gate; an episode without ``policy_notes`` never
            asked for a STOP.
        distance_m: The tighter stopping distance.
        execute_steps: Steps executed per call in the base run.

    Raises:
        ValueError: a STOP the base run vetoed would pass at ``distance_m`` (the distance is not tighter than the
            base run's) and was executed, or its note lacks ``stop_step`` so that cannot be told. Only such notes
            need ``stop_step``; at a tighter distance, reports written before it was recorded are read in full.
    """
    out = []
    for ep in episodes:
        for note in ep.get("policy_notes") or []:
            if not note or not note.get("stop_asked") or note.get("stop_allowed"):
                continue
            would_pass = note["gate_visible_logit"] > 0 and note["gate_distance_m"] <= distance_m
            if not would_pass:
                continue
            # Only here does the STOP's step matter: a vetoed STOP that now passes changes nothing if it lay beyond
            # the executed steps. Older reports do not record it; then it may have been executed, so refuse.
            if "stop_step" not in note:
                raise ValueError(
                    f"episode {ep['episode_id']} call {note['call']}: the base run vetoed a STOP at a predicted "
                    f"{note['gate_distance_m']:.3f} m that {distance_m:.3f} m would let through, and its note has no "
                    "'stop_step' to tell whether it was executed; the distance must be tighter than the base run's"
                )
            if note["stop_step"] < execute_steps:
                raise ValueError(
                    f"episode {ep['episode_id']} call {note['call']}: the base run vetoed a STOP at a predicted "
                    f"{note['gate_distance_m']:.3f} m that {distance_m:.3f} m would let through; the distance must "
                    "be tighter than the base run's"
                )
        final = ended_by_gated_stop(ep)
        if final is not None and final["gate_distance_m"] > distance_m:
            out.append(ep["episode_id"])
    return out


def stop_note_counts(episodes: list[dict]) -> tuple[int, int]:
    """``(episodes that never asked for a STOP, episodes with a STOP note lacking stop_step)``, for the summary."""
    never = no_step = 0
    for ep in episodes:
        stops = [n for n in ep.get("policy_notes") or [] if n and n.get("stop_asked")]
        never += not stops
        no_step += any("stop_step" not in n for n in stops)
    return never, no_step


def settings_differences(base_args: dict, replay_args: dict) -> list[str]:
    """``"key: base ... replay ..."`` for each of :data:`REPLAY_SETTINGS` the two reports' arguments disagree on
    (a key absent from one report counts as differing)."""
    missing = "<absent>"
    out = []
    for key in REPLAY_SETTINGS:
        a, b = base_args.get(key, missing), replay_args.get(key, missing)
        if a != b:
            out.append(f"{key}: base {a!r}, replay {b!r}")
    return out


def _manifest_sha(run: dict) -> str | None:
    return (run.get("checkpoint") or {}).get("manifest_sha256")


def _checkpoint_id(run: dict) -> dict:
    """The run's checkpoint path and manifest sha256 as its report records them (None where it does not)."""
    ckpt = run.get("checkpoint") or {}
    return {"path": ckpt.get("path"), "manifest_sha256": ckpt.get("manifest_sha256")}


def _write_new(path: Path, text: str) -> None:
    if path.exists():
        raise CliError(f"--output {path}: already exists; choose a new name (outputs are never overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.rename(path)


def _affected(args) -> int:
    data = _load(args.report)
    run = _run(data, args.run, args.report)
    arguments = data.get("arguments") or {}
    if not arguments.get("stop_gate"):
        raise CliError(f"{args.report}: the base run was evaluated without --stop-gate")
    if int(arguments.get("stop_votes", 1)) != 1:
        raise CliError(f"{args.report}: the base run used --stop-votes {arguments['stop_votes']}; this replay needs 1")
    if not args.stop_gate_distance > 0:
        raise CliError(f"--stop-gate-distance must be > 0, got {args.stop_gate_distance}")
    try:
        ids = affected_episodes(run["episodes"], args.stop_gate_distance, int(arguments["execute_steps"]))
    except ValueError as e:
        raise CliError(f"{args.report}: {e}") from e
    by_id = {e["episode_id"]: e for e in run["episodes"]}
    won = sum(bool(by_id[i]["success"]) for i in ids)
    print(f"{len(ids)} of {len(run['episodes'])} episodes ended by a STOP the gate let through beyond "
          f"{args.stop_gate_distance:.3f} m (predicted): {won} successes, {len(ids) - won} failures")  # fmt: skip
    never, no_step = stop_note_counts(run["episodes"])
    print(f"{never} episodes never asked for a STOP (unaffected); {no_step} have STOP notes without 'stop_step' "
          "(an older report; not needed at a tighter distance)")  # fmt: skip
    _write_new(args.output, "".join(f"{i}\n" for i in ids))
    print(f"wrote {args.output}")
    return 0


def _merge(args) -> int:
    base_data, replay_data = _load(args.report), _load(args.replay)
    base = _run(base_data, args.run, args.report)
    replay = _run(replay_data, None, args.replay)
    replaced = {e["episode_id"]: e for e in replay["episodes"]}
    known = {e["episode_id"] for e in base["episodes"]}
    unknown = sorted(set(replaced) - known)
    if unknown:
        raise CliError(f"{args.replay}: episodes {unknown[:5]} are not in the base run {args.report}")
    differences = settings_differences(base_data.get("arguments") or {}, replay_data.get("arguments") or {})
    if differences:
        raise CliError(f"{args.replay}: evaluated with other settings than the base run {args.report} ("
                       f"{'; '.join(differences)}); run the replay with the base run's flags")  # fmt: skip
    # The same flags draw the same episodes; a spec that still differs means another scene set or code version.
    base_specs = {s.get("episode_id"): s for s in base_data.get("episodes") or []}
    drawn_otherwise = [s.get("episode_id") for s in replay_data.get("episodes") or []
                       if s.get("episode_id") in base_specs and s != base_specs[s.get("episode_id")]]  # fmt: skip
    if drawn_otherwise:
        raise CliError(f"{args.replay}: episodes {drawn_otherwise[:5]} have another start, goal or noise seed than in "
                       f"the base run {args.report}; replay on the base run's scenes")  # fmt: skip
    base_sha, replay_sha = _manifest_sha(base), _manifest_sha(replay)
    if args.expect_checkpoint_sha is not None:
        prefix = args.expect_checkpoint_sha.strip().lower()
        if not prefix or any(c not in "0123456789abcdef" for c in prefix):
            raise CliError(f"--expect-checkpoint-sha {args.expect_checkpoint_sha!r}: expected hex digits of a sha256")
        if replay_sha is None:
            raise CliError(f"{args.replay}: records no checkpoint manifest_sha256 (runs.*.checkpoint), so "
                           "--expect-checkpoint-sha cannot be checked")  # fmt: skip
        if not replay_sha.lower().startswith(prefix):
            raise CliError(f"{args.replay}: the replay's checkpoint manifest sha256 is {replay_sha[:SHA_SHOWN]}..., "
                           f"not {prefix}... (--expect-checkpoint-sha); replay with the intended "
                           "checkpoint")  # fmt: skip
    episodes = [replaced.get(e["episode_id"], e) for e in base["episodes"]]
    merged = {
        "label": args.label,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "merged_from": {"base": str(args.report.resolve()), "replay": str(args.replay.resolve()),
                        "replayed": sorted(replaced),
                        "replay_stop_gate_distance": (replay_data.get("arguments") or {}).get("stop_gate_distance"),
                        # Expected to differ (trained vs calibrated gate); kept so the merged run names both.
                        "checkpoints": {"base": _checkpoint_id(base), "replay": _checkpoint_id(replay)}},
        "episodes": episodes,
        "specs": base_data.get("episodes"),
    }  # fmt: skip
    _write_new(args.output, json.dumps(merged, indent=1) + "\n")
    print(f"checkpoint manifest sha256: base {(base_sha or 'not recorded')[:SHA_SHOWN]}, replay "
          f"{(replay_sha or 'not recorded')[:SHA_SHOWN]}")  # fmt: skip
    print(f"{len(replaced)} of {len(episodes)} episodes replaced; wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _affected(args) if args.command == "affected" else _merge(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
