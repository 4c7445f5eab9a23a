"""Closed-loop metric math: SPL, Wilson and Student-t intervals, aggregation, paired differences."""

import math

import pytest

from verl_omni.sim.eval_metrics import (
    aggregate,
    blocked_runs,
    format_estimate,
    mean_interval,
    paired_differences,
    spl,
    wilson_interval,
)

Z95 = 1.959963984540054  # standard normal 0.975 quantile
T95_DF3 = 3.182446305284263  # Student-t 0.975 quantile, 3 degrees of freedom


def _wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    p = k / n
    denom = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(8, 10), (0, 4), (4, 4), (1, 3)])
def test_wilson_interval_matches_the_score_formula(k, n):
    low, high = wilson_interval(k, n)
    ref_low, ref_high = _wilson_by_hand(k, n)
    assert low == pytest.approx(max(ref_low, 0.0), abs=1e-9)
    assert high == pytest.approx(min(ref_high, 1.0), abs=1e-9)


def test_wilson_rejects_impossible_counts():
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 4)


def test_mean_interval_student_t_by_hand():
    values = [1.0, 2.0, 3.0, 6.0]  # mean 3, sample std sqrt(14/3)
    mean, low, high = mean_interval(values)
    half = T95_DF3 * math.sqrt(14 / 3) / 2
    assert mean == 3.0
    assert low == pytest.approx(3.0 - half, abs=1e-9) and high == pytest.approx(3.0 + half, abs=1e-9)


def test_mean_interval_degenerate_cases():
    assert mean_interval([0.7]) == (0.7, None, None)
    assert mean_interval([2.5, 2.5, 2.5]) == (2.5, 2.5, 2.5)
    with pytest.raises(ValueError, match="finite"):
        mean_interval([1.0, math.inf])


def test_spl_definition():
    assert spl(True, 2.0, 2.5) == pytest.approx(0.8)
    assert spl(True, 2.0, 1.5) == 1.0  # shorter than the geodesic (grid rounding) is capped at 1
    assert spl(False, 2.0, 2.0) == 0.0
    with pytest.raises(ValueError, match="shortest_path_m"):
        spl(True, 0.0, 1.0)


def _episode(eid, success, spl_v, ne, collisions):
    return {
        "episode_id": eid,
        "success": success,
        "oracle_success": success or ne < 1.0,
        "collided": collisions > 0,
        "spl": spl_v,
        "ne": ne,
        "collisions": collisions,
        "path_length": 3.0,
        "steps": 12,
    }


def test_aggregate_and_paired_differences():
    a = [_episode("e0", True, 0.8, 0.2, 0), _episode("e1", False, 0.0, 3.0, 2), _episode("e2", False, 0.0, 0.9, 1)]
    b = [_episode("e0", True, 0.9, 0.1, 0), _episode("e1", True, 0.5, 0.4, 0), _episode("e2", False, 0.0, 0.9, 1)]
    agg = aggregate(a)
    assert agg["episodes"] == 3
    assert agg["success"]["count"] == 1 and agg["success"]["mean"] == pytest.approx(1 / 3)
    assert (agg["success"]["low"], agg["success"]["high"]) == pytest.approx(_wilson_by_hand(1, 3))
    assert agg["oracle_success"]["count"] == 2 and agg["collided"]["count"] == 2
    assert agg["ne"]["mean"] == pytest.approx((0.2 + 3.0 + 0.9) / 3)
    assert agg["collisions"]["mean"] == pytest.approx(1.0)
    assert agg["steps"]["low"] == agg["steps"]["high"] == 12.0
    diff = paired_differences(a, b)
    assert diff["success"]["mean"] == pytest.approx(1 / 3)
    assert diff["spl"]["mean"] == pytest.approx((0.1 + 0.5 + 0.0) / 3)
    assert diff["ne"]["mean"] == pytest.approx((-0.1 - 2.6 + 0.0) / 3)
    with pytest.raises(ValueError, match="same episodes"):
        paired_differences(a, b[::-1])


def test_blocked_runs_count_contacts_and_the_longest_push():
    assert blocked_runs([]) == (0, 0)
    assert blocked_runs([False, False]) == (0, 0)
    # Runs: steps 1-3 (3 long), step 6 (1), steps 8-9 (2): three contacts, the longest 3 steps.
    assert blocked_runs([0, 1, 1, 1, 0, 0, 1, 0, 1, 1]) == (3, 3)
    assert blocked_runs([True] * 5) == (1, 5)


def test_episode_metrics_carry_contacts_and_older_records_still_aggregate():
    import numpy as np

    from verl_omni.sim.closed_loop import EpisodeResult

    blocked = np.array([0, 1, 1, 0, 1, 1, 1, 1], bool)  # 6 blocked steps in 2 contacts, the longest 4
    r = EpisodeResult("e", "s", False, False, 0.0, 1.0, int(blocked.sum()), True, 1.0, 8, 3, "max_steps",
                      np.zeros((9, 3)), np.zeros((8, 4)), blocked, np.ones(9))  # fmt: skip
    m = r.metrics()
    assert (m["collisions"], m["collision_events"], m["longest_blocked_run"]) == (6, 2, 4)
    agg = aggregate([m, {**m, "collision_events": 0, "longest_blocked_run": 0}])
    assert agg["collision_events"]["mean"] == 1.0 and agg["longest_blocked_run"]["mean"] == 2.0
    older = {k: v for k, v in m.items() if k not in ("collision_events", "longest_blocked_run")}
    assert "collision_events" not in aggregate([older, m]) and aggregate([older])["collisions"]["mean"] == 6.0


def test_format_estimate():
    assert format_estimate({"mean": 0.5, "low": 0.25, "high": 0.75}) == "0.500 [0.250, 0.750]"
    assert format_estimate({"mean": 0.5, "low": None, "high": None}) == "0.500"
