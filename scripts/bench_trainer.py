#!/usr/bin/env python
"""Stage-III trainer step benchmark: builds a synthesized workspace with the real data commands, trains a
few steps through Ray (FSDP2 actors, NCCL on GPUs / gloo on CPU) and prints the step-time table per phase
(rollout, reward, old-logp, update, checkpoint) plus throughput and peak memory from the run's metrics.

    python scripts/bench_trainer.py --size small --image-size 128 --gpus 1 --steps 2 --workdir /tmp/bench
    python scripts/bench_trainer.py --size tiny --cpu-workers 2 --steps 2 --workdir /tmp/bench_cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from stage3_e2e_helpers import build_workspace, run_cli, write_trainer_config  # noqa: E402

# A Wan-size DiT with the project's built-in text and image encoders, 256 image tokens, the tiny VAE and 4
# geometry frames: the DiT is full size, the parts around it are small enough to build on a machine without the
# real encoders' weights (no network on the GPU machine). docs/benchmarks.md measures wan2.1-1.3b this way.
LIGHT_ENCODERS = (
    "text_encoder_kind=builtin",
    "image_encoder_kind=builtin",
    "image_tokens=256",
    "vae_kind=tiny",
    "geometry_frames=4",
)


def checkpoint_overrides(light_encoders: bool, ckpt_set: list[str]) -> tuple[str, ...]:
    """The checkpoint's WNMConfig overrides: the light-encoder set first, so that ``--ckpt-set`` items override it."""
    return (LIGHT_ENCODERS if light_encoders else ()) + tuple(ckpt_set)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path, help="new directory for the workspace and the run")
    ap.add_argument("--size", default="tiny", help="model size preset (tiny, small, ...)")
    ap.add_argument("--image-size", type=int, default=64, help="must match the size preset's image size")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs per node (0 = CPU workers)")
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (16 rollouts each)")
    ap.add_argument("--denoising-steps", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=8, help="rollouts per forward/backward per rank")
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--ckpt-set", action="append", default=[], help="WNMConfig override for the checkpoint")
    ap.add_argument(
        "--light-encoders",
        action="store_true",
        help="the checkpoint keeps the size's DiT but uses the built-in encoders, 256 image tokens, the tiny VAE and "
        "4 geometry frames (" + ", ".join(LIGHT_ENCODERS) + "); --ckpt-set items override these",
    )
    ap.add_argument("--compile", action="store_true", help="actor.compile=true (torch.compile the DiT blocks)")
    ap.add_argument("--no-reshard", action="store_true", help="actor.reshard_after_forward=false")
    ap.add_argument("--scenes", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=4, help="episodes per scene")
    ap.add_argument("--workspace-only", action="store_true", help="build the workspace and stop")
    ap.add_argument("--reuse-workspace", action="store_true", help="train on the workspace an earlier call built")
    args = ap.parse_args()
    ws_file = args.workdir / "workspace.json"
    t0 = time.perf_counter()
    if args.reuse_workspace:
        if not ws_file.is_file():
            ap.error(f"--reuse-workspace: {ws_file} not found; run with --workspace-only first")
        ws = {k: (Path(v) if isinstance(v, str) else v) for k, v in json.loads(ws_file.read_text()).items()}
        if (args.workdir / "out").exists():
            ap.error(f"{args.workdir / 'out'} already exists; use a new --workdir")
    else:
        if args.workdir.exists():
            ap.error(f"--workdir {args.workdir} already exists; choose a new directory")
        ws = build_workspace(
            args.workdir / "ws",
            scenes=args.scenes,
            episodes=args.episodes,
            size=args.size,
            image_size=args.image_size,
            train_size=2 * args.prompts,
            sft_steps=args.sft_steps,
            workers=4 if args.gpus else 1,
            ckpt_overrides=checkpoint_overrides(args.light_encoders, args.ckpt_set),
        )
        ws_file.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in ws.items()}))
    print(f"workspace: {time.perf_counter() - t0:.1f} s (size {args.size}, {args.image_size}px) in {args.workdir}")
    if args.workspace_only:
        return 0
    world = args.gpus or args.cpu_workers
    over = {
        "topology.gpus_per_node": args.gpus,
        "topology.cpu_workers_per_node": args.cpu_workers,
        "topology.prompts_per_step": args.prompts,
        "topology.ppo_mini_batch_prompts": args.prompts,
        "topology.micro_batch_rollouts": min(args.micro_batch, 16 * args.prompts // world),
        "rollout.num_steps": args.denoising_steps,
        "rollout.window.range": [0, args.denoising_steps - 1],
        "rollout.micro_batch_size": 16,
        "trainer.total_steps": args.steps,
        "trainer.save_freq": args.steps,
        "trainer.val_freq": 0,
        "trainer.log_media_freq": 0,
        "trainer.deterministic": not args.gpus,
        "actor.compile": args.compile,
        "actor.reshard_after_forward": not args.no_reshard,
    }
    cfg_dir = args.workdir / "config"
    out = args.workdir / "out"
    write_trainer_config(cfg_dir / "run.yaml", ws, out, **over)
    proc = run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"], timeout=3000
    )
    print(proc.stdout[-6000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(
        f"{'step':>4}{'rollout s':>11}{'reward s':>10}{'update s':>10}{'step s':>9}{'rollouts/s':>12}"
        f"{'rollout GB':>12}{'update GB':>11}"
    )
    for r in rows:
        print(
            f"{r['step']:>4}{r['timing/rollout_s']:>11.2f}{r['timing/reward_s']:>10.2f}{r['timing/update_s']:>10.2f}"
            f"{r['timing/step_s']:>9.2f}{r['perf/rollouts_per_s']:>12.2f}{r['memory/rollout_peak_gb']:>12.2f}"
            f"{r.get('memory/update_peak_gb', float('nan')):>11.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
