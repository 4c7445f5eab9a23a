"""Builders of tiny, hand-specified GN0 collections for the data tests (not a test module itself).

The episodes are straight-line drives so that expected rows can be computed by hand: the robot moves
``STEP`` metres along +x per frame with yaw 0, so every raw expert action is ``(STEP, 0, 0, stop)``.
Frame ``k`` of a video is a flat grey image of value ``frame_value(k)`` so decoded frames identify their
index.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

STEP = 0.1
IMAGE = 16
FPS = 8


def frame_value(k: int) -> int:
    """Grey level of frame ``k`` (spaced 6 apart so H.264 noise cannot confuse neighbours)."""
    return (20 + 6 * k) % 250


def grey_frames(values: list[int]) -> np.ndarray:
    """``uint8 [len(values), IMAGE, IMAGE, 3]`` flat frames."""
    return np.repeat(np.asarray(values, np.uint8)[:, None, None, None], IMAGE * IMAGE * 3).reshape(
        len(values), IMAGE, IMAGE, 3
    )


def write_scene(occupancy_root: Path, scene_id: str) -> None:
    """A 60 x 20 cell corridor (0.1 m cells) with walls on its border."""
    from verl_omni.data.occupancy import OccupancyMap

    occupied = np.zeros((20, 60), bool)
    occupied[0, :] = occupied[-1, :] = occupied[:, 0] = occupied[:, -1] = True
    OccupancyMap.from_grid(occupied, 0.1, origin=(-0.5, -1.0), scene_id=scene_id).save(occupancy_root / scene_id)


def write_collection_json(root: Path, num_episodes: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "episodes").mkdir(exist_ok=True)
    info = {
        "format": "gn0-dagger/1",
        "fps": FPS,
        "image_size": [IMAGE, IMAGE],
        "policy": {"kind": "hand-made"},
        "seed": 0,
        "num_scenes": 1,
        "num_episodes": num_episodes,
        "history_frames": 33,
        "target_frames": 33,
    }
    (root / "collection.json").write_text(json.dumps(info))


def reference(t: int, stop_at: int | None) -> tuple[list[list[float]], list[int]]:
    """Expert poses/stops from query ``t``: straight on, standing still from step ``stop_at`` on."""
    poses, stops = [], []
    x = STEP * t
    for j in range(33):
        poses.append([x, 0.0, 0.0])
        if j < 32:
            stopped = stop_at is not None and j >= stop_at
            stops.append(int(stopped))
            if not stopped:
                x += STEP
    return poses, stops


def write_episode(
    root: Path,
    episode_id: str,
    scene_id: str = "scene_a",
    num_poses: int = 40,
    queries: tuple[tuple[int, int | None, list[str]], ...] = (
        (5, None, ["collision_precursor"]),
        (36, 10, ["required_stop"]),
    ),
    instructions: tuple[str, ...] = ("go forward", "drive ahead"),
) -> Path:
    """Writes one straight-line episode (JSON + policy video + one reference video per query)."""
    from verl_omni.data.video import write_video

    ep = root / "episodes" / episode_id
    ep.mkdir(parents=True)
    poses = [[STEP * k, 0.0, 0.0] for k in range(num_poses)]
    write_video(ep / "rgb.mp4", grey_frames([frame_value(k) for k in range(num_poses)]), FPS)
    records = []
    for t, stop_at, events in queries:
        ref_poses, ref_stop = reference(t, stop_at)
        write_video(ep / f"ref_{t}.mp4", grey_frames([frame_value(100 + j) for j in range(33)]), FPS)
        records.append(
            {
                "t": t,
                "reference_poses": ref_poses,
                "reference_stop": ref_stop,
                "reference_video": f"ref_{t}.mp4",
                "events": events,
            }
        )
    doc = {
        "episode_id": episode_id,
        "scene_id": scene_id,
        "instructions": list(instructions),
        "goal": [4.5, 0.0],
        "success_radius": 0.5,
        "video": "rgb.mp4",
        "poses": poses,
        "queries": records,
    }
    (ep / "episode.json").write_text(json.dumps(doc))
    return ep


def make_checkpoint(path: Path, mean=(0.05, 0.0, 0.0, 0.0), std=(0.1, 0.2, 0.3, 1.0)) -> Path:
    """A complete tiny WNM checkpoint whose action normalization is ``mean``/``std``."""
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, build_wnm_model, save_wnm_checkpoint

    model = build_wnm_model(WNMConfig.from_size("tiny"), ActionNormalization(mean=mean, std=std))
    return save_wnm_checkpoint(model, path, {"made_by": "tests/data"})


def load_tool(name: str, folder: str = "data"):
    """Imports ``tools/<folder>/<name>.py`` as a module (the tools are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{folder}_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_row(episode_id: str, t: int, k: int = 0, events=(), split: str = "train", seed: int = 0):
    """A schema-valid row with arbitrary (seeded) numbers, for tests that do not decode frames."""
    from verl_omni.data.schema import Stage3Row, make_sample_id

    rng = np.random.default_rng(seed)
    return Stage3Row(
        sample_id=make_sample_id(episode_id, t, k),
        episode_id=episode_id,
        scene_id="scene_a",
        instruction=f"instruction {k}",
        instruction_index=k,
        query_t=t,
        history_video=f"episodes/{episode_id}/rgb.mp4",
        history_frames=np.maximum(np.arange(t - 32, t + 1), 0),
        target_video=f"episodes/{episode_id}/ref_{t}.mp4",
        target_frames=np.arange(33),
        start_pose=rng.normal(size=3),
        reference_poses=rng.normal(size=(33, 3)),
        reference_stop=np.zeros(32, np.uint8),
        goal=rng.normal(size=2),
        success_radius=0.5,
        events=tuple(events),
        expert_actions=rng.normal(size=(32, 4)).astype(np.float32),
        occupancy="scene_a",
        split=split,
    )
