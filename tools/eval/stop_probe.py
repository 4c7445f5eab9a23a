#!/usr/bin/env python3
"""Where along the expert's path do checkpoints ask to STOP? Same states, same noise, paired.

The map expert drives held-out episodes; at every call each checkpoint is asked what it would do from the same
history and instruction, with the same initial noise, and its answer is recorded but never executed
(``verl_omni.sim.stop_probe``). The tables give, by true geodesic distance to the goal beyond the success radius,
how often each checkpoint's chunk asks for a STOP within the executed steps, how often its STOP gate would let
one through, how often the episode would end there, and what its executed steps would do from there (a wall hit,
metres moved, geodesic progress, beside the expert's); with two checkpoints, their paired difference.

    python tools/eval/stop_probe.py --checkpoint R1 STAGE3_EXPORT --stop-gate --level two_rooms \\
        --synthesize 40 --seed 2000 --episodes 40 --goal-point nearest --execute-steps 3 --output-dir OUT

Writes ``OUT/report.json`` (every call's record) and ``OUT/summary.md``; refuses to overwrite them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from verl_omni.data.cli_common import CliError, positive_int, run_cli

REPORT_NAME = "report.json"
SUMMARY_NAME = "summary.md"
REPORT_FORMAT = "wnm-stop-probe/1"


def build_parser() -> argparse.ArgumentParser:
    from verl_omni.sim.label_args import add_goal_point_argument

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, nargs="+", required=True, help="one or two WNM checkpoint folders")
    p.add_argument("--level", default="two_rooms", help="task level of the synthesized scenes (two_rooms)")
    p.add_argument("--synthesize", type=positive_int, default=40, help="held-out scenes to synthesize (40)")
    p.add_argument("--seed", type=int, default=2000, help="seed of scenes, episodes and noise (2000)")
    p.add_argument("--episodes", type=positive_int, default=40, help="episodes in total (40)")
    p.add_argument("--max-steps", type=positive_int, default=128, help="motion steps per episode (128)")
    p.add_argument("--execute-steps", type=positive_int, default=3, help="steps the expert executes per call (3)")
    p.add_argument("--success-radius", type=float, default=0.5, help="geodesic success radius, m (0.5)")
    add_goal_point_argument(p)
    p.add_argument("--stop-gate", action="store_true", help="also record each checkpoint's STOP gate")
    p.add_argument("--num-steps", type=positive_int, default=10, help="ODE denoising steps (10)")
    p.add_argument("--device", default="cpu", help="torch device (cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--no-progress", action="store_true")
    return p


def _labels(paths: list[Path]) -> list[str]:
    names = [p.resolve().name for p in paths]
    if len(set(names)) != len(names):
        names = [f"{n} ({i + 1})" for i, n in enumerate(names)]
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.checkpoint) > 2:
        raise CliError(f"--checkpoint: one or two checkpoints, got {len(args.checkpoint)}")
    outputs = [args.output_dir / REPORT_NAME, args.output_dir / SUMMARY_NAME]
    taken = [str(p) for p in outputs if p.exists()]
    if taken:
        raise CliError(f"--output-dir: {taken} already exist; choose a new folder (outputs are never overwritten)")

    from verl_omni.models.wnm import CheckpointError
    from verl_omni.sim.closed_loop import ClosedLoopConfig, run_closed_loop
    from verl_omni.sim.collector import CollectorConfig, SceneError
    from verl_omni.sim.heldout import draw_heldout_episodes
    from verl_omni.sim.levels import get_level
    from verl_omni.sim.reference_policies import ExpertPolicy
    from verl_omni.sim.stop_probe import ShadowPolicy, format_summary, summarise
    from verl_omni.sim.wnm_policy import WNMPolicy

    try:
        level = get_level(args.level)
        tasks = CollectorConfig(success_radius=args.success_radius, min_goal_distance_m=level.min_goal_distance_m,
                                goal_point=args.goal_point)  # fmt: skip
        loop = ClosedLoopConfig(max_steps=args.max_steps, execute_steps=args.execute_steps)
    except (KeyError, ValueError) as e:
        raise CliError(f"invalid probe settings: {e}") from e
    labels = _labels(args.checkpoint)
    shadows = {}
    for label, ckpt in zip(labels, args.checkpoint, strict=True):
        try:
            shadows[label] = WNMPolicy.from_checkpoint(
                ckpt,
                device=args.device,
                dtype=args.dtype,
                num_steps=args.num_steps,
                name=label,
                stop_gate=args.stop_gate,
            )
        except (CheckpointError, ValueError) as e:
            raise CliError(f"--checkpoint {ckpt}: {e}") from e
    t0 = time.perf_counter()
    try:
        plans_list, specs = draw_heldout_episodes(args.synthesize, args.episodes, args.seed, level.floorplan(), tasks)
    except (SceneError, ValueError) as e:
        raise CliError(f"cannot draw the held-out episodes: {e}") from e
    plans = {p.scene_id: p for p in plans_list}
    image_size = next(iter(shadows.values())).image_size
    probe = ShadowPolicy(
        ExpertPolicy(plans, image_size=image_size),
        shadows,
        {sid: plan.occupancy() for sid, plan in plans.items()},
        {s.episode_id: s.success_radius for s in specs},
        args.execute_steps,
        robot_radius=loop.robot_radius,
    )
    print(f"{len(specs)} episodes over {len(plans)} scenes; the expert drives, {', '.join(labels)} answer")
    results = run_closed_loop(probe, plans, specs, loop, progress=not args.no_progress, desc="expert path")
    summary = summarise(probe.calls, (labels[1], labels[0]) if len(labels) == 2 else None)
    table = format_summary(summary)
    report = {
        "format": REPORT_FORMAT,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "arguments": {
            k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
            for k, v in vars(args).items()
        },  # fmt: skip
        "checkpoints": dict(zip(labels, (str(p.resolve()) for p in args.checkpoint), strict=True)),
        "expert_success": sum(r.success for r in results) / len(results),
        "summary": summary,
        "calls": [c.to_dict() for c in probe.calls],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for path, text in ((outputs[0], json.dumps(report, indent=1) + "\n"), (outputs[1], table + "\n")):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        if path.exists():
            tmp.unlink()
            raise CliError(f"{path}: appeared while probing; nothing was overwritten")
        tmp.rename(path)
    print(table)
    print(f"\nexpert SR {report['expert_success']:.3f}; {len(probe.calls)} answers in {report['seconds']:.0f}s")
    print(f"wrote {outputs[0]}\nwrote {outputs[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
