"""STOP reward and yaw guards with hand-worked values (0.1 m cells, open 31 x 81 room, success radius 0.5 m)."""

import numpy as np
import pytest
from reward_helpers import centre, make_batch, make_reward_set, straight_actions, walled_room

STOP = {
    "success_reward": 1.0,
    "premature_scale": 0.5,
    "premature_cap": 2.0,
    "missed_stop_penalty": 1.5,
    "near_goal_penalty": 0.25,
}
ROOM = walled_room(31, 81)
GOAL = centre(15, 60)


def _stops(out):
    return np.stack([out.scores[f"stop_{k}"] for k in range(1, 5)], axis=1)


def _stop_immediately_at(cols, events=()):
    """Rollouts that STOP at step 0 at row 15, the given columns (distance (60 - col) * 0.1 m from the goal)."""
    actions = np.repeat(straight_actions(0, stop_at=0), len(cols), axis=0)
    starts = np.array([[*centre(15, c), 0.0] for c in cols])
    return make_batch(actions, starts, GOAL, events=events)


def test_stop_at_goal_and_at_2x_and_5x_success_radius():
    rs = make_reward_set({"room": ROOM}, {"stop": STOP})
    # At the goal, 2 rho = 1.0 m and 5 rho = 2.5 m (straight free row: geodesic = Euclidean).
    out = rs.score(_stop_immediately_at([60, 50, 35]))
    expected = np.zeros((3, 4))
    expected[:, 0] = [1.0, -0.5 * 1.0, -0.5 * 2.5]
    np.testing.assert_allclose(_stops(out), expected, atol=1e-5)
    # Penalties in proportion to the remaining distance: 5x / 2x = 2.5.
    assert out.scores["stop_1"][2] / out.scores["stop_1"][1] == pytest.approx(2.5, rel=1e-5)
    np.testing.assert_allclose(out.diagnostics["stop/stop_distance_m"], [0.0, 1.0, 2.5], atol=1e-6)


def test_premature_stop_cap_is_respected():
    rs = make_reward_set({"room": ROOM}, {"stop": {**STOP, "premature_cap": 1.0}})
    out = rs.score(_stop_immediately_at([50, 35, 10]))
    # 0.5 * 1.0 = 0.5 (below cap), 0.5 * 2.5 = 1.25 -> 1.0, 0.5 * 5.0 = 2.5 -> 1.0.
    np.testing.assert_allclose(out.scores["stop_1"], [-0.5, -1.0, -1.0], atol=1e-5)


def test_premature_base_charges_every_premature_stop_before_the_distance_term():
    rs = make_reward_set({"room": ROOM}, {"stop": {**STOP, "premature_base": 1.5, "premature_cap": 3.0}})
    out = rs.score(_stop_immediately_at([60, 54, 50, 35, 10]))
    # At the goal: success, no charge. 0.6 m: 1.5 + 0.3; 1.0 m: 1.5 + 0.5; 2.5 m: 1.5 + 1.25; 5.0 m: 4.0 -> 3.0.
    np.testing.assert_allclose(out.scores["stop_1"], [1.0, -1.8, -2.0, -2.75, -3.0], atol=1e-5)
    # Just outside the radius, a STOP now costs more than the required STOP it would otherwise miss (1.5): the
    # evaluator ends the episode at a STOP, while a missed one can still be made at the next call.
    assert -out.scores["stop_1"][1] > STOP["missed_stop_penalty"]
    with pytest.raises(ValueError, match="premature_base"):
        make_reward_set({"room": ROOM}, {"stop": {**STOP, "premature_base": -0.1}})


def test_stop_is_credited_to_its_chunk_and_near_goal_continuation_adds_penalty():
    rs = make_reward_set({"room": ROOM}, {"stop": STOP})
    # Drive 20 steps of 0.1 m from column 30, STOP at step 20 (chunk 3) at column 50: 1.0 m from the goal.
    x0, y0 = centre(15, 30)
    actions = np.repeat(straight_actions(20, dx=0.1, stop_at=20), 2, axis=0)
    out = rs.score(make_batch(actions, (x0, y0, 0.0), GOAL, events=[[], ["near_goal_continuation"]]))
    expected = np.zeros((2, 4))
    expected[:, 2] = [-0.5, -0.5 - 0.25]
    np.testing.assert_allclose(_stops(out), expected, atol=1e-5)
    np.testing.assert_array_equal(out.diagnostics["stop/near_goal"][:, 2], [0, 1])


def test_required_stop_missed_is_penalized_in_last_chunk():
    rs = make_reward_set({"room": ROOM}, {"stop": STOP})
    x0, y0 = centre(15, 55)
    actions = np.repeat(straight_actions(0), 2, axis=0)  # never stops
    out = rs.score(make_batch(actions, (x0, y0, 0.0), GOAL, events=[["required_stop"], []]))
    np.testing.assert_allclose(_stops(out), [[0, 0, 0, -1.5], [0, 0, 0, 0]], atol=1e-6)


def test_stop_after_a_hard_collision_does_not_count():
    # Wall in column 40; the robot drives from column 30 into it, then "stops" at step 20: the collision (step 7,
    # col 37 -> 38) ended the episode first, so a required STOP is missed.
    occ = ROOM.copy()
    occ[:, 40] = True
    rs = make_reward_set({"room": occ}, {"stop": STOP})
    x0, y0 = centre(15, 30)
    out = rs.score(
        make_batch(straight_actions(20, dx=0.1, stop_at=20), (x0, y0, 0.0), centre(15, 35), events=["required_stop"])
    )
    assert out.diagnostics["geometry/collision_step"][0] == 7
    # The missed STOP lands on the last live STOP layer: the collision's chunk 1 (chunks 2..4 are dead).
    np.testing.assert_allclose(_stops(out), [[-1.5, 0, 0, 0]], atol=1e-6)
    np.testing.assert_array_equal(out.layer_valid[0, 5:], [1, 0, 0, 0])


YAW = {
    "path_weight": 1.0,
    "path_tolerance_rad": 0.35,
    "rate_weight": 1.0,
    "rate_limit_rad": 0.4,
    "reference_weight": 1.0,
    "reference_tolerance_rad": 0.5,
    "min_motion_m": 0.02,
}


def _yaw_run(actions, start_yaw=0.0, reference_yaw=0.0):
    x0, y0 = centre(15, 20)
    ref = np.zeros((33, 3))
    ref[:, 0], ref[:, 1], ref[:, 2] = x0 + 0.1 * np.arange(33), y0, reference_yaw
    rs = make_reward_set({"room": ROOM}, {"yaw": YAW})
    out = rs.score(make_batch(actions, (x0, y0, start_yaw), GOAL, reference=ref))
    nav = np.stack([out.scores[f"nav_{k}"] for k in range(1, 5)], axis=1)
    return out, nav


def test_path_yaw_guard_alone():
    # Sideways driving: motion direction +90 degrees vs heading 0 -> pi/2 - 0.35 per step. The reference runs along
    # +y too (heading 0), so only the path guard fires. A 45-row room leaves space for 3.2 m of sideways motion.
    x0, y0 = centre(5, 20)
    ref = np.zeros((33, 3))
    ref[:, 0], ref[:, 1] = x0, y0 + 0.1 * np.arange(33)
    rs = make_reward_set({"tall": walled_room(45, 41)}, {"yaw": YAW})
    out = rs.score(
        make_batch(straight_actions(32, dy=0.1), (x0, y0, 0.0), centre(40, 20), reference=ref, scene_id="tall")
    )
    assert out.diagnostics["geometry/collision_step"][0] == 32
    np.testing.assert_allclose(out.diagnostics["yaw/path"], np.full((1, 4), np.pi / 2 - 0.35), atol=1e-6)
    assert np.all(out.diagnostics["yaw/rate"] == 0) and np.all(out.diagnostics["yaw/reference"] == 0)
    np.testing.assert_allclose(out.scores["nav_2"], [-(np.pi / 2 - 0.35)], atol=1e-6)


def test_rate_yaw_guard_alone():
    # Turning in place, alternately +0.45 and -0.45 rad: 0.05 rad over the rate limit each step; heading stays within
    # 0.45 of the reference heading (tolerance 0.5) and there is no translation for the path guard.
    actions = straight_actions(0)
    actions[0, :, 2] = 0.45 * (-1.0) ** np.arange(32)
    out, nav = _yaw_run(actions)
    np.testing.assert_allclose(out.diagnostics["yaw/rate"], np.full((1, 4), 0.05), atol=1e-6)
    assert np.all(out.diagnostics["yaw/path"] == 0) and np.all(out.diagnostics["yaw/reference"] == 0)
    np.testing.assert_allclose(nav, np.full((1, 4), -0.05), atol=1e-6)


def test_reference_heading_guard_alone():
    # Driving straight along the reference path with heading 0 while the reference heading is 1.0 rad: 0.5 rad
    # beyond the tolerance at every step; no sideways motion, no turning.
    out, nav = _yaw_run(straight_actions(32, dx=0.1), reference_yaw=1.0)
    np.testing.assert_allclose(out.diagnostics["yaw/reference"], np.full((1, 4), 0.5), atol=1e-6)
    assert np.all(out.diagnostics["yaw/path"] == 0) and np.all(out.diagnostics["yaw/rate"] == 0)
    np.testing.assert_allclose(nav, np.full((1, 4), -0.5), atol=1e-6)


def test_arc_motion_is_not_a_path_yaw_violation():
    # An arc (forward 0.1 m along the mid-step heading while turning 0.3 rad per step) moves along its own heading.
    a = straight_actions(8, dyaw=0.3)
    a[0, :8, 0] = 0.1 * np.cos(0.15)
    a[0, :8, 1] = 0.1 * np.sin(0.15)
    out, _ = _yaw_run(a)
    np.testing.assert_allclose(out.diagnostics["yaw/path"], np.zeros((1, 4)), atol=1e-6)
