"""Event labels on hand-made situations."""

import math

import numpy as np
import pytest

from verl_omni.data.occupancy import OccupancyMap
from verl_omni.sim.events import EVENT_NAMES, EventThresholds, label_events, label_query


def _corridor() -> OccupancyMap:
    """12 m x 2 m free strip at 0.05 m with 0.1 m walls: free y in [0.1, 1.9), x in [0.1, 11.9)."""
    occ = np.zeros((40, 240), bool)
    occ[:2, :] = occ[-2:, :] = occ[:, :2] = occ[:, -2:] = True
    return OccupancyMap.from_grid(occ, 0.05, scene_id="corridor")


def _stop_after(k: int) -> np.ndarray:
    s = np.zeros(32, np.int64)
    s[k:] = 1
    return s


def test_label_events_rules():
    kw = dict(forward_hit=False, success_radius=0.5)
    # Far from everything: no event.
    assert label_events(clearance=1.0, geodesic=6.0, euclidean=5.0, stop_index=32, **kw) == []
    # Close to an obstacle (0.25 m < 0.3 m).
    assert label_events(clearance=0.25, geodesic=6.0, euclidean=5.0, stop_index=32, **kw) == ["collision_precursor"]
    # Inside the success radius, reference stops now.
    assert label_events(clearance=1.0, geodesic=0.2, euclidean=0.2, stop_index=0, **kw) == ["required_stop"]
    # 1.2 m away (outside 0.5 m, inside 1.5 m), reference stops after 5 steps.
    assert label_events(clearance=1.0, geodesic=1.2, euclidean=1.2, stop_index=5, **kw) == [
        "premature_stop_risk",
        "required_stop",
    ]
    # 2 m straight-line but the reference keeps moving through the first chunk (goal behind a wall).
    assert label_events(clearance=1.0, geodesic=4.0, euclidean=2.0, stop_index=16, **kw) == ["near_goal_continuation"]
    # A forward sweep hit counts as a precursor even with good clearance.
    assert label_events(
        clearance=1.0, forward_hit=True, geodesic=9, euclidean=9, stop_index=32, success_radius=0.5
    ) == ["collision_precursor"]
    th = EventThresholds(required_stop_within=4)
    assert label_events(clearance=1.0, geodesic=1.6, euclidean=1.6, stop_index=6, thresholds=th, **kw) == [
        "near_goal_continuation"
    ]


def test_label_query_on_a_map():
    occ = _corridor()
    goal = np.array([10.0, 1.0])
    # Facing the east wall 0.4 m away: clearance 0.4 m is fine, the 0.5 m sweep of a 0.2 m disc hits.
    events = label_query(occ, goal, np.array([11.5, 1.0, 0.0]), _stop_after(32), 0.5)
    assert "collision_precursor" in events
    # Same spot facing west (toward the goal, 1.5 m away): no precursor; 1.5 m is in the premature band.
    events = label_query(occ, goal, np.array([11.5, 1.0, math.pi]), _stop_after(6), 0.5)
    assert events == ["premature_stop_risk", "required_stop"]
    # 0.15 m from the south wall face (y = 0.1): precursor by clearance.
    assert label_query(occ, goal, np.array([5.0, 0.25, 0.0]), _stop_after(32), 0.5) == ["collision_precursor"]
    # 2.2 m from the goal with the reference moving for 9 steps: near-goal continuation.
    assert label_query(occ, goal, np.array([7.8, 1.0, 0.0]), _stop_after(9), 0.5) == ["near_goal_continuation"]
    assert set(EVENT_NAMES) == {"collision_precursor", "premature_stop_risk", "required_stop", "near_goal_continuation"}


def test_threshold_validation_names_the_field():
    with pytest.raises(ValueError, match="precursor_clearance_m"):
        EventThresholds(precursor_clearance_m=0.1)
    with pytest.raises(ValueError, match="required_stop_within"):
        EventThresholds(required_stop_within=0)
