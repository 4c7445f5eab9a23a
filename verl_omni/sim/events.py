"""Event labels of a query state (docs/contracts.md), from its reference trajectory, clearance and goal distance.

Quantities at the query pose ``p`` (all computed by the caller from the scene, see :func:`label_query`):

* ``clearance``: metres from the robot centre to the nearest obstacle (``OccupancyMap.clearance_at``);
* ``forward_hit``: a disc of ``robot_radius`` swept straight ahead for ``lookahead_m`` touches an obstacle;
* ``geodesic``: free-space path length to the goal; ``euclidean``: straight-line distance to the goal;
* ``stop_index``: index of the reference's first STOP flag (32 when the expert keeps moving).

Definitions (thresholds are :class:`EventThresholds` fields; defaults in brackets):

``collision_precursor``
    ``clearance < precursor_clearance_m`` [0.3 m: less than 0.1 m of free space around a 0.2 m robot;
    the expert keeps at least 0.35 m] or
    ``forward_hit`` within ``lookahead_m`` [0.5 m]: continuing carelessly would collide.
``premature_stop_risk``
    ``success_radius < geodesic <= premature_stop_distance_m`` [1.5 m]: the goal is close and may look
    reached, but a STOP now fails.
``required_stop``
    ``stop_index < required_stop_within`` [8 steps, the first action chunk]: the reference stops soon, so a
    policy that does not stop in this chunk is wrong.
``near_goal_continuation``
    ``euclidean <= near_goal_distance_m`` [2.5 m] and ``stop_index >= required_stop_within``: the goal is
    near, yet the reference keeps moving through the whole first chunk (it is not there yet, or has to go
    around something); stopping here is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from verl_omni.data.actions import first_stop_index
from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap

EVENT_NAMES: tuple[str, ...] = (
    "collision_precursor",
    "premature_stop_risk",
    "required_stop",
    "near_goal_continuation",
)


@dataclass(frozen=True)
class EventThresholds:
    """Thresholds of the event definitions (see the module docstring).

    Attributes:
        robot_radius: Disc radius used for the forward sweep (metres).
        precursor_clearance_m: Clearance below which a state is a collision precursor.
        lookahead_m: Length of the straight-ahead sweep.
        premature_stop_distance_m: Upper geodesic distance of the premature-STOP band.
        required_stop_within: Reference STOP index below which a STOP is required (steps).
        near_goal_distance_m: Straight-line distance defining "near the goal".
    """

    robot_radius: float = ROBOT_RADIUS_M
    precursor_clearance_m: float = 0.3
    lookahead_m: float = 0.5
    premature_stop_distance_m: float = 1.5
    required_stop_within: int = 8
    near_goal_distance_m: float = 2.5

    def __post_init__(self) -> None:
        for name in ("robot_radius", "precursor_clearance_m", "premature_stop_distance_m", "near_goal_distance_m"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"EventThresholds.{name}: must be a positive number, got {v}")
        if not (math.isfinite(self.lookahead_m) and self.lookahead_m >= 0):
            raise ValueError(f"EventThresholds.lookahead_m: must be >= 0, got {self.lookahead_m}")
        if self.precursor_clearance_m <= self.robot_radius:
            raise ValueError(
                f"EventThresholds.precursor_clearance_m ({self.precursor_clearance_m}) must exceed robot_radius "
                f"({self.robot_radius}): a precursor is a state *before* contact"
            )
        if self.required_stop_within < 1:
            raise ValueError(f"EventThresholds.required_stop_within: must be >= 1, got {self.required_stop_within}")


def label_events(
    clearance: float,
    forward_hit: bool,
    geodesic: float,
    euclidean: float,
    stop_index: int,
    success_radius: float,
    thresholds: EventThresholds | None = None,
) -> list[str]:
    """Pure event rule on precomputed quantities (see the module docstring).

    Args:
        clearance: Clearance at the query pose (metres).
        forward_hit: Whether the straight-ahead sweep collides.
        geodesic: Geodesic distance to the goal (metres; inf when unreachable).
        euclidean: Straight-line distance to the goal (metres).
        stop_index: First STOP index of the reference (``len(stop)`` when none).
        success_radius: Success radius of the episode (metres).
        thresholds: Event thresholds.

    Returns:
        Event names in :data:`EVENT_NAMES` order.
    """
    th = thresholds or EventThresholds()
    events = set()
    if clearance < th.precursor_clearance_m or forward_hit:
        events.add("collision_precursor")
    if success_radius < geodesic <= th.premature_stop_distance_m:
        events.add("premature_stop_risk")
    if stop_index < th.required_stop_within:
        events.add("required_stop")
    elif euclidean <= th.near_goal_distance_m:
        events.add("near_goal_continuation")
    return [e for e in EVENT_NAMES if e in events]


def label_query(
    occupancy: OccupancyMap,
    goal_xy: np.ndarray,
    pose: np.ndarray,
    reference_stop: np.ndarray,
    success_radius: float,
    thresholds: EventThresholds | None = None,
) -> list[str]:
    """Events of a query state, measured on the scene.

    Args:
        occupancy: The scene.
        goal_xy: ``[2]`` goal.
        pose: ``[3]`` query pose (x, y, yaw).
        reference_stop: ``[T]`` expert stop flags from the query pose.
        success_radius: Success radius (metres).
        thresholds: Event thresholds.

    Returns:
        Event names in :data:`EVENT_NAMES` order.
    """
    th = thresholds or EventThresholds()
    pose = np.asarray(pose, np.float64).reshape(3)
    goal_xy = np.asarray(goal_xy, np.float64).reshape(2)
    xy = pose[:2]
    ahead = xy + th.lookahead_m * np.array([math.cos(pose[2]), math.sin(pose[2])])
    hit, _ = occupancy.segment_collides(xy[None], ahead[None], th.robot_radius, 2.0 / occupancy.resolution)
    return label_events(
        clearance=float(occupancy.clearance_at(xy)),
        forward_hit=bool(hit[0]),
        geodesic=float(occupancy.geodesic_at(goal_xy, xy)),
        euclidean=float(np.linalg.norm(goal_xy - xy)),
        stop_index=int(first_stop_index(np.asarray(reference_stop))),
        success_radius=success_radius,
        thresholds=th,
    )
