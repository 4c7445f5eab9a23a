"""The search expert (verl_omni/sim/search_expert.py) against a hand-built room."""

import math

import numpy as np
import pytest

from verl_omni.sim.floorplan import FURNITURE_BASE, WALL, FloorPlan, Furniture, Room
from verl_omni.sim.planner import ExpertPlanner
from verl_omni.sim.search_expert import object_bearings, object_sightings, search_continuation, seen_in_history

RES = 0.05


def _room_with_table() -> FloorPlan:
    """A 4 m x 5 m room with 0.1 m walls and a table at x in [2.8, 3.0), y in [2.4, 2.6)."""
    material = np.full((100, 80), WALL, np.uint8)
    material[2:98, 2:78] = 0
    material[48:52, 56:60] = FURNITURE_BASE
    room_id = np.full(material.shape, -1, np.int16)
    room_id[2:98, 2:78] = 0
    table = Furniture(0, "table", "red", (200, 40, 40), 0.75, (48, 52, 56, 60), 0)
    return FloorPlan(material, room_id, [Room(0, "office", (2, 98, 2, 78), (90, 90, 90))], [table], [], RES)


def test_object_bearings_by_hand():
    plan = _room_with_table()
    poses = np.array([[1.9, 2.5, 0.0], [1.9, 2.5, math.pi], [1.9, 2.5, -math.pi / 6]])
    b = object_bearings(plan, poses, 0)
    assert b[0] == 0.0 and math.isnan(b[1])  # dead ahead (columns symmetric about 0); behind the robot
    assert b[2] == pytest.approx(math.pi / 6, abs=0.03)  # turned 30 degrees right: the table is 30 degrees left
    assert seen_in_history(plan, np.concatenate([poses[1:2]] * 5 + [poses[:1]]), 5, 0, 33)
    assert not seen_in_history(plan, np.concatenate([poses[1:2]] * 6), 5, 0, 33)
    # Distance: the table's near face is at x = 2.8, 0.9 m ahead of the robot at x = 1.9 (the nearest column is
    # within a degree of straight ahead); from 0.5 m further back, 1.4 m. Not drawn: NaN.
    _, reach = object_sightings(plan, np.array([[1.9, 2.5, 0.0], [1.4, 2.5, 0.0], [1.9, 2.5, math.pi]]), 0)
    assert reach[0] == pytest.approx(0.9, abs=0.01) and reach[1] == pytest.approx(1.4, abs=0.01)
    assert math.isnan(reach[2])
    np.testing.assert_allclose(plan.furniture_centre(0), [2.9, 2.5], atol=1e-9)  # the table's centre, by hand


def test_unseen_goal_turns_left_until_in_view_then_plans():
    plan = _room_with_table()
    planner = ExpertPlanner(plan.occupancy(), np.array([2.4, 2.5]))
    start = np.array([1.9, 2.5, math.pi])  # facing away from the table (west)
    poses, stop = search_continuation(plan, planner, 0, start, seen=False, horizon=32)
    assert poses.shape == (33, 3) and stop.shape == (32,)
    # Left turns of 30 degrees from 180: 210, 240, 270, 300 (the table at 60 degrees left of the view's 45 degree
    # half-width, unseen), 330 (the table 30 degrees left: seen) -> 5 turning steps, then the planner.
    yaws = [math.radians(a) for a in (180, 210, 240, 270, 300, 330)]
    np.testing.assert_allclose(poses[:6, :2], np.repeat(start[None, :2], 6, 0))
    np.testing.assert_allclose(np.cos(poses[:6, 2]), np.cos(yaws), atol=1e-9)
    np.testing.assert_allclose(np.sin(poses[:6, 2]), np.sin(yaws), atol=1e-9)
    assert not stop[:5].any()
    rest_poses, rest_stop = planner.continuation(poses[5], 27)
    np.testing.assert_allclose(poses[5:], rest_poses)
    np.testing.assert_array_equal(stop[5:], rest_stop)
    # Already seen in the history: the map expert's own continuation.
    seen_poses, seen_stop = search_continuation(plan, planner, 0, start, seen=True, horizon=32)
    ref_poses, ref_stop = planner.continuation(start, 32)
    np.testing.assert_allclose(seen_poses, ref_poses)
    np.testing.assert_array_equal(seen_stop, ref_stop)


def test_short_horizon_is_all_turning():
    plan = _room_with_table()
    planner = ExpertPlanner(plan.occupancy(), np.array([2.4, 2.5]))
    poses, stop = search_continuation(plan, planner, 0, np.array([1.9, 2.5, math.pi]), seen=False, horizon=3)
    assert poses.shape == (4, 3) and not stop.any()
    np.testing.assert_allclose(np.cos(poses[:, 2]), np.cos([math.pi + k * math.pi / 6 for k in range(4)]), atol=1e-9)
