"""An expert the policy can imitate: search in place until the named object has been seen, then plan to it.

The map expert (:class:`~verl_omni.sim.planner.ExpertPlanner`) heads for the goal from the first step, also
when the goal object is in none of the views the policy gets: measured on a ``one_room`` collection, the object
is in the current view in 49% of the query states and in any of the policy's four views in 75%. In the other
states the map expert turns left or right for reasons the policy cannot see, so its labels are noise to an
imitator, and the part SFT can fit needs no instruction. This expert's labels depend only on what the policy
can observe: while the named object has not been in any frame of the history window, it turns in place (left,
at the planner's largest turn per step) until the object enters the view, and plans on the map from there. The
instruction then decides every label: turn (the named object is not in sight) or go (and where).

Visibility is decided by the renderer's own rays (:func:`object_bearings`), so "seen" means drawn in a frame.
"""

from __future__ import annotations

import math

import numpy as np

from verl_omni.data.actions import wrap_angle
from verl_omni.sim.planner import ExpertPlanner
from verl_omni.sim.render import CameraConfig, cast_rays

LABEL_EXPERTS = ("map", "search")


def object_bearings(plan, poses: np.ndarray, furniture_index: int, camera: CameraConfig | None = None) -> np.ndarray:
    """Bearing of a furniture piece in each pose's view: ``float64 [P]`` radians (robot frame, left positive),
    NaN where it is not drawn (the first output of :func:`object_sightings`)."""
    return object_sightings(plan, poses, furniture_index, camera)[0]


def object_sightings(
    plan, poses: np.ndarray, furniture_index: int, camera: CameraConfig | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Where a furniture piece is drawn in each pose's view: bearing and distance, NaN where it is not drawn.

    A column sees the piece when its first furniture hit is that piece (before any wall); the bearing is the mean
    angle of those columns and the distance the shortest of their ray lengths to it, i.e. what an ideal detector
    of the named object in that view would report.

    Args:
        plan: The scene's :class:`~verl_omni.sim.floorplan.FloorPlan`.
        poses: ``[P, 3]`` world poses ``(x, y, yaw)``.
        furniture_index: The object's index in ``plan.furniture``.
        camera: The renderer's camera (default: the collections' default camera).

    Returns:
        ``bearing float64 [P]`` radians (robot frame, left positive) and ``distance float64 [P]`` metres.
    """
    camera = camera or CameraConfig()
    poses = np.asarray(poses, np.float64).reshape(-1, 3)
    offsets = camera.column_angles()  # [W]
    xy = np.repeat(poses[:, None, :2], len(offsets), axis=1).reshape(-1, 2)
    angle = (poses[:, 2:3] + offsets[None]).reshape(-1)
    hits = cast_rays(plan.material, plan.resolution, plan.origin, xy, angle)
    seen = ((hits.furn_id == furniture_index) & (hits.furn_t < hits.wall_t)).reshape(len(poses), len(offsets))
    count = seen.sum(1)
    bearing = np.where(count > 0, (seen * offsets[None]).sum(1) / np.maximum(count, 1), np.nan)
    reach = np.where(seen, hits.furn_t.reshape(seen.shape), np.inf).min(1)
    return bearing, np.where(count > 0, reach, np.nan)


def goal_object_in_view(plan, pose: np.ndarray, furniture_index: int, camera: CameraConfig | None = None):
    """:func:`object_bearings` of one pose: the bearing (float), or None when the object is not drawn."""
    b = float(object_bearings(plan, np.asarray(pose)[None], furniture_index, camera)[0])
    return None if math.isnan(b) else b


def seen_in_history(plan, poses: np.ndarray, t: int, furniture_index: int, history_frames: int,
                    camera: CameraConfig | None = None) -> bool:  # fmt: skip
    """Whether the object is drawn in any frame of the history window ``t - history_frames + 1 .. t``."""
    frames = sorted({max(0, t - history_frames + 1 + i) for i in range(history_frames)})
    return bool(np.isfinite(object_bearings(plan, np.asarray(poses)[frames], furniture_index, camera)).any())


def search_continuation(
    plan,
    planner: ExpertPlanner,
    furniture_index: int,
    start_pose: np.ndarray,
    seen: bool,
    horizon: int,
    camera: CameraConfig | None = None,
    face_xy: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The search expert's reference from a pose, in the layout of :meth:`ExpertPlanner.continuation`.

    Args:
        plan: The scene.
        planner: The map expert of the goal (used once the object is in view).
        furniture_index: The named (goal) object.
        start_pose: ``[3]`` current pose.
        seen: The object was drawn in the history window (:func:`seen_in_history`): plan at once.
        horizon: Action steps.
        camera: The renderer's camera.
        face_xy: Passed to :meth:`ExpertPlanner.continuation` (face the object before the STOP).

    Returns:
        ``poses [horizon + 1, 3]`` and ``stop int64 [horizon]``. Turning in place comes first while the object is
        unseen; after a whole turn without seeing it (the object hidden behind furniture from here) the map
        expert takes over from that pose.
    """
    start_pose = np.asarray(start_pose, np.float64).reshape(3)
    if seen:
        return planner.continuation(start_pose, horizon, face_xy)
    turn = planner.cfg.max_turn_rad
    full_turn = math.ceil(2 * math.pi / turn - 1e-9)
    pose = start_pose.copy()
    turning = [pose]
    for _ in range(min(horizon, full_turn)):
        pose = pose.copy()
        pose[2] = float(wrap_angle(pose[2] + turn))
        turning.append(pose)
        if np.isfinite(object_bearings(plan, pose[None], furniture_index, camera)[0]):
            break
    steps = len(turning) - 1
    if steps == horizon:
        return np.stack(turning), np.zeros(horizon, np.int64)
    rest_poses, rest_stop = planner.continuation(turning[-1], horizon - steps, face_xy)
    poses = np.concatenate([np.stack(turning[:-1]), rest_poses])
    return poses, np.concatenate([np.zeros(steps, np.int64), rest_stop])
