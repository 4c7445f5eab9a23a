"""DAgger collector: episode records follow docs/contracts.md and agree with the scene and the videos."""

import json

import numpy as np
import pytest

from verl_omni.data.actions import first_stop_index, poses_to_actions
from verl_omni.data.video import count_frames, read_frames
from verl_omni.sim.collector import CollectorConfig, SynthesisConfig, synthesize_scene
from verl_omni.sim.events import EVENT_NAMES
from verl_omni.sim.floorplan import FloorPlan, FloorPlanConfig
from verl_omni.sim.render import CameraConfig, Renderer


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    root = tmp_path_factory.mktemp("collection")
    cfg = SynthesisConfig(
        num_scenes=1,
        episodes_per_scene=2,
        collector=CollectorConfig(camera=CameraConfig(width=16, height=16)),
    )
    (root / "episodes").mkdir()
    summary = synthesize_scene(0, 5, cfg, root / "episodes", root / "occ")
    return root, cfg, summary


def test_records_follow_the_contract(scene):
    root, cfg, summary = scene
    plan = FloorPlan.load(root / "occ" / "s0000")
    occ = plan.occupancy()
    episodes = sorted((root / "episodes").iterdir())
    assert [e.name for e in episodes] == ["s0000_e000", "s0000_e001"] and summary["episodes"] == 2
    n_queries = 0
    for ep in episodes:
        rec = json.loads((ep / "episode.json").read_text())
        assert rec["scene_id"] == "s0000" and rec["episode_id"] == ep.name
        assert len(rec["instructions"]) == 3 and len(set(rec["instructions"])) == 3
        assert rec["goal_object"]["name"] in rec["instructions"][0]
        poses = np.array(rec["poses"])
        assert poses.shape[1] == 3 and np.isfinite(poses).all()
        assert count_frames(ep / rec["video"]) == len(poses)
        # The robot never overlaps an obstacle and moves at most one step per frame.
        assert not occ.disc_collides(poses[:, :2], cfg.collector.planner.robot_radius).any()
        assert np.hypot(*np.diff(poses[:, :2], axis=0).T).max() <= cfg.collector.planner.step_length + 1e-9
        goal = np.array(rec["goal"])
        if rec["policy_stopped"]:
            assert np.linalg.norm(poses[-1, :2] - goal) <= rec["success_radius"]
        ts = [q["t"] for q in rec["queries"]]
        assert ts == sorted(set(ts)) and ts[0] == 0 and ts[-1] == len(poses) - 1
        for q in rec["queries"]:
            ref = np.array(q["reference_poses"])
            stop = np.array(q["reference_stop"])
            assert ref.shape == (33, 3) and stop.shape == (32,)
            np.testing.assert_allclose(ref[0], poses[q["t"]])
            k = int(first_stop_index(stop))
            assert stop[k:].all()  # flags stay 1 once the expert stopped
            if k < 32:
                np.testing.assert_allclose(ref[k:], np.repeat(ref[k : k + 1], 33 - k, axis=0))
                assert np.linalg.norm(ref[k, :2] - goal) <= cfg.collector.planner.stop_distance + 1e-6
            actions = poses_to_actions(ref, stop)
            assert np.abs(actions[:, 1]).max() < 1e-6  # expert motion is straight ahead
            assert not occ.disc_collides(ref[:, :2], cfg.collector.planner.robot_radius).any()
            assert set(q["events"]) <= set(EVENT_NAMES)
            assert count_frames(ep / q["reference_video"]) == 33
        n_queries += len(ts)
        # The stored video shows what the renderer draws at the recorded poses.
        frames = read_frames(ep / rec["video"], [0, len(poses) - 1])
        direct = Renderer(plan, cfg.collector.camera).render(poses[[0, -1]])
        assert np.abs(frames.astype(int) - direct).mean() < 3.0
    assert n_queries == summary["queries"]


def test_scene_is_reproducible(scene, tmp_path):
    root, cfg, summary = scene
    (tmp_path / "episodes").mkdir()
    again = synthesize_scene(0, 5, cfg, tmp_path / "episodes", tmp_path / "occ")
    assert again == summary
    for name in ("s0000_e000", "s0000_e001"):
        a = (root / "episodes" / name / "episode.json").read_bytes()
        assert a == (tmp_path / "episodes" / name / "episode.json").read_bytes()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="success_radius"):
        CollectorConfig(success_radius=0.1)
    with pytest.raises(ValueError, match="episodes_per_scene"):
        SynthesisConfig(episodes_per_scene=0)
    with pytest.raises(ValueError, match="robot_radius"):
        SynthesisConfig(floorplan=FloorPlanConfig(robot_radius=0.3))
