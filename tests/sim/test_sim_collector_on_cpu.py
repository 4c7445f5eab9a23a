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


def _one_scene(root, seed: int, size: int, level: str | None = None, face: bool = False, **synthesis):
    """Synthesizes scene 0 of ``seed`` into ``root/episodes`` and ``root/occ``; returns ``(cfg, summary)``."""
    from verl_omni.sim.levels import get_level

    floorplan = {"floorplan": get_level(level).floorplan()} if level else {}
    collector = CollectorConfig(camera=CameraConfig(width=size, height=size), face_goal_object=face)
    cfg = SynthesisConfig(num_scenes=1, collector=collector, **floorplan, **synthesis)
    (root / "episodes").mkdir(parents=True)
    return cfg, synthesize_scene(0, seed, cfg, root / "episodes", root / "occ")


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    root = tmp_path_factory.mktemp("collection")
    cfg, summary = _one_scene(root, 5, 16, episodes_per_scene=2)
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
            # Where the goal object is drawn in the query's own frame: null or inside the 90-degree view.
            bearing, reach = q["goal_object_bearing"], q["goal_object_distance"]
            assert bearing is None or abs(bearing) <= np.radians(cfg.collector.camera.fov_deg) / 2
            assert (bearing is None) == (reach is None) and (reach is None or reach >= 0)
        n_queries += len(ts)
        # The stored video shows what the renderer draws at the recorded poses.
        frames = read_frames(ep / rec["video"], [0, len(poses) - 1])
        direct = Renderer(plan, cfg.collector.camera).render(poses[[0, -1]])
        assert np.abs(frames.astype(int) - direct).mean() < 3.0
    assert n_queries == summary["queries"]


@pytest.fixture(scope="module")
def one_room(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_room")
    _one_scene(root, 3, 32, "one_room", episodes_per_scene=4, goal_variants=3)
    return root


def test_goal_object_bearing_agrees_with_the_rendered_frame(one_room):
    # Independent of the ray caster the collector uses: where a bearing is recorded the goal object's colour is in
    # the stored frame; where none is, that colour is absent unless another piece of the scene shares it. The
    # renderer dims with distance, so colours are compared by direction (chromaticity); white and black goals,
    # whose direction the grey surfaces share, are left out.
    root = one_room
    plan = FloorPlan.load(root / "occ" / "s0000")
    agree = []
    for ep in sorted((root / "episodes").iterdir()):
        rec = json.loads((ep / "episode.json").read_text())
        goal = rec["goal_object"]
        colour = np.array(next(f.rgb for f in plan.furniture if f.name == goal["name"]))
        unique = sum(f.colour == goal["colour"] for f in plan.furniture) == 1
        if goal["colour"] in ("white", "black"):
            continue
        frames = read_frames(ep / rec["video"], [q["t"] for q in rec["queries"]])
        for q, frame in zip(rec["queries"], frames, strict=True):
            px = frame.astype(float) + 1e-6
            cos = (px @ colour) / (np.linalg.norm(px, axis=-1) * np.linalg.norm(colour))
            drawn = bool((cos > 0.995).any())
            recorded = q["goal_object_bearing"] is not None
            if recorded or unique:
                agree.append((drawn, recorded))
    assert sum(r for _, r in agree) >= 10 and sum(not r for _, r in agree) >= 10  # both cases are checked
    share = np.mean([d == r for d, r in agree])
    assert share >= 0.9, f"{share:.0%} of {len(agree)} query frames agree"


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


def test_face_goal_object_expert_stops_looking_at_it(tmp_path):
    from verl_omni.sim.search_expert import object_sightings

    def stop_views(face: bool) -> list[bool]:
        root = tmp_path / f"face_{face}"
        _one_scene(root, 3, 32, "one_room", face, episodes_per_scene=4)
        plan = FloorPlan.load(root / "occ" / "s0000")
        seen = []
        for ep in sorted((root / "episodes").iterdir()):
            rec = json.loads((ep / "episode.json").read_text())
            index = next(f.index for f in plan.furniture if f.name == rec["goal_object"]["name"])
            for q in rec["queries"]:
                k = int(first_stop_index(np.array(q["reference_stop"])))
                if k < 32:  # the pose the expert stops at, seen by an independent ray cast
                    bearing, _ = object_sightings(plan, np.array(q["reference_poses"])[k][None], index)
                    seen.append(bool(np.isfinite(bearing[0])))
        return seen

    facing, plain = stop_views(True), stop_views(False)
    assert len(facing) >= 10 and len(plain) >= 10
    assert np.mean(facing) >= 0.9  # it turned toward the object's centre (within 15 degrees) before STOP
    assert np.mean(facing) > np.mean(plain)
