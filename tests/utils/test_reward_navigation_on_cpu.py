"""Navigation + collision rewards on hand-built corridors; every expected value is worked out by hand.

Maps use 0.1 m cells; clearance of a free cell = (distance in cells to the nearest blocked cell centre) * 0.1
- 0.05 (half a cell); geodesic distance along a free row = 0.1 m per cell. Robot radius R = 0.18 m, safety
clearance S = 0.4 m, so a step ending at clearance c carries risk clip((0.4 - c) / 0.22, 0, 1).
"""

import numpy as np
from reward_helpers import centre, make_batch, make_reward_set, straight_actions, walled_room

NAV = {"weight": 1.0, "progress_weight": 1.0, "deviation_weight": 0.5, "deviation_tolerance_m": 0.3}
COL = {
    "weight": 1.0,
    "hard_penalty": 2.0,
    "risk_weight": 0.5,
    "safety_clearance_m": 0.4,
    "recovery_weight": 1.0,
    "recovery_cap_m": 0.3,
}


def _nav(out):
    return np.stack([out.scores[f"nav_{k}"] for k in range(1, 5)], axis=1)


def _reference_along_x(start_xy, step=0.1):
    ref = np.zeros((33, 3))
    ref[:, 0] = start_xy[0] + step * np.arange(33)
    ref[:, 1] = start_xy[1]
    return ref


def test_straight_corridor_toward_goal_has_known_progress_and_no_penalty():
    # 11 x 60 room; row 5 is 5 cells from the top/bottom walls: clearance 0.45 m >= S, so no risk.
    occ = walled_room(11, 60)
    x0, y0 = centre(5, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL, "yaw": {}, "stop": {}})
    # 32 steps of 0.1 m along +x from column 10 to column 42; goal at column 50.
    batch = make_batch(
        straight_actions(32, dx=0.1), (x0, y0, 0.0), centre(5, 50), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    # Each chunk moves 8 cells straight toward the goal: 0.8 m of geodesic progress, nothing else.
    np.testing.assert_allclose(out.diagnostics["navigation/progress"], [[0.8, 0.8, 0.8, 0.8]], atol=1e-5)
    np.testing.assert_allclose(_nav(out), [[0.8, 0.8, 0.8, 0.8]], atol=1e-5)
    for term in ("navigation/deviation", "collision/hard", "collision/risk", "yaw/path", "yaw/rate", "yaw/reference"):
        assert np.all(out.diagnostics[term] == 0), term
    assert all(np.all(out.scores[f"stop_{k}"] == 0) for k in range(1, 5))
    assert out.warnings == []


def test_path_through_wall_collides_in_the_right_chunk_and_ignores_later_motion():
    # A wall fills column 30 across the corridor. Column c of row 5 has clearance (30 - c) * 0.1 - 0.05 (capped at
    # 0.45 by the side walls): col 26 -> 0.35, col 27 -> 0.25, col 28 -> 0.15 < R. The robot starts in column 10 and
    # moves one cell per step, so step 17 (col 27 -> col 28) is the first whose swept disc touches the wall:
    # chunk 3 (steps 16..23). The episode ends at pose 17 (col 27).
    occ = walled_room(11, 60)
    occ[:, 30] = True
    x0, y0 = centre(5, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL})
    batch = make_batch(
        straight_actions(32, dx=0.1), (x0, y0, 0.0), centre(5, 25), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    assert out.diagnostics["geometry/collision_step"][0] == 17
    np.testing.assert_array_equal(out.diagnostics["collision/hard"], [[0, 0, 1, 0]])
    # Geodesic to the goal (col 25): col 10 -> 1.5, col 18 -> 0.7, col 26 -> 0.1, col 27 -> 0.2; chunk 4 is never
    # reached (it would have been beyond the wall).
    np.testing.assert_allclose(out.diagnostics["navigation/progress"], [[0.8, 0.6, -0.1, 0.0]], atol=1e-5)
    # Risk: chunk 2 ends at col 26 (risk 0.05 / 0.22), chunk 3's only scored step ends at col 27 (0.15 / 0.22).
    risk = np.array([[0.0, (0.05 / 0.22) / 8, (0.15 / 0.22) / 8, 0.0]])
    np.testing.assert_allclose(out.diagnostics["collision/risk"], risk, atol=1e-5)
    expected = np.array([[0.8, 0.6, -0.1, 0.0]]) - 0.5 * risk - 2.0 * np.array([[0, 0, 1, 0]])
    np.testing.assert_allclose(_nav(out), expected, atol=1e-5)


def test_grazing_a_wall_gives_soft_penalty_only():
    # Row 3 is 3 cells from the bottom wall: clearance 0.25 m, between R = 0.18 and S = 0.4: risk 0.15 / 0.22 at
    # every pose, no contact.
    occ = walled_room(11, 60)
    x0, y0 = centre(3, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL})
    batch = make_batch(
        straight_actions(32, dx=0.1), (x0, y0, 0.0), centre(3, 50), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    assert np.all(out.diagnostics["collision/hard"] == 0)
    assert out.diagnostics["geometry/collision_step"][0] == 32
    np.testing.assert_allclose(out.diagnostics["collision/risk"], np.full((1, 4), 0.15 / 0.22), atol=1e-5)
    np.testing.assert_allclose(_nav(out), np.full((1, 4), 0.8 - 0.5 * 0.15 / 0.22), atol=1e-5)


def test_deviation_from_reference_is_excess_over_tolerance():
    # Reference runs along row 5; the robot drives along row 10 in a 21-row room (0.5 m away): excess 0.2 m per step.
    occ = walled_room(21, 60)
    xr, yr = centre(5, 10)
    x0, y0 = centre(10, 10)
    rs = make_reward_set({"room": occ}, {"navigation": {**NAV, "progress_weight": 0.0}})
    batch = make_batch(
        straight_actions(32, dx=0.1), (x0, y0, 0.0), centre(10, 50), reference=_reference_along_x((xr, yr))
    )
    out = rs.score(batch)
    np.testing.assert_allclose(out.diagnostics["navigation/deviation"], np.full((1, 4), 0.2), atol=1e-9)
    np.testing.assert_allclose(_nav(out), np.full((1, 4), -0.5 * 0.2), atol=1e-9)


def test_recovery_bonus_from_precursor_state_is_capped():
    # 21-row room, robot at row 3 (clearance 0.25 m) facing +y. Chunk 1 drives 2 cells (row 5: clearance 0.45, gain
    # 0.2 <= cap 0.3); chunk 2 drives 4 more (row 9: clearance 0.85, gain 0.6 -> capped at 0.3, increment 0.1).
    occ = walled_room(21, 60)
    x0, y0 = centre(3, 30)
    actions = np.zeros((2, 32, 4))
    actions[:, 0:2, 0] = 0.1
    actions[:, 8:12, 0] = 0.1
    rs = make_reward_set({"room": occ}, {"collision": {**COL, "risk_weight": 0.0}})
    batch = make_batch(actions, (x0, y0, np.pi / 2), centre(15, 30), events=[["collision_precursor"], []])
    out = rs.score(batch)
    np.testing.assert_allclose(out.diagnostics["collision/recovery"], [[0.2, 0.1, 0.0, 0.0], [0, 0, 0, 0]], atol=1e-5)
    np.testing.assert_allclose(_nav(out), [[0.2, 0.1, 0.0, 0.0], [0, 0, 0, 0]], atol=1e-5)
    # The total over chunks never exceeds the cap.
    assert out.diagnostics["collision/recovery"].sum(axis=1).max() <= 0.3 + 1e-6


def test_nav_terms_after_stop_are_zero():
    occ = walled_room(11, 60)
    x0, y0 = centre(5, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL, "yaw": {}})
    # STOP at step 12 (chunk 2): 12 steps were requested but only steps 0..11 move; chunks 3 and 4 score 0.
    batch = make_batch(
        straight_actions(32, dx=0.1, stop_at=12), (x0, y0, 0.0), centre(5, 50), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    np.testing.assert_allclose(out.diagnostics["navigation/progress"], [[0.8, 0.4, 0.0, 0.0]], atol=1e-5)
    np.testing.assert_allclose(_nav(out), [[0.8, 0.4, 0.0, 0.0]], atol=1e-5)
