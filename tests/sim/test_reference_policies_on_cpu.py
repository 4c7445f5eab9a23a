"""Scripted reference policies and task levels: hand-worked action sequences and closed-loop sanity."""

import math

import numpy as np
import pytest

from verl_omni.sim.closed_loop import PolicyQuery, run_closed_loop
from verl_omni.sim.collector import CollectorConfig
from verl_omni.sim.floorplan import generate_floor_plan
from verl_omni.sim.heldout import sample_episode_specs, synthesize_heldout_scenes
from verl_omni.sim.levels import LEVELS, get_level
from verl_omni.sim.reference_policies import (
    SCRIPTED_POLICIES,
    GoalBearingPolicy,
    StopPolicy,
    StraightPolicy,
    make_scripted_policy,
)


def _query(pose, goal, scene_id=""):
    return PolicyQuery("e0", 0, 0, "go", np.asarray(pose, float), np.asarray(goal, float), scene_id)


def test_goal_bearing_drives_straight_at_a_goal_ahead():
    acts = GoalBearingPolicy().act_one(_query((0, 0, 0), (1.0, 0.0)))
    # 0.25 m steps: 4 steps reach x = 1 exactly; then it idles (no STOP inside a chunk).
    np.testing.assert_allclose(acts[:4], [[0.25, 0, 0, 0]] * 4, atol=1e-12)
    np.testing.assert_allclose(acts[4:], 0.0, atol=1e-12)


def test_goal_bearing_turns_in_place_before_driving():
    acts = GoalBearingPolicy().act_one(_query((0, 0, 0), (0.0, 2.0)))
    # The goal is 90 degrees left: three turns of 30 degrees in place, then straight ahead.
    np.testing.assert_allclose(acts[:3], [[0, 0, math.pi / 6, 0]] * 3, atol=1e-12)
    np.testing.assert_allclose(acts[3], [0.25, 0, 0, 0], atol=1e-9)


def test_goal_bearing_stops_only_when_it_is_there():
    assert (GoalBearingPolicy().act_one(_query((0, 0, 1.0), (0.2, 0.0)))[:, 3] == 1).all()
    assert (GoalBearingPolicy().act_one(_query((0, 0, 0), (0.3, 0.0)))[:, 3] == 0).all()


def test_stop_and_straight():
    assert (StopPolicy().act_one(_query((0, 0, 0), (1, 1)))[:, 3] == 1).all()
    s = StraightPolicy().act_one(_query((0, 0, 0), (1, 1)))
    assert s.shape == (32, 4) and (s[:, 0] == 0.25).all() and (s[:, 1:] == 0).all()


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="goal_bearing"):
        make_scripted_policy("compass", {})
    with pytest.raises(ValueError, match="one_room"):
        get_level("castle")


def test_levels_bound_the_room_count():
    rng = np.random.default_rng(3)
    for name, level in LEVELS.items():
        plan = generate_floor_plan(level.floorplan(), rng, scene_id=name)
        assert 1 <= len(plan.rooms) <= level.max_rooms
    assert len(generate_floor_plan(get_level("one_room").floorplan(), rng).rooms) == 1


@pytest.fixture(scope="module")
def one_room_episodes():
    level = get_level("one_room")
    plans = synthesize_heldout_scenes(2, seed=11, config=level.floorplan())
    specs = sample_episode_specs(
        plans, 4, seed=11, config=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m)
    )
    return {p.scene_id: p for p in plans}, specs


def test_expert_succeeds_and_trivial_policies_fail(one_room_episodes):
    plans, specs = one_room_episodes
    out = {}
    for name in SCRIPTED_POLICIES:
        out[name] = run_closed_loop(make_scripted_policy(name, plans), plans, specs, progress=False)
    assert all(r.success for r in out["expert"])
    assert all(r.collisions == 0 for r in out["expert"])
    # Without STOP nobody succeeds, yet the no-STOP expert passes through the goal (oracle success).
    assert not any(r.success for r in out["expert_no_stop"]) and all(r.oracle_success for r in out["expert_no_stop"])
    assert not any(r.success for r in out["stop"]) and all(r.path_length == 0 for r in out["stop"])
    assert all(r.metrics()["premature_stop"] for r in out["stop"])
    assert not any(r.success for r in out["straight"])
    # Progress is start minus end geodesic distance: the expert's equals the episode's shortest path minus NE.
    for spec, r in zip(specs, out["expert"], strict=True):
        assert r.metrics()["progress"] == pytest.approx(r.geodesic[0] - r.ne)
        assert r.metrics()["progress"] > spec.shortest_path_m - spec.success_radius - 0.05


def test_object_expert_reaches_the_goal_only_where_it_is_the_near_side():
    """Told the object, not the goal point: expert-level under goal_point='nearest'; under 'random' it succeeds
    exactly where the hidden goal lies within the success radius of the object's point nearest to the start."""
    from verl_omni.sim.collector import goal_candidates

    level = get_level("one_room")
    nearest = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point="nearest")
    plans = synthesize_heldout_scenes(3, seed=5, config=level.floorplan(), task=nearest)  # hosts both modes
    by_id = {p.scene_id: p for p in plans}
    for mode in ("nearest", "random"):
        cfg = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point=mode)
        specs = sample_episode_specs(plans, 6, seed=5, config=cfg)
        results = run_closed_loop(make_scripted_policy("object_expert", by_id), by_id, specs, progress=False)
        for spec, r in zip(specs, results, strict=True):
            plan = by_id[spec.scene_id]
            occ = plan.occupancy()
            index = next(f.index for f in plan.furniture if f.name == spec.goal_object)
            cands = goal_candidates(plan, index, cfg.planner, cfg.goal_object_distance_m)
            # Independent of the policy's multi-source field: one field from the start.
            near = cands[int(np.argmin(occ.geodesic_at(np.asarray(spec.start_pose[:2]), cands)))]
            near_is_goal = occ.geodesic_at(np.asarray(spec.goal), near[None])[0] <= spec.success_radius - 0.1
            if mode == "nearest":
                assert r.success, spec.episode_id
            elif near_is_goal:
                assert r.success, spec.episode_id
            elif occ.geodesic_at(np.asarray(spec.goal), near[None])[0] > spec.success_radius + 0.3:
                assert not r.success, spec.episode_id
