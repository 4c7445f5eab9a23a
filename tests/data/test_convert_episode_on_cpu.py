"""Per-episode conversion: hand-computed rows, and each bad input skipped under its reason."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from gn0_test_builders import write_collection_json, write_episode, write_scene

from verl_omni.data.convert import (
    EpisodeTask,
    convert_episode,
    episode_split,
    history_indices,
    iter_episode_results,
)

NORM = {
    "version": 1,
    "channels": ["dx", "dy", "dyaw", "stop"],
    "mean": [0.05, 0.0, 0.0, 0.0],
    "std": [0.1, 0.2, 0.3, 1.0],
}


@pytest.fixture()
def world(tmp_path):
    root, occ = tmp_path / "col", tmp_path / "occ"
    write_collection_json(root, 1)
    write_scene(occ, "scene_a")
    return root, occ


def _task(root, occ, episode_id="e1", **kw) -> EpisodeTask:
    return EpisodeTask(str(root), str(occ), episode_id, NORM, **kw)


def test_history_indices_clamp_at_zero():
    assert history_indices(5).tolist() == [0] * 28 + [1, 2, 3, 4, 5]
    assert history_indices(40).tolist() == list(range(8, 41))


def test_rows_of_a_valid_episode_match_hand_computation(world):
    root, occ = world
    write_episode(root, "e1")
    result = convert_episode(_task(root, occ, split="train"))
    assert result.skipped == [] and result.records == 2 and len(result.rows) == 4
    assert [r.sample_id for r in result.rows] == [
        "e1/t000005/i000",
        "e1/t000005/i001",
        "e1/t000036/i000",
        "e1/t000036/i001",
    ]
    first, late = result.rows[0], result.rows[3]
    assert first.instruction == "go forward" and late.instruction == "drive ahead"
    assert first.history_video == "episodes/e1/rgb.mp4" and first.target_video == "episodes/e1/ref_5.mp4"
    assert first.history_frames.tolist() == [0] * 28 + [1, 2, 3, 4, 5]
    assert late.history_frames.tolist() == list(range(4, 37))
    assert first.target_frames.tolist() == list(range(33))
    np.testing.assert_allclose(first.start_pose, [0.5, 0.0, 0.0])
    # Straight drive at 0.1 m/step, yaw 0: raw (0.1, 0, 0, 0) -> ((0.1 - 0.05) / 0.1, 0, 0, 0) = (0.5, 0, 0, 0).
    np.testing.assert_allclose(first.expert_actions, np.tile([0.5, 0.0, 0.0, 0.0], (32, 1)), atol=1e-6)
    # Query 36 stops at step 10: steps 0-9 move (0.5), steps 10-31 stand still ((0 - 0.05) / 0.1 = -0.5), stop 1.
    expected = np.zeros((32, 4))
    expected[:10, 0], expected[10:, 0], expected[10:, 3] = 0.5, -0.5, 1.0
    np.testing.assert_allclose(late.expert_actions, expected, atol=1e-6)
    assert late.reference_stop.tolist() == [0] * 10 + [1] * 22
    assert first.events == ("collision_precursor",) and late.events == ("required_stop",)
    assert first.occupancy == "scene_a" and first.split == "train" and first.success_radius == 0.5


def test_split_is_a_stable_hash_of_seed_and_episode():
    for eid in ("a", "s0001_e003", "zz"):
        digest = hashlib.sha256(f"7\x1f{eid}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2.0**64
        assert episode_split(eid, 0.5, 7) == ("val" if u < 0.5 else "train")
        assert episode_split(eid, 0.0, 7) == "train" and episode_split(eid, 1.0, 7) == "val"


def _only_skip(result):
    (item,) = result.skipped
    return item


def test_corrupted_video_is_skipped(world):
    root, occ = world
    ep = write_episode(root, "e1")
    data = bytearray((ep / "rgb.mp4").read_bytes())
    data[len(data) // 3 :] = bytes(len(data) - len(data) // 3)  # zero the tail: header intact, frames gone
    (ep / "rgb.mp4").write_bytes(bytes(data))
    result = convert_episode(_task(root, occ))
    item = _only_skip(result)
    assert result.rows == [] and item.reason == "unreadable_video" and item.t is None and "rgb.mp4" in item.detail


def test_garbage_video_is_skipped(world):
    root, occ = world
    ep = write_episode(root, "e1")
    (ep / "ref_36.mp4").write_bytes(b"not a video at all" * 10)
    result = convert_episode(_task(root, occ))
    item = _only_skip(result)
    assert item.reason == "unreadable_video" and item.t == 36 and "ref_36.mp4" in item.detail
    assert {r.query_t for r in result.rows} == {5} and result.records == 1


def test_truncated_episode_json_is_skipped(world):
    root, occ = world
    ep = write_episode(root, "e1")
    text = (ep / "episode.json").read_text()
    (ep / "episode.json").write_text(text[:-40])
    assert _only_skip(convert_episode(_task(root, occ))).reason == "unreadable_json"


def test_pose_frame_count_mismatch_is_skipped(world):
    root, occ = world
    ep = write_episode(root, "e1")
    doc = json.loads((ep / "episode.json").read_text())
    doc["poses"].append(doc["poses"][-1])
    (ep / "episode.json").write_text(json.dumps(doc))
    item = _only_skip(convert_episode(_task(root, occ)))
    assert item.reason == "pose_frame_mismatch" and "41" in item.detail and "40" in item.detail


def test_missing_reference_video_and_missing_scene(world):
    root, occ = world
    ep = write_episode(root, "e1")
    (ep / "ref_5.mp4").unlink()
    assert _only_skip(convert_episode(_task(root, occ))).reason == "missing_file"
    write_episode(root, "e2", scene_id="scene_missing")
    item = _only_skip(convert_episode(_task(root, occ, "e2")))
    assert item.reason == "unknown_scene" and "scene_missing" in item.detail


def test_malformed_scene_is_unreadable(world):
    root, occ = world
    write_scene(occ, "scene_b")
    (occ / "scene_b" / "occupancy.json").write_text("{")
    write_episode(root, "e1", scene_id="scene_b")
    assert _only_skip(convert_episode(_task(root, occ))).reason == "unreadable_scene"


def test_parallel_map_keeps_input_order(world):
    root, occ = world
    for i in range(4):
        write_episode(root, f"e{i}", queries=((33 + i, None, []),), num_poses=40)
    tasks = [_task(root, occ, f"e{i}") for i in (3, 0, 2, 1)]
    serial = [r.episode_id for r in iter_episode_results(tasks, workers=1, prefetch=1)]
    parallel = list(iter_episode_results(tasks, workers=2, prefetch=1))
    assert serial == [r.episode_id for r in parallel] == ["e3", "e0", "e2", "e1"]
    assert [r.rows[0].history_frames[-1] for r in parallel] == [36, 33, 35, 34]
