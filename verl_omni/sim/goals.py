"""The task of an episode: which object, which point next to it is the goal, where the robot starts.

Shared by the training collector, the DAgger collector, goal variants and the held-out sampler, so that every
one of them draws episodes by the same rules (``CollectorConfig.goal_point`` chooses the goal point).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from verl_omni.sim.floorplan import FloorPlan, FloorPlanError
from verl_omni.sim.planner import ExpertPlanner, PlannerConfig

if TYPE_CHECKING:  # the config lives with the collector, which imports this module
    from verl_omni.sim.collector import CollectorConfig

GOAL_POINTS = ("random", "nearest")


class SceneError(ValueError):
    """A scene cannot host the requested episodes (no free space, goal unreachable, ...)."""


def goal_candidates(
    plan: FloorPlan, furniture_index: int, planner_cfg: PlannerConfig, max_distance: float
) -> np.ndarray:
    """World points ``[K, 2]`` (cell centres) near a furniture piece where an expert can stop.

    A candidate lies within ``max_distance`` of the piece and keeps the planner's full clearance
    (``robot_radius + clearance_margin``) to every obstacle.
    """
    from scipy.ndimage import distance_transform_edt

    occ = plan.occupancy()
    dist = distance_transform_edt(~plan.furniture_mask(furniture_index)) * plan.resolution
    ok = (dist <= max_distance) & (occ.clearance_m >= planner_cfg.robot_radius + planner_cfg.clearance_margin + 1e-6)
    rows, cols = np.nonzero(ok)
    return occ.grid_to_world(rows, cols)


def unique_objects(plan: FloorPlan) -> list[int]:
    """Furniture indices that an instruction can name unambiguously by (colour kind, room)."""
    names = Counter((f.name, f.room) for f in plan.furniture)
    return [f.index for f in plan.furniture if names[(f.name, f.room)] == 1]


def check_plan_has_goals(plan: FloorPlan, task: CollectorConfig | None = None) -> FloorPlan:
    """Returns ``plan`` if an instruction can name one of its pieces of furniture (and, for ``task`` with
    ``goal_point="nearest"``, if one of them can be the goal of an episode).

    Raises:
        FloorPlanError: no such piece (furniture placement can fail in small scenes; under ``nearest`` every
            start of a small room may be nearer than ``min_goal_distance_m`` to each object); callers that draw
            several plans treat it as one failed attempt.
    """
    if not unique_objects(plan):
        raise FloorPlanError(f"scene {plan.scene_id!r}: no furniture that an instruction can name unambiguously")
    if task is not None and task.goal_point == "nearest" and not _nearest_goal_objects(plan, task):
        raise FloorPlanError(
            f"scene {plan.scene_id!r}: no nameable object has a start at least {task.min_goal_distance_m} m from "
            "its nearest goal point (goal_point='nearest')"
        )
    return plan


def _start_points(plan: FloorPlan, cfg: CollectorConfig) -> np.ndarray:
    """``[N, 2]`` cell centres where the robot may start (the planner's full clearance)."""
    occ = plan.occupancy()
    rows, cols = np.nonzero(occ.clearance_m >= cfg.planner.robot_radius + cfg.planner.clearance_margin)
    return occ.grid_to_world(rows, cols)


def _nearest_goal_objects(plan: FloorPlan, cfg: CollectorConfig) -> list[int]:
    """Nameable objects with a start at least ``min_goal_distance_m`` (geodesic) from their nearest goal point."""
    occ, starts, out = plan.occupancy(), _start_points(plan, cfg), []
    for index in unique_objects(plan):
        cands = goal_candidates(plan, index, cfg.planner, cfg.goal_object_distance_m)
        if len(cands) and len(starts):
            d = occ.lookup(occ.geodesic_to_nearest(cands)[0], starts, np.inf)
            if bool((np.isfinite(d) & (d >= cfg.min_goal_distance_m)).any()):
                out.append(index)
    return out


def sample_task(
    plan: FloorPlan, base_planner: ExpertPlanner, cfg: CollectorConfig, rng: np.random.Generator
) -> tuple[int, np.ndarray, ExpertPlanner, np.ndarray]:
    """Draws a goal object, goal point, planner and start pose.

    Returns:
        ``(furniture index, goal [2], planner for the goal, start pose [3])``.

    Raises:
        SceneError: no goal/start pair satisfies the constraints within ``max_sampling_attempts``.
    """
    occ = plan.occupancy()
    objects = _nearest_goal_objects(plan, cfg) if cfg.goal_point == "nearest" else unique_objects(plan)
    if not objects:
        raise SceneError(f"scene {plan.scene_id!r}: no furniture that an instruction can name unambiguously")
    start_clear = cfg.planner.robot_radius + cfg.planner.clearance_margin
    free_rows, free_cols = np.nonzero(occ.clearance_m >= start_clear)
    if free_rows.size == 0:
        raise SceneError(f"scene {plan.scene_id!r}: no free space with {start_clear:.2f} m clearance for the robot")
    starts_xy = occ.grid_to_world(free_rows, free_cols)
    for _ in range(cfg.max_sampling_attempts):
        obj = objects[int(rng.integers(len(objects)))]
        cands = goal_candidates(plan, obj, cfg.planner, cfg.goal_object_distance_m)
        if len(cands) == 0:
            continue
        if cfg.goal_point == "nearest":
            drawn = _nearest_goal_task(occ, base_planner, cands, starts_xy, cfg, rng)
            if drawn is None:
                continue
            goal, planner, start = drawn
            return obj, goal, planner, start
        goal = cands[int(rng.integers(len(cands)))]
        planner = base_planner.retarget(goal)
        geo = planner.distance(starts_xy)
        ok = np.isfinite(geo) & (geo >= cfg.min_goal_distance_m) & planner.reachable(starts_xy)
        if not ok.any():
            continue
        idx = np.nonzero(ok)[0]
        s = idx[int(rng.integers(len(idx)))]
        yaw = float(rng.uniform(-math.pi, math.pi))
        return obj, goal, planner, np.array([starts_xy[s, 0], starts_xy[s, 1], yaw])
    raise SceneError(
        f"scene {plan.scene_id!r}: found no start at least {cfg.min_goal_distance_m} m (geodesic) from a reachable "
        f"goal in {cfg.max_sampling_attempts} attempts; the goal is unreachable or the scene too small"
    )


def nearest_goal(occ, candidates: np.ndarray, from_xy: np.ndarray) -> tuple[np.ndarray, float]:
    """The candidate goal point geodesically nearest to ``from_xy`` and its distance (``inf`` if none is reachable).

    Args:
        occ: The scene's :class:`~verl_omni.data.occupancy.OccupancyMap`.
        candidates: ``[K, 2]`` points (:func:`goal_candidates`).
        from_xy: ``[2]`` the point they are measured from (an episode's start).

    Returns:
        ``(goal [2], metres)``, by the same multi-source field that :func:`sample_task` draws starts from.
    """
    dist, which = occ.geodesic_to_nearest(candidates)
    d = float(occ.lookup(dist, np.asarray(from_xy, np.float64), np.inf))
    k = int(occ.lookup(which, np.asarray(from_xy, np.float64), -1))
    return (candidates[k], d) if k >= 0 and np.isfinite(d) else (candidates[0], math.inf)


def _nearest_goal_task(occ, base_planner, cands, starts_xy, cfg, rng):
    """One draw of ``goal_point="nearest"``, or None: a start at least ``min_goal_distance_m`` from the object's
    nearest point, then that point as the goal."""
    dist, which = occ.geodesic_to_nearest(cands)
    d = occ.lookup(dist, starts_xy, np.inf)
    ok = np.flatnonzero(np.isfinite(d) & (d >= cfg.min_goal_distance_m))
    if ok.size == 0:
        return None
    s = int(ok[int(rng.integers(ok.size))])
    start_xy = starts_xy[s]
    goal = cands[int(occ.lookup(which, start_xy, -1))]
    planner = base_planner.retarget(goal)
    geo = float(planner.distance(start_xy[None])[0])
    if not (np.isfinite(geo) and geo >= cfg.min_goal_distance_m and bool(planner.reachable(start_xy[None])[0])):
        return None
    yaw = float(rng.uniform(-math.pi, math.pi))
    return goal, planner, np.array([start_xy[0], start_xy[1], yaw])
