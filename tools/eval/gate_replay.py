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
another vote's motion).
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
            base run's).
    """
    out = []
    for ep in episodes:
        for note in ep.get("policy_notes") or []:
            if not note or not note.get("stop_asked") or note.get("stop_allowed"):
                continue
            would_pass = note["gate_visible_logit"] > 0 and note["gate_distance_m"] <= distance_m
            if would_pass and note["stop_step"] < execute_steps:
                raise ValueError(
                    f"episode {ep['episode_id']} call {note['call']}: the base run vetoed a STOP at a predicted "
                    f"{note['gate_distance_m']:.3f} m that {distance_m:.3f} m would let through; the distance must "
                    "be tighter than the base run's"
                )
        final = ended_by_gated_stop(ep)
        if final is not None and final["gate_distance_m"] > distance_m:
            out.append(ep["episode_id"])
    return out


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
    for key in ("seed", "synthesize", "level", "goal_point", "execute_steps", "max_steps", "num_steps", "stop_votes"):
        a, b = (base_data.get("arguments") or {}).get(key), (replay_data.get("arguments") or {}).get(key)
        if a != b:
            raise CliError(f"{args.replay}: {key} is {b!r} there and {a!r} in the base run; replay with its flags")
    episodes = [replaced.get(e["episode_id"], e) for e in base["episodes"]]
    merged = {
        "label": args.label,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "merged_from": {"base": str(args.report.resolve()), "replay": str(args.replay.resolve()),
                        "replayed": sorted(replaced),
                        "replay_stop_gate_distance": (replay_data.get("arguments") or {}).get("stop_gate_distance")},
        "episodes": episodes,
        "specs": base_data.get("episodes"),
    }  # fmt: skip
    _write_new(args.output, json.dumps(merged, indent=1) + "\n")
    print(f"{len(replaced)} of {len(episodes)} episodes replaced; wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _affected(args) if args.command == "affected" else _merge(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
