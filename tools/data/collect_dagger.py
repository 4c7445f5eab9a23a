#!/usr/bin/env python
"""One closed-loop DAgger round: a WNM checkpoint drives (mixed with the expert), the expert relabels.

Writes a GN0 collection (``collection.json`` + ``episodes/``) and its occupancy scenes, in the same format as
``synthesize_gn0_collection.py``, so SFT (``make_tiny_wnm_checkpoint.py --collection``), the Stage-III converter
and the event-validation builder read it unchanged. With ``--beta`` the chunk of each policy call follows the
expert with that probability (``--beta 0`` is the pure learner: the Stage-III collection "with the Stage-II
policy"); ``--scene-offset`` starts at another scene index so that rounds can use fresh scenes.

Example:
    python tools/data/collect_dagger.py --policy-checkpoint ckpt/stage2_r0 --beta 0.5 --level two_rooms \\
        --num-scenes 100 --episodes-per-scene 4 --seed 11 --workers 8 --drive-workers 8 --device cuda \\
        --output-dir data/dagger_r1 --occupancy-dir data/dagger_r1_occ
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from verl_omni.sim.label_args import add_label_arguments, label_fields
from verl_omni.sim.parallel import refuse_nonempty_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Closed-loop DAgger collection with a WNM checkpoint as behaviour policy.")
    p.add_argument("--policy-checkpoint", required=True, type=Path, help="complete WNM checkpoint (the learner)")
    p.add_argument("--beta", type=float, required=True, help="probability that a policy call follows the expert")
    add_label_arguments(p)
    p.add_argument("--output-dir", required=True, type=Path, help="collection folder (must be absent or empty)")
    p.add_argument("--occupancy-dir", required=True, type=Path, help="occupancy scenes folder (absent or empty)")
    p.add_argument("--level", default="house", help="task level: one_room, two_rooms, house (default house)")
    p.add_argument("--num-scenes", type=int, default=4, help="scenes (default 4)")
    p.add_argument("--episodes-per-scene", type=int, default=3, help="episodes per scene (default 3)")
    p.add_argument("--scene-offset", type=int, default=0, help="index of the first scene (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of scenes, tasks and mixing draws (default 0)")
    p.add_argument("--workers", type=int, default=1, help="processes relabelling and writing episodes (default 1)")
    p.add_argument(
        "--drive-workers",
        type=int,
        default=1,
        help="processes driving episodes, each with its own copy of the learner (default 1)",
    )
    p.add_argument("--max-steps", type=int, default=160, help="motion steps per episode (default 160)")
    p.add_argument(
        "--execute-steps", type=int, default=8, help="action steps executed per policy call (default 8, one chunk)"
    )
    p.add_argument("--num-steps", type=int, default=10, help="ODE denoising steps of the learner (default 10)")
    p.add_argument("--device", default="cpu", help="torch device of the learner (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="learner DiT dtype")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.beta <= 1.0:
        parser.error(f"--beta must be in [0, 1], got {args.beta}")
    for flag in ("num_scenes", "episodes_per_scene", "workers", "drive_workers", "max_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.scene_offset < 0:
        parser.error(f"--scene-offset must be >= 0, got {args.scene_offset}")
    if not (args.policy_checkpoint / "config.json").is_file():
        parser.error(f"--policy-checkpoint {args.policy_checkpoint}: not a WNM checkpoint directory (no config.json)")
    out_dir, occ_dir = args.output_dir.resolve(), args.occupancy_dir.resolve()
    if out_dir == occ_dir or out_dir in occ_dir.parents or occ_dir in out_dir.parents:
        parser.error("--output-dir and --occupancy-dir must be separate folders (neither inside the other)")
    refuse_nonempty_dir(out_dir, "--output-dir")
    refuse_nonempty_dir(occ_dir, "--occupancy-dir")

    from verl_omni.contracts import MANIFEST_NAME
    from verl_omni.data.hashing import file_sha256
    from verl_omni.sim.collector import CollectorConfig, SceneError, SynthesisConfig
    from verl_omni.sim.dagger import collect_dagger_round, dagger_collection_meta, write_collection_meta
    from verl_omni.sim.levels import get_level
    from verl_omni.sim.loop_pool import reuse_when_in_process
    from verl_omni.sim.render import CameraConfig
    from verl_omni.sim.wnm_policy import WNMPolicy

    try:
        level = get_level(args.level)
    except ValueError as e:
        parser.error(f"--level: {e}")
    learner = functools.partial(WNMPolicy.from_checkpoint, args.policy_checkpoint, device=args.device,
                                dtype=args.dtype, num_steps=args.num_steps)  # fmt: skip
    loaded = learner()  # loads once here: a bad checkpoint fails before any scene is made
    h, w = loaded.image_size
    learner = reuse_when_in_process(learner, loaded, args.drive_workers)
    collector = CollectorConfig(camera=CameraConfig(width=w, height=h), min_goal_distance_m=level.min_goal_distance_m,
                                **label_fields(args))  # fmt: skip
    cfg = SynthesisConfig(
        num_scenes=args.num_scenes,
        episodes_per_scene=args.episodes_per_scene,
        floorplan=level.floorplan(),
        collector=collector,
    )
    start = time.perf_counter()
    temps: list[Path] = []
    try:
        for d in (out_dir, occ_dir):
            d.parent.mkdir(parents=True, exist_ok=True)
            temps.append(Path(tempfile.mkdtemp(prefix=f".{d.name}.partial-", dir=d.parent)))
        tmp_out, tmp_occ = temps
        (tmp_out / "episodes").mkdir()
        summary = collect_dagger_round(
            learner, cfg, args.seed, args.beta, tmp_out / "episodes", tmp_occ, workers=args.workers,
            scene_offset=args.scene_offset, max_steps=args.max_steps, progress=not args.no_progress,
            drive_workers=args.drive_workers, execute_steps=args.execute_steps,
        )  # fmt: skip
        info = {
            "name": args.policy_checkpoint.resolve().name,
            "manifest_sha256": file_sha256(args.policy_checkpoint / MANIFEST_NAME),
        }
        meta = dagger_collection_meta(cfg, args.seed, args.beta, info)
        meta["level"] = level.name
        meta["dagger_summary"] = summary
        write_collection_meta(tmp_out / "collection.json", meta)
        refuse_nonempty_dir(out_dir, "--output-dir")
        refuse_nonempty_dir(occ_dir, "--occupancy-dir")
        tmp_occ.replace(occ_dir)
        temps.remove(tmp_occ)
        tmp_out.replace(out_dir)
        temps.remove(tmp_out)
    except SceneError as e:
        print(f"error: {e} (nothing was written)", file=sys.stderr)
        return 1
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
    print(f"wrote {out_dir} and {occ_dir}")
    for k, v in summary.items():
        print(f"  {k + ':':<28} {v}")
    print(f"  seconds:                     {time.perf_counter() - start:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
