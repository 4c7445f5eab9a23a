"""Benchmark: rollouts scored per second on CPU by the official reward set.

Builds synthetic indoor scenes (walled rooms with random pillars), a batch of rollouts grouped as prompts x 16
(rollouts of a prompt share scene, start, goal and reference, like a GRPO group) and times ``RewardSet.score``.
The first (cold) call includes loading scenes and computing clearance / geodesic fields; later (warm) calls are
what a reward worker pays per training step. Prints a table; asserts nothing.

    python scripts/bench_rewards.py --batch 1024 --scenes 8 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _scene(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    occ = np.zeros((rows, cols), bool)
    occ[0, :] = occ[-1, :] = occ[:, 0] = occ[:, -1] = True
    for _ in range(rows * cols // 400):  # 3x3-cell pillars scattered over the room
        r, c = rng.integers(3, rows - 4), rng.integers(3, cols - 4)
        occ[r : r + 3, c : c + 3] = True
    occ[rows // 2 - 8 : rows // 2 + 9, 1:24] = False  # keep the start area free
    return occ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024, help="rollouts per batch (multiple of --group)")
    parser.add_argument("--group", type=int, default=16, help="rollouts per prompt")
    parser.add_argument("--scenes", type=int, default=8, help="distinct occupancy scenes")
    parser.add_argument("--grid", type=int, nargs=2, default=(120, 200), metavar=("ROWS", "COLS"))
    parser.add_argument("--resolution", type=float, default=0.05, help="metres per cell")
    parser.add_argument("--repeats", type=int, default=5, help="warm timing repeats")
    parser.add_argument("--latent-shape", type=int, nargs="+", default=(16, 9, 8, 8), help="per-rollout latent shape")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.group < 1 or args.batch % args.group:
        parser.error(f"--batch ({args.batch}) must be a positive multiple of --group ({args.group})")
    if args.scenes < 1 or args.repeats < 1 or args.resolution <= 0 or min(args.grid) < 32:
        parser.error("--scenes and --repeats must be >= 1, --resolution > 0 and --grid at least 32 x 32")

    import torch

    from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap
    from verl_omni.utils.reward_score import RewardBatch, SceneCache, build_reward_set

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    rows, cols = args.grid
    res = args.resolution
    cache = SceneCache()
    for s in range(args.scenes):
        cache.add(f"scene{s}", OccupancyMap.from_grid(_scene(rng, rows, cols), res, (0.0, 0.0), scene_id=f"scene{s}"))
    reward_set = build_reward_set(
        {
            "robot_radius": ROBOT_RADIUS_M,  # the evaluator's footprint, as in the locked recipe
            "rewards": {
                "navigation": {},
                "collision": {},
                "yaw": {},
                "stop": {},
                "vision": {},
                "flow": {"weight": 0.0},
            },
        },
        scene_cache=cache,
    )

    n, prompts = args.batch, args.batch // args.group
    prompt = np.arange(n) // args.group
    start = np.zeros((prompts, 3))
    start[:, 0], start[:, 1] = 8 * res, (rows // 2 + rng.uniform(-2, 2, prompts)) * res
    goal = np.stack([rng.uniform(0.6, 0.9, prompts) * cols * res, rng.uniform(0.2, 0.8, prompts) * rows * res], 1)
    ref = np.zeros((prompts, 33, 3))
    ref[..., 0] = start[:, None, 0] + 0.08 * np.arange(33)
    ref[..., 1] = start[:, None, 1]
    actions = np.zeros((n, 32, 4))
    actions[..., 0] = rng.uniform(0.0, 0.12, (n, 32))
    actions[..., 1] = rng.normal(0.0, 0.01, (n, 32))
    actions[..., 2] = rng.normal(0.0, 0.1, (n, 32))
    actions[..., 3] = rng.random((n, 32)) < 0.01
    events_pool = [[], ["required_stop"], ["collision_precursor"], ["near_goal_continuation"]]
    latent_shape = (n, *args.latent_shape)
    batch = RewardBatch(
        actions=actions,
        start_pose=start[prompt],
        reference_poses=ref[prompt],
        goal=goal[prompt],
        success_radius=np.full(n, 0.5),
        events=[events_pool[p % 4] for p in prompt],
        scene_id=[f"scene{p % args.scenes}" for p in prompt],
        rollout_id=[f"p{p}_r{i}" for i, p in enumerate(prompt)],
        generated_latents=torch.randn(latent_shape),
        target_latents=torch.randn(latent_shape),
    )

    t0 = time.perf_counter()
    out = reward_set.score(batch)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        reward_set.score(batch)
        warm.append(time.perf_counter() - t0)
    best, median = min(warm), float(np.median(warm))
    print(
        f"reward set: {[m.name for m in reward_set.active_modules]}; batch {n} = {prompts} prompts x {args.group}; "
        f"{args.scenes} scenes of {rows}x{cols} cells @ {res} m; latents {list(args.latent_shape)}; "
        f"torch threads {args.threads}"
    )
    print(f"{'call':<22}{'seconds':>10}{'rollouts/s':>14}")
    print(f"{'cold (fields built)':<22}{cold:>10.3f}{n / cold:>14.0f}")
    print(f"{'warm median':<22}{median:>10.3f}{n / median:>14.0f}")
    print(f"{'warm best':<22}{best:>10.3f}{n / best:>14.0f}")
    hard = out.diagnostics["collision/hard"].sum(axis=1)
    stopped = out.diagnostics["geometry/stop_step"] < 32
    print(
        f"sanity: {int(hard.sum())} hard collisions, {int(stopped.sum())} STOPs, {len(out.warnings)} warnings, "
        f"mean nav_1 {out.scores['nav_1'].mean():.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
