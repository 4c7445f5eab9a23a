"""Expert planner: collision-free, near-shortest paths and fixed-step poses with hand-computed counts."""

import math

import numpy as np
import pytest

from verl_omni.data.actions import poses_to_actions
from verl_omni.data.occupancy import OccupancyMap
from verl_omni.sim.planner import (
    ExpertPlanner,
    PlannerConfig,
    PlanningError,
    face_turns,
    poses_along,
    resample_polyline,
)

RES = 0.05


def _wall_with_gap() -> OccupancyMap:
    """10 m x 6 m room; a 0.1 m wall at x = 5 from the south wall up to y = 4.5 leaves a 1.4 m gap."""
    occ = np.zeros((120, 200), bool)
    occ[:2, :] = occ[-2:, :] = occ[:, :2] = occ[:, -2:] = True
    occ[:90, 99:101] = True
    return OccupancyMap.from_grid(occ, RES, (0.0, 0.0), scene_id="gap")


def _open_room() -> OccupancyMap:
    occ = np.zeros((60, 240), bool)  # 12 m x 3 m
    occ[:2, :] = occ[-2:, :] = occ[:, :2] = occ[:, -2:] = True
    return OccupancyMap.from_grid(occ, RES, (0.0, 0.0), scene_id="open")


def test_resample_polyline_hand_values():
    pts = resample_polyline(np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]), 0.4)
    expected = [[0, 0], [0.4, 0], [0.8, 0], [1.0, 0.2], [1.0, 0.6], [1.0, 1.0]]
    np.testing.assert_allclose(pts, expected, atol=1e-12)
    np.testing.assert_allclose(resample_polyline(np.array([[0.0, 0.0], [0.3, 0.4]]), 0.25)[-1], [0.3, 0.4])


def test_poses_along_turns_in_place_then_moves_straight():
    pts = np.array([[0.0, 0.0], [0.25, 0.0], [0.5, 0.0]])
    poses = poses_along(pts, start_yaw=math.pi / 2, max_turn=math.pi / 6)
    # 90 degrees to turn at 30 degrees per step: 3 in-place rotations, then 2 straight moves.
    assert len(poses) == 1 + 3 + 2
    np.testing.assert_allclose(poses[1:4, 2], [math.pi / 3, math.pi / 6, 0.0], atol=1e-12)
    actions = poses_to_actions(poses)
    np.testing.assert_allclose(actions[3:, 0], 0.25, atol=1e-12)
    np.testing.assert_allclose(actions[:, 1], 0.0, atol=1e-12)


def test_path_is_collision_free_and_near_geodesic():
    occ = _wall_with_gap()
    cfg = PlannerConfig()
    start, goal = np.array([1.0, 1.0]), np.array([9.0, 1.0])
    planner = ExpertPlanner(occ, goal, cfg)
    path = planner.path(start)
    np.testing.assert_allclose(path[0], start)
    np.testing.assert_allclose(path[-1], goal)
    dense = resample_polyline(path, 0.01)
    assert not occ.disc_collides(dense, cfg.robot_radius).any()
    length = np.linalg.norm(np.diff(path, axis=0), axis=1).sum()
    geodesic = float(occ.geodesic_at(goal, start))
    # Lower bound by hand: up to the gap and back down, around the wall end at (5, 4.5):
    # 2 * hypot(4, 3.5) for a point robot hugging the corner.
    assert length >= 2 * math.hypot(4.0, 3.5) - 1e-6
    assert length <= 1.05 * geodesic, (length, geodesic)


def test_continuation_straight_to_goal_hand_counts():
    occ = _open_room()
    planner = ExpertPlanner(occ, np.array([9.0, 1.5]))
    # 2 m straight ahead: 8 moves of 0.25 m, STOP from step 8 on, final pose repeated.
    poses, stop = planner.continuation(np.array([7.0, 1.5, 0.0]), horizon=32)
    assert poses.shape == (33, 3) and stop.shape == (32,)
    assert stop[:8].sum() == 0 and stop[8:].all()
    np.testing.assert_allclose(poses[:9, 0], 7.0 + 0.25 * np.arange(9), atol=1e-9)
    np.testing.assert_allclose(poses[8:], np.repeat([[9.0, 1.5, 0.0]], 25, axis=0), atol=1e-9)
    # Facing away: 180 degrees = 6 in-place rotations of 30 degrees first, then the 8 moves.
    poses, stop = planner.continuation(np.array([7.0, 1.5, math.pi]), horizon=32)
    assert int(np.argmax(stop)) == 14
    np.testing.assert_allclose(poses[:7, :2], [[7.0, 1.5]] * 7, atol=1e-9)
    actions = poses_to_actions(poses, stop)
    assert np.abs(actions[:, 2]).max() <= math.pi / 6 + 1e-9


def test_continuation_faces_a_point_before_the_stop():
    occ = _open_room()
    planner = ExpertPlanner(occ, np.array([9.0, 1.5]))
    # Arriving heading +x with the object straight to the left (90 degrees): 3 turns of 30 degrees at the goal,
    # then STOP from step 8 + 3 = 11 on, facing +y.
    poses, stop = planner.continuation(np.array([7.0, 1.5, 0.0]), horizon=32, face_xy=np.array([9.0, 2.5]))
    assert int(np.argmax(stop)) == 11 and stop[11:].all() and not stop[:11].any()
    np.testing.assert_allclose(poses[9:12, :2], [[9.0, 1.5]] * 3, atol=1e-9)
    np.testing.assert_allclose(poses[8:12, 2], np.radians([0, 30, 60, 90]), atol=1e-9)
    np.testing.assert_allclose(poses[11:], np.repeat(poses[11:12], 22, axis=0))
    # An object 10 degrees off the final heading is within half a turn step: no turn, STOP as without facing.
    ahead = np.array([9.0 + math.cos(math.radians(10)), 1.5 + math.sin(math.radians(10))])
    _, stop = planner.continuation(np.array([7.0, 1.5, 0.0]), horizon=32, face_xy=ahead)
    assert int(np.argmax(stop)) == 8
    # Already at the goal, facing away (180 degrees): 6 turns, then STOP.
    _, stop = planner.continuation(np.array([9.0, 1.5, math.pi]), horizon=32, face_xy=np.array([10.0, 1.5]))
    assert int(np.argmax(stop)) == 6
    # The turns are cut at the horizon like any other step: no STOP inside a 9-step chunk that needs 11.
    poses, stop = planner.continuation(np.array([7.0, 1.5, 0.0]), horizon=9, face_xy=np.array([9.0, 2.5]))
    assert poses.shape == (10, 3) and not stop.any()


def test_face_turns_by_hand():
    point = np.array([math.cos(math.radians(-130)), math.sin(math.radians(-130))])
    turns = face_turns(np.array([0.0, 0.0, 0.0]), point, math.pi / 6)
    # The point is at -130 degrees: turns of -30 until within 15 degrees: -30, -60, -90, -120 (10 off).
    np.testing.assert_allclose(turns[:, 2], np.radians([-30, -60, -90, -120]), atol=1e-9)
    assert face_turns(np.array([0.0, 0.0, 0.0]), np.array([1.0, 0.1]), math.pi / 6).shape == (0, 3)


def test_continuation_truncates_long_paths_and_stops_at_goal():
    occ = _wall_with_gap()
    cfg = PlannerConfig()
    planner = ExpertPlanner(occ, np.array([9.0, 1.0]), cfg)
    poses, stop = planner.continuation(np.array([1.0, 1.0, 1.2]), horizon=32)
    assert stop.sum() == 0  # about 11 m away: the expert is still moving after 32 steps
    actions = poses_to_actions(poses, stop)
    steps = np.hypot(actions[:, 0], actions[:, 1])
    assert steps.max() <= cfg.step_length + 1e-9 and np.abs(actions[:, 1]).max() < 1e-9
    assert np.abs(actions[:, 2]).max() <= cfg.max_turn_rad + 1e-9
    assert not occ.disc_collides(poses[:, :2], cfg.robot_radius).any()
    # Already at the goal: STOP immediately.
    poses, stop = planner.continuation(np.array([9.0, 1.1, 0.0]), horizon=32)
    assert stop.all() and np.allclose(poses, [[9.0, 1.1, 0.0]])


def test_start_near_a_wall_recovers_without_collision():
    occ = _wall_with_gap()
    cfg = PlannerConfig()
    planner = ExpertPlanner(occ, np.array([9.0, 1.0]), cfg)
    start = np.array([4.68, 2.0])  # 0.22 m from the wall face at x = 4.95: inside the safety margin
    path = planner.path(start)
    assert not occ.disc_collides(resample_polyline(path, 0.01), cfg.robot_radius).any()


def test_unreachable_goal_and_bad_config():
    occ = np.zeros((40, 80), bool)
    occ[:, 39:41] = True  # a full wall: the right half cannot be reached from the left
    m = OccupancyMap.from_grid(occ, RES)
    planner = ExpertPlanner(m, np.array([3.0, 1.0]))
    assert not planner.reachable(np.array([1.0, 1.0]))
    with pytest.raises(PlanningError, match="no collision-free path"):
        planner.path(np.array([1.0, 1.0]))
    with pytest.raises(PlanningError, match="clearance"):
        ExpertPlanner(m, np.array([1.99, 1.0]))
    with pytest.raises(ValueError, match="step_length"):
        PlannerConfig(step_length=0.0)


def test_contact_state_escapes_to_the_margin_by_hand():
    # _open_room: rows 0-1 are wall, so a cell in row i (far from the other walls) is i - 1 cells from the wall
    # and its clearance is (i - 1) * 0.05 - 0.025 m (distance to the blocked cell's edge):
    # row 5: 0.175 (the 0.2 m disc overlaps the wall), row 6: 0.225 (free, but closer than the thin band's
    # 0.2 + 0.05 = 0.25), row 7: 0.275 (thin band), row 9: 0.375 (the full 0.2 + 0.15 = 0.35 margin).
    occ = _open_room()
    cfg = PlannerConfig()
    planner = ExpertPlanner(occ, np.array([10.0, 1.5]), cfg)
    np.testing.assert_allclose(occ.clearance_m[5:10, 100], [0.175, 0.225, 0.275, 0.325, 0.375], atol=1e-6)
    # The shortest escape is straight away from the wall: 3 cells (0.15 m) to row 9; any diagonal costs more.
    assert planner.escape_cells(6, 100) == [(6, 100), (7, 100), (8, 100), (9, 100)]
    assert planner.escape_cells(7, 100) == [(7, 100)]  # the thin field reaches it: no escape
    assert planner.escape_cells(5, 100) is None  # in collision
    # Within 0.1 m no cell has the full margin: the escape ends at the first thin-band cell instead.
    near = ExpertPlanner(occ, np.array([10.0, 1.5]), PlannerConfig(escape_distance_m=0.1))
    assert near.escape_cells(6, 100) == [(6, 100), (7, 100)]
    assert ExpertPlanner(occ, np.array([10.0, 1.5]), PlannerConfig(escape_distance_m=0.0)).escape_cells(6, 100) is None

    contact, colliding = occ.grid_to_world(np.array([6, 5]), np.array([100, 100]))
    assert planner.reachable(np.stack([contact, colliding])).tolist() == [False, False]
    assert planner.labelable(np.stack([contact, colliding])).tolist() == [True, False]
    with pytest.raises(PlanningError, match="no collision-free path"):
        planner.path(colliding)

    # Facing the wall (yaw -90 degrees), the expert turns in place, backs off and drives on, never in contact.
    poses, stop = planner.continuation(np.array([*contact, -math.pi / 2]), horizon=32)
    assert stop[0] == 0  # 5 m from the goal: it drives, no STOP at once
    moved = np.linalg.norm(np.diff(poses[:, :2], axis=0), axis=1) > 1e-9
    first = int(np.argmax(moved))
    assert first >= 1 and np.allclose(poses[: first + 1, :2], contact)  # turns only, at least one step
    assert poses[first + 1, 1] > contact[1]  # the first move is away from the wall
    # The string pull may leave the wall at a slant (a shortcut at the start's own clearance), but the way out never
    # comes closer to the wall than the robot already was: 0.225 m, so never in contact (0.2 m).
    dense = resample_polyline(poses[:, :2][np.r_[True, moved]], 0.01)
    assert occ.clearance_at(dense).min() >= 0.225 - 1e-6
