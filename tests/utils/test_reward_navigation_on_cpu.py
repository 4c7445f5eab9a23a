"""Navigation + collision rewards on hand-built corridors; every expected value is worked out by hand.

Maps use 0.1 m cells; clearance of a free cell = (distance in cells to the nearest blocked cell centre) * 0.1
- 0.05 (half a cell); geodesic distance along a free row = 0.1 m per cell (a diagonal cell step 0.1 sqrt 2).
Robot radius R = 0.2 m (the evaluator's footprint), safety clearance S = 0.4 m, so a step ending at clearance c
carries risk clip((0.4 - c) / 0.2, 0, 1). Progress is credited relative to the reference: nav gains
``progress - missed``, ``missed`` being what the reference gained over the same active steps.
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
    # Rollout 0 drives like the reference, 32 steps of 0.1 m along +x from column 10 to column 42 (goal at column
    # 50); rollout 1 stands still and never stops.
    actions = np.concatenate([straight_actions(32, dx=0.1), straight_actions(0)])
    batch = make_batch(actions, (x0, y0, 0.0), centre(5, 50), reference=_reference_along_x((x0, y0)))
    out = rs.score(batch)
    # Each chunk of the reference moves 8 cells straight toward the goal: 0.8 m of geodesic progress. The rollout
    # that follows it gains the same (relative progress 0) and pays nothing else; standing still misses it all.
    np.testing.assert_allclose(out.diagnostics["navigation/progress"], [[0.8] * 4, [0.0] * 4], atol=1e-5)
    np.testing.assert_allclose(out.diagnostics["navigation/missed"], [[0.8] * 4, [0.8] * 4], atol=1e-5)
    np.testing.assert_allclose(_nav(out), [[0.0] * 4, [-0.8] * 4], atol=1e-5)
    for term in ("navigation/deviation", "collision/hard", "collision/risk", "yaw/path", "yaw/rate", "yaw/reference"):
        assert np.all(out.diagnostics[term] == 0), term
    assert np.all(out.diagnostics["navigation/forfeit"] == 0)
    assert all(np.all(out.scores[f"stop_{k}"] == 0) for k in range(1, 5))
    assert out.layer_valid.all() and out.warnings == []


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
    # The reference runs through the same cells over the 17 active steps, so it gained the same: relative progress
    # 0. After pose 17 (col 27) it enters the wall (col 30: no geodesic value, the previous one, 0.4 m at col 29,
    # is kept, with a warning) and gains nothing more, so the collision forfeits max(0.2 - 0.4, 0) = 0.
    np.testing.assert_allclose(out.diagnostics["navigation/missed"], [[0.8, 0.6, -0.1, 0.0]], atol=1e-5)
    assert np.all(out.diagnostics["navigation/forfeit"] == 0)
    assert any("reference pose" in w for w in out.warnings)
    # Risk: chunk 2 ends at col 26 (risk 0.05 / 0.2), chunk 3's only scored step ends at col 27 (0.15 / 0.2).
    risk = np.array([[0.0, (0.05 / 0.2) / 8, (0.15 / 0.2) / 8, 0.0]])
    np.testing.assert_allclose(out.diagnostics["collision/risk"], risk, atol=1e-5)
    expected = -0.5 * risk - 2.0 * np.array([[0, 0, 1, 0]])
    np.testing.assert_allclose(_nav(out), expected, atol=1e-5)
    # The colliding step's chunk is live (its motion collided); chunk 4 decided nothing.
    np.testing.assert_array_equal(out.layer_valid[0], [1, 1, 1, 1, 0, 1, 1, 1, 0])


def test_collision_forfeits_what_the_reference_would_still_gain():
    # 21 x 60 room. The reference drives along row 10 from column 10 toward the goal at column 50 (0.1 m a step:
    # geodesic G*_j = 4.0 - 0.1 j). The rollout drives +y instead, one row per step: the top wall is row 20, so
    # row r has clearance (20 - r) * 0.1 - 0.05; row 17 -> 0.25, row 18 -> 0.15 < R. Step 7 (row 17 -> 18) is the
    # first whose swept disc touches the wall: the episode ends at pose 7 (row 17), in chunk 1.
    occ = walled_room(21, 60)
    x0, y0 = centre(10, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL})
    batch = make_batch(
        straight_actions(32, dx=0.1), (x0, y0, np.pi / 2), centre(10, 50), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    assert out.diagnostics["geometry/collision_step"][0] == 7
    # Rollout geodesic at row 17, column 10: 7 diagonal cells and 33 straight ones to the goal = 0.7 sqrt 2 + 3.3.
    progress = 4.0 - (0.7 * np.sqrt(2) + 3.3)
    missed = 4.0 - 3.3  # the reference over the 7 active steps
    forfeit = 3.3 - 0.8  # what it gains from pose 7 to pose 32 (column 42)
    # Deviation: pose j + 1 is (j + 1) * 0.1 m from the reference row; excess over 0.3 m for j = 0..6: 0.1 .. 0.4.
    deviation = (0.1 + 0.2 + 0.3 + 0.4) / 8
    # Risk: poses 6 and 7 (rows 16, 17: clearance 0.35, 0.25) -> (0.05 + 0.15) / 0.2, over the chunk's 8 steps.
    risk = (0.05 + 0.15) / 0.2 / 8
    np.testing.assert_allclose(out.diagnostics["navigation/forfeit"], [[forfeit, 0, 0, 0]], atol=1e-5)
    nav_1 = (progress - missed - forfeit) - 0.5 * deviation - 0.5 * risk - 2.0
    np.testing.assert_allclose(_nav(out), [[nav_1, 0.0, 0.0, 0.0]], atol=1e-5)
    # Only chunk 1 decided anything: its motion collided, so nav_1 and stop_1 are live, the rest dead.
    np.testing.assert_array_equal(out.layer_valid[0], [1, 1, 0, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(out.diagnostics["geometry/layer_valid"][0], [1, 1, 0, 0, 0, 1, 0, 0, 0])


def test_grazing_a_wall_gives_soft_penalty_only():
    # Row 3 is 3 cells from the bottom wall: clearance 0.25 m, between R = 0.2 and S = 0.4: risk 0.15 / 0.2 at
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
    np.testing.assert_allclose(out.diagnostics["collision/risk"], np.full((1, 4), 0.15 / 0.2), atol=1e-5)
    # It follows the reference (relative progress 0), so the soft risk is all that is left.
    np.testing.assert_allclose(_nav(out), np.full((1, 4), -0.5 * 0.15 / 0.2), atol=1e-5)


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


def test_nav_terms_after_stop_are_zero_masked_and_the_forfeit_goes_to_the_stop_chunk():
    occ = walled_room(11, 60)
    x0, y0 = centre(5, 10)
    rs = make_reward_set({"room": occ}, {"navigation": NAV, "collision": COL, "yaw": {}})
    # STOP at step 12 (chunk 2): 12 steps were requested but only steps 0..11 move; chunks 3 and 4 score 0.
    batch = make_batch(
        straight_actions(32, dx=0.1, stop_at=12), (x0, y0, 0.0), centre(5, 50), reference=_reference_along_x((x0, y0))
    )
    out = rs.score(batch)
    np.testing.assert_allclose(out.diagnostics["navigation/progress"], [[0.8, 0.4, 0.0, 0.0]], atol=1e-5)
    # Until the STOP the rollout is the reference (relative progress 0). It stops at column 22, 2.8 m from the
    # goal (premature); the reference would still have gained 2.8 - 0.8 = 2.0 m (to column 42): forfeited on
    # stop_2, the layer of the STOP's chunk.
    np.testing.assert_allclose(_nav(out), [[0.0, 0.0, 0.0, 0.0]], atol=1e-5)
    np.testing.assert_allclose(out.diagnostics["navigation/forfeit"], [[0.0, 2.0, 0.0, 0.0]], atol=1e-5)
    np.testing.assert_allclose([out.scores[f"stop_{k}"][0] for k in range(1, 5)], [0.0, -2.0, 0.0, 0.0], atol=1e-5)
    # Steps 0..11 moved (nav_1, nav_2 live), the STOP is in chunk 2 (stop_1, stop_2 live); chunks 3 and 4 are dead.
    np.testing.assert_array_equal(out.layer_valid[0], [1, 1, 1, 0, 0, 1, 1, 0, 0])
