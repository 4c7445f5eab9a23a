#!/usr/bin/env python3
"""Where closed-loop collisions happen: blocked-step streaks, and how close to a wall the policy drives, beside how
close to a wall the training prompts start.

Reads ``closed_loop_eval.py`` reports (every run in them; the per-step ``poses`` and ``blocked`` records) and the
occupancy maps of their scenes (``--scenes``: the evaluator's ``scenes/`` folder of a ``--synthesize`` run, or the
scene folders it was given). With ``--prompts`` (a Stage-III dataset directory, e.g. the training subset), the
start poses of its rows are measured on their own occupancy maps (``--prompt-scenes``) the same way, so the two
distributions can be put side by side: a policy trained on prompts that never touch a wall meets walls in closed
loop that its training never showed it.

Per run: blocked steps per episode, contacts (runs of consecutive blocked steps) per episode, the share of blocked
steps that are part of a run of ``--streak`` or more, and the share of the states the policy was at (every step)
and of its blocked steps closer than each ``--thresholds`` distance (metres, centre to the nearest blocked cell).

Example:

    python tools/eval/contact_states.py OUT/report.json --scenes OUT/scenes \\
        --prompts W/carry/train --prompt-scenes W/carry/scenes
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class CliError(Exception):
    """A user error; the message says what to change."""


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="closed_loop_eval.py report.json files")
    p.add_argument("--scenes", required=True, type=Path, help="folder of the evaluated scenes' folders")
    p.add_argument("--prompts", type=Path, help="a Stage-III dataset directory whose start poses to measure")
    p.add_argument("--prompt-scenes", type=Path, help="occupancy scenes of --prompts (default: --scenes)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4], help="clearances in metres")
    p.add_argument("--streak", type=int, default=3, help="blocked steps in a row that count as a streak (3)")
    p.add_argument("--output", type=Path, help="also write the numbers as JSON here (refuses to overwrite)")
    return p.parse_args(argv)


def streak_share(blocked: Sequence[bool], streak: int) -> tuple[int, int]:
    """``(blocked steps, of which in runs of >= streak consecutive blocked steps)`` of one episode."""
    from verl_omni.sim.eval_metrics import blocked_run_lengths

    lengths = blocked_run_lengths(blocked)
    return int(lengths.sum()), int(lengths[lengths >= streak].sum())


def run_summary(episodes: Sequence[Mapping], clearance_of, thresholds: Sequence[float], streak: int) -> dict:
    """Contact numbers of one run.

    Args:
        episodes: Per-episode records with ``scene_id``, ``poses`` (``[steps + 1, 3]``) and ``blocked``
            (``[steps]``).
        clearance_of: ``(scene_id, xy [K, 2]) -> clearance [K]`` in metres.
        thresholds: Clearances to count states below.
        streak: Run length that counts as a streak.

    Returns:
        ``{"episodes", "blocked_per_episode", "contacts_per_episode", "blocked_in_streaks",
        "states_closer_than", "blocked_closer_than"}``; the shares are None where there is nothing to share.
    """
    from verl_omni.sim.eval_metrics import blocked_run_lengths

    blocked_total = in_streaks = contacts = 0
    state_clear, blocked_clear = [], []
    for ep in episodes:
        if "poses" not in ep or "blocked" not in ep:
            raise ValueError(f"episode {ep.get('episode_id')}: no per-step poses/blocked records in the report")
        poses = np.asarray(ep["poses"], np.float64)
        blocked = np.asarray(ep["blocked"], bool)
        b, s = streak_share(blocked, streak)
        blocked_total, in_streaks = blocked_total + b, in_streaks + s
        contacts += blocked_run_lengths(blocked).size
        clear = np.asarray(clearance_of(ep["scene_id"], poses[: len(blocked), :2]), np.float64)
        state_clear.append(clear)
        blocked_clear.append(clear[blocked])
    states = np.concatenate(state_clear) if state_clear else np.zeros(0)
    at_block = np.concatenate(blocked_clear) if blocked_clear else np.zeros(0)
    n = max(len(episodes), 1)

    def shares(values: np.ndarray) -> dict[str, float | None]:
        return {f"{t:g}": (float(np.mean(values < t)) if values.size else None) for t in thresholds}

    return {
        "episodes": len(episodes),
        "blocked_per_episode": blocked_total / n,
        "contacts_per_episode": contacts / n,
        "blocked_in_streaks": in_streaks / blocked_total if blocked_total else None,
        "states": int(states.size),
        "states_closer_than": shares(states),
        "blocked_closer_than": shares(at_block),
    }


def start_clearances(starts: Sequence[tuple[str, Sequence[float]]], clearance_of) -> dict:
    """Clearance summary of start poses: ``starts`` are ``(scene_id, pose [x, y, yaw])`` pairs.

    Returns:
        ``{"prompts", "min_clearance", "clearances"}`` (``clearances`` in metres, one per start, in order).
    """
    values = np.asarray(
        [float(clearance_of(scene, np.asarray(pose, np.float64)[None, :2])[0]) for scene, pose in starts], np.float64
    )
    return {
        "prompts": int(values.size),
        "min_clearance": float(values.min()) if values.size else None,
        "clearances": values,
    }


def prompt_summary(dataset_dir: Path, clearance_of, thresholds: Sequence[float]) -> dict:
    """Share of a Stage-III dataset's start poses closer than each threshold to a wall (on their own maps)."""
    from verl_omni.data.dataset import Stage3Dataset

    ds = Stage3Dataset.open(dataset_dir)
    rows = (ds[i] for i in range(len(ds)))
    summary = start_clearances([(row.occupancy, row.start_pose) for row in rows], clearance_of)
    values = summary.pop("clearances")
    summary["closer_than"] = {f"{t:g}": float(np.mean(values < t)) for t in thresholds} if values.size else {}
    return summary


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def main(argv=None) -> int:
    args = _parse(argv)
    from verl_omni.data.occupancy import OccupancyMap
    from verl_omni.sim.eval_metrics import report_runs

    if args.output is not None and args.output.exists():
        raise CliError(f"--output {args.output}: already exists; never overwritten")
    if args.streak < 1:
        raise CliError(f"--streak must be >= 1, got {args.streak}")

    def map_reader(root: Path, flag: str):
        maps: dict[str, OccupancyMap] = {}

        def clearance_of(scene_id: str, xy: np.ndarray) -> np.ndarray:
            if scene_id not in maps:
                folder = root / scene_id
                if not folder.is_dir():
                    raise CliError(f"{flag} {root}: no folder for scene {scene_id!r}")
                maps[scene_id] = OccupancyMap.load(folder)
            return maps[scene_id].clearance_at(xy)

        return clearance_of

    clearance_of = map_reader(args.scenes, "--scenes")

    out: dict = {"thresholds_m": list(args.thresholds), "streak": args.streak, "runs": {}}
    for path in args.reports:
        try:
            runs, _ = report_runs(path)
            for label, episodes in runs.items():
                out["runs"][f"{path.parent.name}/{label}"] = run_summary(
                    episodes, clearance_of, args.thresholds, args.streak
                )
        except ValueError as e:
            raise CliError(f"{path}: {e}") from e
    if args.prompts is not None:
        prompt_scenes = args.prompt_scenes or args.scenes
        flag = "--prompt-scenes" if args.prompt_scenes else "--scenes"
        out["prompts"] = prompt_summary(args.prompts, map_reader(prompt_scenes, flag), args.thresholds)

    ts = [f"{t:g}" for t in args.thresholds]
    head = ["run", "episodes", "blocked/ep", "contacts/ep", f"blocked in runs >= {args.streak}"]
    head += [f"states < {t} m" for t in ts] + [f"blocked at < {t} m" for t in ts]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, r in out["runs"].items():
        cells = [label, str(r["episodes"]), _fmt(r["blocked_per_episode"]), _fmt(r["contacts_per_episode"])]
        cells += [_fmt(r["blocked_in_streaks"], True)]
        cells += [_fmt(r["states_closer_than"][t], True) for t in ts] + [
            _fmt(r["blocked_closer_than"][t], True) for t in ts
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if "prompts" in out:
        p = out["prompts"]
        cells = [f"prompts ({args.prompts.name})", str(p["prompts"]), "", "", ""]
        cells += [_fmt(p["closer_than"].get(t), True) for t in ts] + [""] * len(ts)
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.output is not None:
        tmp = args.output.with_name(args.output.name + ".partial")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
