"""Stopping short vs continuing, geodesic STOP success, guards on the expert's own turns, live layers: by hand.

Maps use 0.1 m cells (``reward_helpers``); along a free row the geodesic distance is 0.1 m per cell. Module options
are the recipe's locked values, written out here so that the arithmetic below is self-contained.
"""

import numpy as np
import pytest
from reward_helpers import centre, make_batch, make_reward_set, straight_actions, walled_room

from verl_omni.data.actions import poses_to_actions
from verl_omni.utils.reward_score.trajectory import layer_validity

NAV = {"progress_weight": 1.0, "deviation_weight": 0.5, "deviation_tolerance_m": 0.3, "deviation_cap_m": 2.0}
COL = {"hard_penalty": 1.0, "risk_weight": 0.5, "safety_clearance_m": 0.4, "recovery_weight": 1.0}
YAW = {"path_weight": 0.5, "path_tolerance_rad": 0.35, "rate_weight": 0.5, "rate_limit_rad": 0.55}
YAW |= {"reference_weight": 0.25, "reference_tolerance_rad": 0.5, "min_motion_m": 0.02}
STOP = {"success_reward": 1.0, "premature_scale": 0.5, "premature_cap": 2.0}
STOP |= {"missed_stop_penalty": 1.0, "near_goal_penalty": 0.5}
ALL = {"navigation": NAV, "collision": COL, "yaw": YAW, "stop": STOP}
RHO = 0.5


def _total(out):
    return sum(out.scores[k].astype(np.float64) for k in out.scores)


def test_stopping_short_scores_below_continuing_at_every_distance_beyond_the_success_radius():
    # Corridor row 5 of an 11-row room (clearance 0.45 m >= S: no risk). The reference drives 30 steps of 0.1 m
    # from column 10 to column 40 and stays there; the goal is column 42, so it ends 0.2 m away (inside rho) and
    # G*_j = 3.2 - 0.1 min(j, 30). "Continue" drives like it and STOPs at step 30 (success). "Stop short at s"
    # drives like it for s steps and STOPs at column 10 + s, d_s = 3.2 - 0.1 s from the goal; d_s > rho for
    # s = 0 .. 26 (s = 27 stops exactly at rho, a success).
    occ = walled_room(11, 60)
    x0, y0 = centre(5, 10)
    ref = np.zeros((33, 3))
    ref[:, 0] = x0 + 0.1 * np.minimum(np.arange(33), 30)
    ref[:, 1] = y0
    shorts = list(range(27))
    actions = np.concatenate(
        [straight_actions(30, dx=0.1, stop_at=30)] + [straight_actions(s, dx=0.1, stop_at=s) for s in shorts]
    )
    rs = make_reward_set({"room": occ}, ALL)
    out = rs.score(make_batch(actions, (x0, y0, 0.0), centre(5, 42), reference=ref, success_radius=RHO))
    total = _total(out)
    # Continue: relative progress 0, no forfeit, +1 success.
    assert total[0] == pytest.approx(1.0, abs=1e-5)
    for i, s in enumerate(shorts, start=1):
        d = 3.2 - 0.1 * s
        assert d > RHO
        forfeit = (3.2 - 0.1 * s) - 0.2  # the reference's gain from pose s to pose 32
        expected = -forfeit - min(0.5 * d, 2.0)
        assert total[i] == pytest.approx(expected, abs=1e-5), s
        assert total[i] < total[0]
        # On the layer of the STOP's chunk too (what the layer-conditioned advantages compare), the short STOP is
        # below continuing, which scores 0 there (or +1 in chunk 4, where it stops).
        k = s // 8 + 1
        assert out.scores[f"stop_{k}"][i] < out.scores[f"stop_{k}"][0]
    # The closer to the goal the STOP, the smaller the loss: stopping short never pays more the earlier it happens.
    assert np.all(np.diff(total[1:]) > 0)


def test_stop_success_is_geodesic_not_euclidean():
    # A wall in column 30 from row 0 to row 15 (gap in rows 16..19). The robot STOPs at column 28 of row 5, 0.4 m
    # (Euclidean, < rho) from the goal at column 32 of row 5, but on the other side of the wall: any free path goes
    # down to row 16 and back, at least 2 x 11 rows = 2.2 m. The evaluator would call it a failure, so must the
    # reward: no success, a premature penalty of min(0.5 G, 2) with G the geodesic distance.
    occ = walled_room(21, 60)
    occ[:16, 30] = True
    rs = make_reward_set({"room": occ}, {"stop": STOP})
    out = rs.score(make_batch(straight_actions(0, stop_at=0), (*centre(5, 28), 0.0), centre(5, 32)))
    g = float(out.diagnostics["stop/stop_distance_m"][0])
    assert g >= 2.2
    assert out.diagnostics["stop/success"][0, 0] == 0
    assert out.scores["stop_1"][0] == pytest.approx(-min(0.5 * g, 2.0), abs=1e-5)


def test_guards_accept_the_experts_in_place_turns_and_30_degree_steps():
    # The reference turns in place at its start by 30 degrees a step (poses 0..3: yaw 0, pi/6, pi/3, pi/2) and then
    # drives +y at 0.1 m a step. Its own actions trip no guard: the rate limit 0.55 exceeds pi/6 = 0.524, and at the
    # turning point every heading the expert passed through is a reference heading (the lowest-index rule would have
    # charged pi/6 - 0.5, pi/3 - 0.5 and pi/2 - 0.5 rad for poses 1..3).
    x0, y0 = centre(10, 30)
    ref = np.zeros((33, 3))
    ref[:4, 2] = np.arange(4) * np.pi / 6
    ref[:, 0] = x0
    ref[4:, 1] = y0 + 0.1 * np.arange(1, 30)
    ref[:4, 1] = y0
    ref[4:, 2] = np.pi / 2
    expert = poses_to_actions(ref)[None]
    # A rollout that keeps turning in place to yaw pi (0.524 rad a step for 6 steps, then holds): beyond pi/2 its
    # heading matches no reference heading at that position; the error to the nearest one (pi/2) minus 0.5.
    spin = straight_actions(6, dyaw=np.pi / 6)
    rs = make_reward_set({"room": walled_room(45, 61)}, {"yaw": YAW})
    out = rs.score(make_batch(np.concatenate([expert, spin]), (x0, y0, 0.0), centre(40, 30), reference=ref))
    assert np.all(out.diagnostics["yaw/rate"] == 0)
    np.testing.assert_allclose(out.diagnostics["yaw/reference"][0], 0.0, atol=1e-9)
    np.testing.assert_allclose(out.diagnostics["yaw/path"][0], 0.0, atol=1e-9)
    # Spin: headings after steps 0..7 are k pi/6 for k = 1..6, 6, 6; the reference headings there are m pi/6 for
    # m = 0..3, so the error is min_m |k - m| pi/6 (0 up to k = 3) minus the 0.5 rad tolerance.
    ks = [1, 2, 3, 4, 5, 6, 6, 6]
    per_step = [max(min(abs(k - m) * np.pi / 6 for m in range(4)) - 0.5, 0.0) for k in ks]
    held = max(np.pi - np.pi / 2 - 0.5, 0.0)
    np.testing.assert_allclose(out.diagnostics["yaw/reference"][1], [sum(per_step) / 8] + [held] * 3, atol=1e-6)


@pytest.mark.parametrize(
    ("stop_step", "collision_step", "valid", "expected"),
    [
        # no STOP, no collision: every step decides.
        (32, 32, True, [1, 1, 1, 1, 1, 1, 1, 1, 1]),
        # STOP at step 0: no motion at all (every nav layer dead); the STOP decided in chunk 1.
        (0, 32, True, [1, 0, 0, 0, 0, 1, 0, 0, 0]),
        # STOP at step 8 (first step of chunk 2): steps 0..7 moved; the STOP is chunk 2's.
        (8, 32, True, [1, 1, 0, 0, 0, 1, 1, 0, 0]),
        # STOP at step 12: steps 0..11 moved (chunks 1, 2), the STOP is chunk 2's.
        (12, 32, True, [1, 1, 1, 0, 0, 1, 1, 0, 0]),
        # STOP at step 31: everything but nothing after.
        (31, 32, True, [1, 1, 1, 1, 1, 1, 1, 1, 1]),
        # collision at step 8 (before a STOP at 20): the colliding motion is chunk 2's decision.
        (20, 8, True, [1, 1, 1, 0, 0, 1, 1, 0, 0]),
        # collision at step 0: chunk 1 only.
        (32, 0, True, [1, 1, 0, 0, 0, 1, 0, 0, 0]),
        # invalid rollout: every layer carries its penalty.
        (0, 32, False, [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ],
)
def test_layer_validity_table(stop_step, collision_step, valid, expected):
    got = layer_validity(np.array([stop_step]), np.array([collision_step]), np.array([valid]))
    np.testing.assert_array_equal(got[0], np.array(expected, dtype=bool))


def test_charge_stop_chunk_scores_the_rest_of_a_short_stops_chunk_as_standing_still():
    # The corridor of the first test: the reference gains 0.1 m a step for 30 steps (G*_j = 3.2 - 0.1 min(j, 30)).
    # "Slow" drives 0.1 m a step for 6 steps and waits for 2 with no STOP (whole cells: the geodesic field is per
    # 0.1 m cell): its chunk-1 relative progress is -2 x 0.1 = -0.2. "Short" drives 0.1 m for 3 steps like the
    # expert and STOPs at step 3 (2.9 m from the goal, premature). Without the option its nav_1 is 3 x (0.1 - 0.1)
    # = 0: the STOP-er's motion beats the slow one's (-0.2) only because it was scored on 3 steps instead of 8.
    # With it, steps 3..7 are charged as standing still: 5 x 0.1 = 0.5 m missed, nav_1 = -0.5 < -0.2. The STOP's
    # own layer is the same in both (forfeit of the reference's gain from pose 3 to 32, 3.2 - 0.3 - 0.2 = 2.7 m,
    # and min(0.5 x 2.9, 2) = 1.45): -4.15.
    occ = walled_room(11, 60)
    x0, y0 = centre(5, 10)
    ref = np.zeros((33, 3))
    ref[:, 0] = x0 + 0.1 * np.minimum(np.arange(33), 30)
    ref[:, 1] = y0
    slow = straight_actions(6, dx=0.1)  # 32 steps, the last 26 with no motion
    short = straight_actions(3, dx=0.1, stop_at=3)
    # A STOP at the first step of a chunk leaves that chunk's nav layer dead: nothing to charge there.
    at_chunk_start = straight_actions(8, dx=0.1, stop_at=8)
    actions = np.concatenate([slow, short, at_chunk_start])
    batch = make_batch(actions, (x0, y0, 0.0), centre(5, 42), reference=ref, success_radius=RHO)
    expected_stop_1 = -(3.2 - 0.3 - 0.2) - min(0.5 * 2.9, 2.0)
    for charge, short_nav_1 in ((False, 0.0), (True, -0.5)):
        rs = make_reward_set({"room": occ}, {"navigation": NAV | {"charge_stop_chunk": charge}, "stop": STOP})
        out = rs.score(batch)
        assert out.scores["nav_1"][0] == pytest.approx(-0.2, abs=1e-5)
        assert out.scores["nav_1"][1] == pytest.approx(short_nav_1, abs=1e-5)
        assert out.scores["stop_1"][1] == pytest.approx(expected_stop_1, abs=1e-5)
        # STOP at step 8: chunk 1 fully driven like the expert (0), chunk 2 dead, nothing added to it.
        assert out.scores["nav_1"][2] == pytest.approx(0.0, abs=1e-5)
        assert out.scores["nav_2"][2] == pytest.approx(0.0, abs=1e-5)
    assert out.diagnostics["navigation/missed"][1, 0] == pytest.approx(0.8, abs=1e-5)  # 3 driven + 5 charged steps


def test_charge_stop_chunk_must_be_a_boolean():
    with pytest.raises(ValueError, match="navigation.charge_stop_chunk"):
        make_reward_set({"room": walled_room(5, 5)}, {"navigation": NAV | {"charge_stop_chunk": "yes"}})
