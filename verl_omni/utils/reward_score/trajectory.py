"""Scored trajectory of each rollout: integration, STOP, hard collision and occupancy lookups.

Every action-based reward reads the same ``RolloutGeometry``, computed once per batch:

* **Integration.** ``poses [N, 33, 3] = integrate_actions(start_pose, actions)`` (first-STOP rule).
* **STOP step** ``s``: index of the first step whose stop flag is > 0.5, or 32 when there is none.
* **Hard collision step** ``c``: the first step ``j < s`` whose motion, swept by a disc of ``robot_radius``
  from ``poses[j]`` to ``poses[j + 1]``, overlaps blocked space (occupied, unknown or off the map), or 32.
  The sweep is sampled at ``max(collision_samples_per_metre, 2 / resolution)`` points per metre. When the
  start footprint already overlaps blocked space (a recorded state hugging a wall), that rollout's disc
  radius is reduced to its start clearance so that only motion *into* the obstacle counts, with a warning.
* **End step** ``E = min(s, c)``: the scored episode ends at the STOP or at the start of the colliding
  step; the colliding step and all later motion are ignored (the robot stays at ``poses[c]``).
* **Scored poses** ``scored[j] = poses[min(j, E)]``; step ``j`` is *active* iff ``j < E``.
* **Lookups at scored poses** (nearest cell): ``clearance [N, 33]`` metres and ``geodesic [N, 33]``
  metres to the goal. A non-finite geodesic value after the start is replaced by the previous finite one
  (no progress credited), with a warning. The same geodesic field is read at the 33 reference poses
  (``reference_geodesic``): what the expert earns step by step, so that a rollout can be charged the progress
  it misses and forfeit what the expert would still have earned after its end step.
* **Reference heading error** ``reference_heading_error [N, 32]``: at scored pose ``j + 1``, the smallest
  ``|wrap(yaw - ref_yaw_m)|`` over the reference poses ``m`` nearest to it by position. Where the expert
  turned in place, several reference poses share that position; all of their headings are the expert's own,
  so the rollout is compared with the closest of them (taking only the lowest index would penalise the
  expert for its own in-place turns).
* **Live layers** ``layer_valid [N, 9]`` (:func:`layer_validity`): the layers whose actions still decided
  something. Scored poses freeze at the end step, so chunks after it carry no decision; they are masked out
  of the advantages and the loss instead of being credited with zeros.

A rollout is *invalid* (``valid[i] = False``, finite penalty applied by the reward set, warning naming it)
when its actions, start pose, goal, reference poses or success radius are non-finite, a step is longer
than ``max_step_m``, the success radius is not positive, its scene is unknown or unusable, its start pose
is off the map, or the goal is unreachable from the start pose. Invalid rollouts are integrated with zero
actions so that every array stays finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_omni.data.actions import ACTION_LAYOUT, first_stop_index, integrate_actions, wrap_angle
from verl_omni.data.occupancy import ROBOT_RADIUS_M
from verl_omni.utils.reward_score.scene_cache import SceneCache
from verl_omni.utils.reward_score.types import EVENT_NAMES, RewardBatch

STEPS = ACTION_LAYOUT.steps
CHUNKS = ACTION_LAYOUT.chunks
CHUNK_STEPS = ACTION_LAYOUT.steps_per_chunk


@dataclass(frozen=True)
class GeometryConfig:
    """Shared geometric settings of the reward set.

    Attributes:
        robot_radius: Disc footprint radius (metres, > 0).
        collision_samples_per_metre: Minimum sampling density of the swept disc (> 0).
        max_step_m: Longest plausible single-step translation (metres); longer steps make the rollout invalid.
        stop_threshold: A decoded stop channel above this value is a STOP.
    """

    # The closed-loop evaluator's footprint, the expert planner's and the event labeller's (one constant).
    robot_radius: float = ROBOT_RADIUS_M
    collision_samples_per_metre: float = 40.0
    max_step_m: float = 2.0
    stop_threshold: float = 0.5

    def __post_init__(self) -> None:
        for name in ("robot_radius", "collision_samples_per_metre", "max_step_m"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise ValueError(f"reward config: {name} must be a finite number > 0, got {v!r}")
        if not (isinstance(self.stop_threshold, (int, float)) and 0.0 < self.stop_threshold < 1.0):
            raise ValueError(f"reward config: stop_threshold must be in (0, 1), got {self.stop_threshold!r}")


@dataclass
class RolloutGeometry:
    """Per-batch scored trajectories (see module docstring for definitions).

    Attributes:
        valid: ``bool [N]``.
        poses: ``float64 [N, 33, 3]`` integrated poses.
        stop_step: ``int64 [N]`` first STOP step ``s`` (32: none).
        collision_step: ``int64 [N]`` first colliding step ``c`` (32: none).
        collision_fraction: ``float64 [N]`` fraction of the colliding step at first contact (1.0: none).
        end_step: ``int64 [N]`` ``E = min(s, c)``.
        scored_poses: ``float64 [N, 33, 3]``.
        active: ``bool [N, 32]`` steps that are scored (``j < E``).
        clearance: ``float64 [N, 33]`` metres at scored poses.
        geodesic: ``float64 [N, 33]`` metres to goal at scored poses (finite for valid rollouts).
        reference_poses: ``float64 [N, 33, 3]`` the batch's reference poses (zeros for invalid rollouts).
        reference_distance: ``float64 [N, 32]`` metres from scored pose ``j + 1`` to the reference polyline.
        reference_vertex: ``int64 [N, 32]`` index of the reference pose nearest to scored pose ``j + 1``.
        reference_geodesic: ``float64 [N, 33]`` metres to goal at the reference poses (finite for valid rollouts).
        reference_heading_error: ``float64 [N, 32]`` radians, see the module docstring.
        layer_valid: ``bool [N, 9]`` live layers in ``LAYER_NAMES`` order (:func:`layer_validity`).
        warnings: Messages naming rollouts.
    """

    valid: np.ndarray
    poses: np.ndarray
    stop_step: np.ndarray
    collision_step: np.ndarray
    collision_fraction: np.ndarray
    end_step: np.ndarray
    scored_poses: np.ndarray
    active: np.ndarray
    clearance: np.ndarray
    geodesic: np.ndarray
    reference_poses: np.ndarray
    reference_distance: np.ndarray
    reference_vertex: np.ndarray
    reference_geodesic: np.ndarray
    reference_heading_error: np.ndarray
    layer_valid: np.ndarray
    warnings: list[str]

    @property
    def stopped(self) -> np.ndarray:
        """``bool [N]``: a STOP happened inside the scored episode (before any hard collision)."""
        return (self.stop_step < STEPS) & (self.collision_step >= STEPS) & self.valid

    @property
    def collided(self) -> np.ndarray:
        """``bool [N]``: a hard collision ended the scored episode."""
        return (self.collision_step < STEPS) & self.valid

    def stop_geodesic(self) -> np.ndarray:
        """``[N]`` geodesic metres to the goal where the scored episode ends (the STOP pose for a STOP)."""
        return self.geodesic[np.arange(self.geodesic.shape[0]), self.end_step]

    def succeeded(self, success_radius: np.ndarray) -> np.ndarray:
        """``bool [N]``: a STOP within ``success_radius`` of the goal, *geodesic* like the evaluator's SR."""
        return self.stopped & (self.stop_geodesic() <= np.nan_to_num(success_radius))


def layer_validity(stop_step: np.ndarray, collision_step: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Layers whose actions still decided something, ``bool [N, 9]`` in ``LAYER_NAMES`` order.

    The last decision of the motion channels is step ``s - 1`` for a STOP at ``s`` (the STOP step itself does
    not move) and step ``c`` for a hard collision at ``c`` (its motion caused the collision); the last decision
    of the stop channel is step ``s`` (the STOP) or ``c``; without either every step decides. ``nav_k`` is live
    iff chunk ``k``'s first step ``8(k-1)`` is at most the last motion decision, ``stop_k`` likewise with the last
    stop decision; ``visual`` is always live, and so is every layer of an invalid rollout (its penalty must
    reach the policy).

    Args:
        stop_step: ``int [N]`` first STOP step (32: none).
        collision_step: ``int [N]`` first colliding step (32: none); ``c < s`` whenever both are set.
        valid: ``bool [N]``.

    Returns:
        ``bool [N, 9]``.
    """
    stop_step, collision_step = np.asarray(stop_step), np.asarray(collision_step)
    collided = collision_step < STEPS
    last_motion = np.where(collided, collision_step, np.minimum(stop_step, STEPS) - 1)
    last_stop = np.where(collided, collision_step, np.minimum(stop_step, STEPS - 1))
    first = np.arange(CHUNKS) * CHUNK_STEPS  # first step of each chunk
    nav = first[None, :] <= last_motion[:, None]
    stop = first[None, :] <= last_stop[:, None]
    live = np.concatenate([np.ones((stop_step.shape[0], 1), bool), nav, stop], axis=1)
    return live | ~np.asarray(valid, bool)[:, None]


def nearest_heading_error(points: np.ndarray, yaw: np.ndarray, reference: np.ndarray, tie_m: float = 1e-6):
    """Heading error against the reference poses nearest to each point (all of them on ties).

    Args:
        points: ``[N, M, 2]`` positions.
        yaw: ``[N, M]`` headings at ``points``.
        reference: ``[N, P, 3]`` reference poses.
        tie_m: Vertices within this distance of the nearest one count as equally near (an in-place turn
            repeats the position exactly).

    Returns:
        ``[N, M]`` radians in ``[0, pi]``: ``min |wrap(yaw - ref_yaw_m)|`` over the nearest vertices ``m``.
    """
    dist = np.linalg.norm(points[:, :, None, :] - reference[:, None, :, :2], axis=-1)  # [N, M, P]
    near = dist <= dist.min(axis=-1, keepdims=True) + tie_m
    err = np.abs(wrap_angle(yaw[:, :, None] - reference[:, None, :, 2]))
    return np.where(near, err, np.inf).min(axis=-1)


def chunk_sum(per_step: np.ndarray) -> np.ndarray:
    """Sums ``[N, 32]`` per-step values into ``[N, 4]`` chunk values (chunk k = steps 8k .. 8k+7)."""
    return per_step.reshape(per_step.shape[0], CHUNKS, CHUNK_STEPS).sum(axis=-1)


def chunk_of_step(step: np.ndarray) -> np.ndarray:
    """0-based chunk index of 0-based steps (``[N]`` int), clipped to the last chunk."""
    return np.minimum(np.asarray(step) // CHUNK_STEPS, CHUNKS - 1)


def point_to_polyline(points: np.ndarray, polyline: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distance from points to a polyline and index of the nearest polyline vertex.

    Args:
        points: ``[N, M, 2]`` query points.
        polyline: ``[N, P, 2]`` vertices (``P >= 1``; zero-length segments allowed).

    Returns:
        ``dist [N, M]`` Euclidean distance to the nearest point on any segment, and ``vertex [N, M]`` int64
        index of the nearest vertex (lowest index on ties).
    """
    a = polyline[:, None, :-1, :]  # [N, 1, P-1, 2]
    ab = polyline[:, None, 1:, :] - a
    ap = points[:, :, None, :] - a  # [N, M, P-1, 2]
    denom = np.sum(ab * ab, axis=-1)
    t = np.clip(np.sum(ap * ab, axis=-1) / np.where(denom > 0, denom, 1.0), 0.0, 1.0)
    t = np.where(denom > 0, t, 0.0)
    closest = a + t[..., None] * ab
    seg_dist = np.linalg.norm(points[:, :, None, :] - closest, axis=-1)
    vert_dist = np.linalg.norm(points[:, :, None, :] - polyline[:, None, :, :], axis=-1)  # [N, M, P]
    if polyline.shape[1] == 1:
        return vert_dist[..., 0], np.zeros(points.shape[:2], dtype=np.int64)
    return seg_dist.min(axis=-1), vert_dist.argmin(axis=-1)


def _forward_fill(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replaces non-finite ``[N, T]`` entries by the previous finite one (column 0 must be finite)."""
    out = values.copy()
    bad = ~np.isfinite(out)
    for j in range(1, out.shape[1]):  # sequential by nature; vectorized over rollouts
        out[:, j] = np.where(bad[:, j], out[:, j - 1], out[:, j])
    return out, bad


def compute_geometry(batch: RewardBatch, cache: SceneCache, cfg: GeometryConfig) -> RolloutGeometry:
    """Builds the scored trajectories of a batch (never raises on bad rollout data).

    Args:
        batch: Rollouts to score (``N`` of them).
        cache: Scene cache providing occupancy maps and geodesic fields.
        cfg: Shared geometric settings.

    Returns:
        The batch's ``RolloutGeometry``.
    """
    n = batch.size
    ids = batch.rollout_id
    warnings: list[str] = []
    reasons: list[list[str]] = [[] for _ in range(n)]

    def flag(mask: np.ndarray, text: str) -> None:
        for i in np.flatnonzero(mask):
            reasons[i].append(text)

    def flag_rows(rows: np.ndarray, text: str) -> None:
        for i in rows:
            reasons[i].append(text)

    actions = batch.actions
    flag(~np.isfinite(actions).all(axis=(1, 2)), "non-finite actions")
    flag(~np.isfinite(batch.start_pose).all(axis=1), "non-finite start pose")
    flag(~np.isfinite(batch.goal).all(axis=1), "non-finite goal")
    flag(~np.isfinite(batch.reference_poses).all(axis=(1, 2)), "non-finite reference poses")
    sr = batch.success_radius
    flag(~(np.isfinite(sr) & (sr > 0)), "success radius not a positive number")
    with np.errstate(invalid="ignore"):
        step_len = np.hypot(actions[..., 0], actions[..., 1])
        flag((step_len > cfg.max_step_m).any(axis=1), f"a step longer than max_step_m={cfg.max_step_m} m")
    for i, ev in enumerate(batch.events):
        unknown = sorted(set(ev) - set(EVENT_NAMES))
        if unknown:
            warnings.append(f"rollout {ids[i]}: unknown event name(s) {unknown} ignored")

    pre_valid = np.array([not r for r in reasons], dtype=bool)
    safe_actions = np.where(pre_valid[:, None, None], np.nan_to_num(actions), 0.0)
    safe_start = np.where(pre_valid[:, None], np.nan_to_num(batch.start_pose), 0.0)
    poses = integrate_actions(safe_start, safe_actions, stop_threshold=cfg.stop_threshold)  # [N, 33, 3]
    stop_step = first_stop_index(safe_actions[..., 3] > cfg.stop_threshold)
    moving = np.arange(STEPS)[None, :] < stop_step[:, None]  # [N, 32]

    collision_step = np.full(n, STEPS, dtype=np.int64)
    collision_fraction = np.ones(n)
    clearance = np.zeros((n, STEPS + 1))
    geodesic = np.zeros((n, STEPS + 1))
    end_step = stop_step.copy()
    scored = poses.copy()

    scene_index: dict[str, int] = {}
    scene_of = np.array([scene_index.setdefault(s, len(scene_index)) for s in batch.scene_id], dtype=np.int64)
    steps = np.arange(STEPS + 1)
    reference_geodesic = np.zeros((n, STEPS + 1))
    for scene_id, si in scene_index.items():
        rows = np.flatnonzero((scene_of == si) & pre_valid)
        if rows.size == 0:
            continue
        occupancy, reason = cache.get(scene_id)
        if occupancy is None:
            flag_rows(rows, reason)
            continue
        p = poses[rows]
        inside = occupancy.in_bounds(p[:, 0, :2])
        flag_rows(rows[~inside], "start pose outside the occupancy map")
        start_clear = occupancy.clearance_at(p[:, 0, :2])
        radius = np.full(rows.size, cfg.robot_radius)
        tight = inside & (start_clear < cfg.robot_radius)
        for i, c in zip(rows[tight], start_clear[tight]):
            warnings.append(
                f"rollout {ids[i]}: start footprint overlaps blocked space (clearance {c:.3f} m < "
                f"robot_radius {cfg.robot_radius} m); collision radius reduced to {c:.3f} m"
            )
        radius[tight] = start_clear[tight]
        spm = max(cfg.collision_samples_per_metre, 2.0 / occupancy.resolution)
        hit = np.zeros((rows.size, STEPS), dtype=bool)
        frac = np.ones((rows.size, STEPS))
        for r in np.unique(radius):  # one sweep per distinct radius (normally just robot_radius)
            sel = np.flatnonzero(radius == r)
            h, f = occupancy.segment_collides(
                p[sel, :-1, :2].reshape(-1, 2), p[sel, 1:, :2].reshape(-1, 2), float(r), spm
            )
            hit[sel], frac[sel] = h.reshape(-1, STEPS), f.reshape(-1, STEPS)
        hit &= moving[rows]
        c_step = first_stop_index(hit)
        collision_step[rows] = c_step
        collision_fraction[rows] = np.where(
            c_step < STEPS, frac[np.arange(rows.size), np.minimum(c_step, STEPS - 1)], 1.0
        )
        off_map = ~occupancy.in_bounds(p[..., :2]) & inside[:, None]
        for k in np.flatnonzero(off_map.any(axis=1)):
            warnings.append(
                f"rollout {ids[rows[k]]}: pose {int(off_map[k].argmax())} leaves the occupancy map "
                f"(scored as a hard collision)"
            )
        e = np.minimum(stop_step[rows], c_step)
        end_step[rows] = e
        scored[rows] = p[np.arange(rows.size)[:, None], np.minimum(steps[None, :], e[:, None])]
        clearance[rows] = occupancy.clearance_at(scored[rows, :, :2])

    # Geodesic fields: one per (scene, goal); rollouts of a prompt share both, so groups are few.
    still_valid = np.array([not r for r in reasons], dtype=bool)
    keys = np.concatenate([scene_of[:, None].astype(np.float64), np.round(np.nan_to_num(batch.goal), 6)], axis=1)
    idx_valid = np.flatnonzero(still_valid)
    if idx_valid.size:
        uniq, inverse = np.unique(keys[idx_valid], axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        scene_names = list(scene_index)
        for g, key in enumerate(uniq):
            rows = idx_valid[inverse == g]
            scene_id = scene_names[int(key[0])]
            field_, reason = cache.geodesic(scene_id, batch.goal[rows[0]])
            if field_ is None:
                flag_rows(rows, reason)
                continue
            occupancy, _ = cache.get(scene_id)
            # The evaluator's distance: the same field (OccupancyMap.geodesic_to) read by the same nearest-cell
            # rule (OccupancyMap.lookup) as OccupancyMap.geodesic_at, so that a STOP the reward calls a success
            # is one the closed-loop evaluator calls a success.
            geodesic[rows] = occupancy.lookup(field_, scored[rows, :, :2], np.inf)
            ref_xy = np.nan_to_num(batch.reference_poses[rows, :, :2])
            reference_geodesic[rows] = occupancy.lookup(field_, ref_xy, np.inf)
    unreachable = still_valid & ~np.isfinite(geodesic[:, 0])
    flag(unreachable, "goal unreachable from the start pose (geodesic distance is inf)")
    valid = np.array([not r for r in reasons], dtype=bool)
    geodesic[~valid] = 0.0
    geodesic, filled = _forward_fill(geodesic)
    for i in np.flatnonzero(filled.any(axis=1) & valid):
        warnings.append(
            f"rollout {ids[i]}: geodesic distance undefined at scored pose(s) "
            f"{np.flatnonzero(filled[i]).tolist()}; previous value kept (no progress credited)"
        )
    for i in np.flatnonzero(~valid):
        warnings.append(f"rollout {ids[i]}: invalid ({'; '.join(reasons[i])}); scored with invalid_penalty")
    # A reference pose without a finite geodesic value (recorded inside an obstacle's cell, or none at the start)
    # takes the previous finite one: the expert is credited no progress there, so none can be missed or forfeited.
    reference_geodesic[:, 0] = np.where(np.isfinite(reference_geodesic[:, 0]), reference_geodesic[:, 0], geodesic[:, 0])
    reference_geodesic[~valid] = 0.0
    reference_geodesic, ref_filled = _forward_fill(reference_geodesic)
    for i in np.flatnonzero(ref_filled[:, 1:].any(axis=1) & valid):
        warnings.append(
            f"rollout {ids[i]}: geodesic distance undefined at reference pose(s) "
            f"{np.flatnonzero(ref_filled[i]).tolist()}; previous value kept"
        )

    active = (np.arange(STEPS)[None, :] < end_step[:, None]) & valid[:, None]
    scored[..., 2] = wrap_angle(scored[..., 2])
    reference = np.where(valid[:, None, None], batch.reference_poses, 0.0)
    ref_dist, ref_vertex = point_to_polyline(scored[:, 1:, :2], reference[..., :2])
    heading_error = nearest_heading_error(scored[:, 1:, :2], scored[:, 1:, 2], reference)
    return RolloutGeometry(
        valid=valid,
        poses=poses,
        stop_step=stop_step,
        collision_step=collision_step,
        collision_fraction=collision_fraction,
        end_step=end_step,
        scored_poses=scored,
        active=active,
        clearance=clearance,
        geodesic=geodesic,
        reference_poses=reference,
        reference_distance=ref_dist,
        reference_vertex=ref_vertex,
        reference_geodesic=reference_geodesic,
        reference_heading_error=heading_error,
        layer_valid=layer_validity(stop_step, collision_step, valid),
        warnings=warnings,
    )
