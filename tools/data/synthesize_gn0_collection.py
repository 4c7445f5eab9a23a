#!/usr/bin/env python
"""Synthesize a GN0 DAgger collection and its occupancy scenes with the built-in simulator.

Example::

    python tools/data/synthesize_gn0_collection.py --output-dir /tmp/c --occupancy-dir /tmp/o \\
        --num-scenes 4 --episodes-per-scene 3 --seed 7

Writes ``<output-dir>/collection.json`` and ``<output-dir>/episodes/<episode_id>/{episode.json, rgb.mp4,
ref_<t>.mp4}`` (docs/contracts.md) and ``<occupancy-dir>/<scene_id>/occupancy.{png,json}`` plus the
simulator's ``semantics.{npz,json}``. Each scene's randomness comes from (seed, scene index), so the output is
identical for a seed whatever the number of workers. Both outputs are built in temporary folders next to
their destinations and renamed at the end: on any error nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from verl_omni.sim.collector import CollectorConfig, SceneError, SynthesisConfig, synthesize_scene_job
from verl_omni.sim.events import EVENT_NAMES
from verl_omni.sim.floorplan import FloorPlanConfig, FloorPlanError
from verl_omni.sim.label_args import add_label_arguments, label_fields
from verl_omni.sim.parallel import map_jobs, refuse_nonempty_dir
from verl_omni.sim.planner import PlanningError
from verl_omni.sim.render import CameraConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Synthesize a GN0 DAgger collection (MP4 + JSON) and InteriorGS-layout occupancy scenes.",
    )
    p.add_argument("--output-dir", required=True, type=Path, help="collection folder (must be absent or empty)")
    p.add_argument("--occupancy-dir", required=True, type=Path, help="occupancy scenes folder (absent or empty)")
    p.add_argument("--num-scenes", type=int, default=4, help="number of scenes (default 4)")
    p.add_argument("--episodes-per-scene", type=int, default=3, help="episodes per scene (default 3)")
    p.add_argument(
        "--image-size", type=int, nargs="+", default=[64], metavar="PX", help="frame size: S (square) or H W (64)"
    )
    p.add_argument(
        "--goal-variants",
        type=int,
        default=1,
        help="goals each driven episode is labelled for: 1 = its own; K also relabels it toward K - 1 other objects "
        "of the scene as extra episodes <id>_g<k>, so the instruction is needed to tell the labels apart (default 1)",
    )
    add_label_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="collection seed (default 0)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--fps", type=int, default=4, help="video frame rate (default 4)")
    p.add_argument("--fov-deg", type=float, default=90.0, help="horizontal field of view (default 90)")
    p.add_argument(
        "--scene-size-m", type=float, nargs=2, default=[8.0, 6.0], metavar=("W", "H"), help="floor size (8 6)"
    )
    p.add_argument("--max-rooms", type=int, default=5, help="most rooms per scene (default 5)")
    p.add_argument("--resolution", type=float, default=0.05, help="occupancy metres per pixel (default 0.05)")
    p.add_argument(
        "--level",
        help="task level (one_room, two_rooms, house; verl_omni/sim/levels.py): sets the floor size, room count, "
        "corridor chance and shortest start-goal distance instead of --scene-size-m/--max-rooms",
    )
    return p


def make_config(args: argparse.Namespace) -> SynthesisConfig:
    """Builds and validates the synthesis configuration from parsed flags (ValueError names the field)."""
    if len(args.image_size) not in (1, 2):
        raise ValueError(f"--image-size takes one or two integers, got {args.image_size}")
    h, w = (args.image_size * 2)[:2]
    camera = CameraConfig(width=w, height=h, fov_deg=args.fov_deg)
    if getattr(args, "level", None):
        from verl_omni.sim.levels import get_level

        level = get_level(args.level)
        floorplan = level.floorplan(resolution=args.resolution)
        collector = CollectorConfig(fps=args.fps, camera=camera, min_goal_distance_m=level.min_goal_distance_m,
                                    **label_fields(args))  # fmt: skip
    else:
        floorplan = FloorPlanConfig(
            size_m=tuple(args.scene_size_m), max_rooms=args.max_rooms, resolution=args.resolution
        )
        collector = CollectorConfig(fps=args.fps, camera=camera, **label_fields(args))
    return SynthesisConfig(
        num_scenes=args.num_scenes,
        episodes_per_scene=args.episodes_per_scene,
        floorplan=floorplan,
        collector=collector,
        goal_variants=args.goal_variants,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        cfg = make_config(args)
    except (ValueError, FloorPlanError) as e:
        parser.error(f"impossible scene parameters: {e}")
    out_dir, occ_dir = args.output_dir.resolve(), args.occupancy_dir.resolve()
    if out_dir == occ_dir or out_dir in occ_dir.parents or occ_dir in out_dir.parents:
        parser.error("--output-dir and --occupancy-dir must be separate folders (neither inside the other)")
    refuse_nonempty_dir(out_dir, "--output-dir")
    refuse_nonempty_dir(occ_dir, "--occupancy-dir")

    start = time.perf_counter()
    temps: list[Path] = []
    try:
        for d in (out_dir, occ_dir):
            d.parent.mkdir(parents=True, exist_ok=True)
            temps.append(Path(tempfile.mkdtemp(prefix=f".{d.name}.partial-", dir=d.parent)))
        tmp_out, tmp_occ = temps
        episodes_dir = tmp_out / "episodes"
        episodes_dir.mkdir()
        jobs = [(i, args.seed, cfg, str(episodes_dir), str(tmp_occ)) for i in range(cfg.num_scenes)]
        results = _run_jobs(jobs, args.workers)
        meta = cfg.collection_meta(args.seed)
        (tmp_out / "collection.json").write_text(json.dumps(meta, indent=1) + "\n")
        refuse_nonempty_dir(out_dir, "--output-dir")  # someone may have written there meanwhile
        refuse_nonempty_dir(occ_dir, "--occupancy-dir")
        # rename(2) replaces an empty destination directory atomically.
        tmp_occ.replace(occ_dir)
        temps.remove(tmp_occ)
        tmp_out.replace(out_dir)
        temps.remove(tmp_out)
    except (SceneError, FloorPlanError, PlanningError) as e:
        print(f"error: impossible scene parameters: {e} (nothing was written)", file=sys.stderr)
        return 1
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
    seconds = time.perf_counter() - start
    events: Counter = Counter()
    for r in results:
        events.update(r["events"])
    print(f"wrote {out_dir} and {occ_dir}")
    print(f"  scenes:        {len(results)}")
    print(f"  episodes:      {sum(r['episodes'] for r in results)}")
    print(f"  query states:  {sum(r['queries'] for r in results)}")
    print(f"  frames:        {sum(r['frames'] for r in results)}")
    for name in EVENT_NAMES:
        print(f"  {name + ':':<24} {events.get(name, 0)}")
    print(f"  seconds:       {seconds:.1f} ({args.workers} worker(s))")
    return 0


def _run_jobs(jobs: list, workers: int) -> list[dict]:
    results = map_jobs(synthesize_scene_job, jobs, workers, desc="scenes", unit="scene")
    return sorted(results, key=lambda r: r["scene_id"])


if __name__ == "__main__":
    sys.exit(main())
