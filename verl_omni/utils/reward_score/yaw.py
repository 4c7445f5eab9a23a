"""Yaw guards (layers ``nav_1..nav_4``): path heading, yaw rate and reference heading.

For each active step ``j`` (motion from scored pose ``j`` to ``j + 1``; all angles wrapped to (-pi, pi],
penalties in radians, each guard averaged over the chunk's 8 steps: ``guard_k = (1/8) * sum over active
steps j of chunk k of penalty_j``):

* **path**: heading vs direction of motion. With displacement ``(Dx, Dy)`` and length ``L``, the motion
  direction is ``atan2(Dy, Dx)`` and the step's heading is the mid-step yaw ``yaw_j + dyaw_j / 2`` (an arc
  turning while driving forward has its chord along the mid-step heading). ``penalty_j = max(|wrap(
  atan2(Dy, Dx) - yaw_j - dyaw_j / 2)| - path_tolerance_rad, 0)`` when ``L >= min_motion_m``, else 0
  (rotation in place has no direction of motion). Sideways or backward driving triggers it.
* **rate**: ``penalty_j = max(|dyaw_j| - rate_limit_rad, 0)`` with ``dyaw_j = wrap(yaw_{j+1} - yaw_j)``.
  The limit must sit above the expert's own turn rate (the planner turns up to 30 degrees per step), or the
  guard would penalise imitating the expert.
* **reference**: heading after the step vs the heading of the nearest reference pose (by position):
  ``penalty_j = max(e_j - reference_tolerance_rad, 0)`` with ``e_j = min over m |wrap(yaw_{j+1} - ref_yaw_m)|``,
  ``m`` ranging over the reference poses closest to scored pose ``j + 1``
  (``RolloutGeometry.reference_heading_error``). Where the expert turned in place several reference poses
  share one position and every heading it passed through there is its own, so the guard compares with the
  closest of them; the expert itself scores 0.

``nav_k = -(path_weight * path_k + rate_weight * rate_k + reference_weight * reference_k)``. Diagnostics
(``[N, 4]``): ``path``, ``rate``, ``reference`` (un-weighted, >= 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_omni.data.actions import wrap_angle
from verl_omni.utils.reward_score.registry import (
    ModuleResult,
    RewardModule,
    RewardModuleConfig,
    check_non_negative,
    register_reward,
)
from verl_omni.utils.reward_score.trajectory import CHUNK_STEPS, CHUNKS, RolloutGeometry, chunk_sum
from verl_omni.utils.reward_score.types import RewardBatch

NAV_LAYERS = tuple(f"nav_{k}" for k in range(1, CHUNKS + 1))


@dataclass(frozen=True)
class YawConfig(RewardModuleConfig):
    """Options of the ``yaw`` reward (see module docstring)."""

    path_weight: float = 0.5
    path_tolerance_rad: float = 0.35
    min_motion_m: float = 0.02
    rate_weight: float = 0.5
    rate_limit_rad: float = 0.55
    reference_weight: float = 0.25
    reference_tolerance_rad: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "path_weight",
            "path_tolerance_rad",
            "min_motion_m",
            "rate_weight",
            "rate_limit_rad",
            "reference_weight",
            "reference_tolerance_rad",
        ):
            check_non_negative("yaw", name, getattr(self, name))


def yaw_guard_penalties(
    scored_poses: np.ndarray, reference_heading_error: np.ndarray, cfg: YawConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step penalties of the three guards (before masking by active steps).

    Args:
        scored_poses: ``[N, 33, 3]``.
        reference_heading_error: ``[N, 32]`` radians between the heading at scored pose ``j + 1`` and the
            closest heading of the reference poses nearest to it.
        cfg: Tolerances and limits.

    Returns:
        ``(path, rate, reference)`` each ``[N, 32]`` radians >= 0.
    """
    prev, nxt = scored_poses[:, :-1], scored_poses[:, 1:]
    dyaw = wrap_angle(nxt[..., 2] - prev[..., 2])
    delta = nxt[..., :2] - prev[..., :2]
    length = np.hypot(delta[..., 0], delta[..., 1])
    motion_dir = np.arctan2(delta[..., 1], delta[..., 0])
    path_err = np.abs(wrap_angle(motion_dir - prev[..., 2] - 0.5 * dyaw))
    path = np.where(length >= cfg.min_motion_m, np.maximum(path_err - cfg.path_tolerance_rad, 0.0), 0.0)
    rate = np.maximum(np.abs(dyaw) - cfg.rate_limit_rad, 0.0)
    reference = np.maximum(reference_heading_error - cfg.reference_tolerance_rad, 0.0)
    return path, rate, reference


@register_reward("yaw")
class YawReward(RewardModule):
    config_class = YawConfig
    layers = NAV_LAYERS

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: YawConfig = self.config  # type: ignore[assignment]
        per_step = yaw_guard_penalties(geometry.scored_poses, geometry.reference_heading_error, cfg)
        path, rate, reference = (chunk_sum(np.where(geometry.active, p, 0.0)) / CHUNK_STEPS for p in per_step)
        total = -(cfg.path_weight * path + cfg.rate_weight * rate + cfg.reference_weight * reference)
        return ModuleResult(
            scores={layer: total[:, k] for k, layer in enumerate(NAV_LAYERS)},
            diagnostics={"path": path, "rate": rate, "reference": reference},
        )
