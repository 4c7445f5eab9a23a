"""Shared builders for the reward tests (imported by this folder's test files): hand-built maps and batches, and
small GN0 collections synthesized with the user command's code (real query states)."""

import importlib.util
from pathlib import Path

import numpy as np

from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap
from verl_omni.utils.reward_score import RewardBatch, SceneCache, build_reward_set

REPO = Path(__file__).resolve().parents[2]
RES = 0.1  # metres per cell in every test map: cell (row, col) has its centre at (0.1 col + 0.05, 0.1 row + 0.05)


def centre(row: int, col: int) -> tuple[float, float]:
    return (col * RES + 0.5 * RES, row * RES + 0.5 * RES)


def walled_room(rows: int, cols: int) -> np.ndarray:
    occ = np.zeros((rows, cols), bool)
    occ[0, :] = occ[-1, :] = occ[:, 0] = occ[:, -1] = True
    return occ


def make_batch(
    actions, start, goal, reference=None, success_radius=0.5, events=(), scene_id="room", ids=None, **extra
) -> RewardBatch:
    """One or more rollouts; ``actions [N, 32, 4]`` and everything else broadcast to N."""
    actions = np.asarray(actions, dtype=np.float64)
    n = actions.shape[0]
    start = np.broadcast_to(np.asarray(start, dtype=np.float64), (n, 3))
    if reference is None:
        reference = np.repeat(start[:, None, :], 33, axis=1)
    reference = np.broadcast_to(np.asarray(reference, dtype=np.float64), (n, 33, 3))
    events = [list(events)] * n if not events or isinstance(events[0], str) else [list(e) for e in events]
    scene_ids = [scene_id] * n if isinstance(scene_id, str) else list(scene_id)
    return RewardBatch(
        actions=actions,
        start_pose=start,
        reference_poses=reference,
        goal=np.broadcast_to(np.asarray(goal, dtype=np.float64), (n, 2)),
        success_radius=np.full(n, success_radius),
        events=events,
        scene_id=scene_ids,
        rollout_id=ids or [f"r{i}" for i in range(n)],
        **extra,
    )


def straight_actions(n_steps: int, dx=0.0, dy=0.0, dyaw=0.0, stop_at=None) -> np.ndarray:
    """``[1, 32, 4]``: ``n_steps`` steps of (dx, dy, dyaw), zeros after, STOP flag from ``stop_at`` on."""
    a = np.zeros((1, 32, 4))
    a[0, :n_steps, 0], a[0, :n_steps, 1], a[0, :n_steps, 2] = dx, dy, dyaw
    if stop_at is not None:
        a[0, stop_at:, 3] = 1.0
    return a


def make_reward_set(maps: dict, rewards: dict, **top):
    """A reward set over in-memory maps ``{scene_id: occupied bool [H, W]}`` (resolution ``RES``, origin 0)."""
    cache = SceneCache()
    for scene_id, occ in maps.items():
        cache.add(scene_id, OccupancyMap.from_grid(occ, RES, (0.0, 0.0), scene_id=scene_id))
    # The evaluator's footprint (0.2 m), so that the hand numbers are those of the recipe's geometry.
    config = {"robot_radius": ROBOT_RADIUS_M, "rewards": rewards, **top}
    return build_reward_set(config, scene_cache=cache)


def synthesize_collection(root: Path, num_scenes: int, episodes_per_scene: int, seed: int = 11) -> tuple[Path, Path]:
    """Synthesizes a GN0 collection under ``root`` with ``tools/data/synthesize_gn0_collection.py`` (16 px images:
    the image size does not change the poses) and returns ``(collection_dir, occupancy_dir)``."""
    spec = importlib.util.spec_from_file_location(
        "synthesize_gn0_collection", REPO / "tools" / "data" / "synthesize_gn0_collection.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    collection, occupancy = root / "c", root / "o"
    args = ["--output-dir", str(collection), "--occupancy-dir", str(occupancy), "--num-scenes", str(num_scenes)]
    args += ["--episodes-per-scene", str(episodes_per_scene), "--image-size", "16", "--seed", str(seed)]
    assert tool.main(args) == 0
    return collection, occupancy
