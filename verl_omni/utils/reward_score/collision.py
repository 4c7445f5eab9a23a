"""Collision reward (layers ``nav_1..nav_4``): hard collision, soft clearance risk, recovery bonus.

Definitions (``R = robot_radius``, ``S = safety_clearance_m > R``; clearance ``c_j`` in metres from the
centre of scored pose ``j`` to the nearest blocked cell, see ``RolloutGeometry``):

* ``hard_k = 1`` if the rollout's hard collision step lies in chunk ``k`` (the disc swept along that step
  overlaps blocked space), else 0. At most one chunk per rollout; the colliding step and everything after
  it are not scored by any navigation term.
* ``risk_k = (1/8) * sum over active steps j of chunk k of clip((S - c_{j+1}) / (S - R), 0, 1)``: 0 at or
  beyond the safety clearance, rising linearly to 1 at contact (dimensionless, in [0, 1]).
* ``recovery_k`` (only for rollouts whose events contain ``collision_precursor``, else 0): with
  ``h_k = min(max(c_{8k} - c_0, 0), recovery_cap_m)`` the capped clearance gained since the start at the
  end of chunk ``k`` (``h_0 = 0``), ``recovery_k = h_k - h_{k-1}`` metres. The sum over chunks is
  ``h_4`` in ``[0, recovery_cap_m]``; a chunk that gives back clearance gained earlier gets a negative value.

``nav_k = -hard_penalty * hard_k - risk_weight * risk_k + recovery_weight * recovery_k``. Diagnostics
(``[N, 4]``): ``hard``, ``risk``, ``recovery`` as defined above (un-weighted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_omni.utils.reward_score.registry import (
    ModuleResult,
    RewardModule,
    RewardModuleConfig,
    check_non_negative,
    check_positive,
    register_reward,
)
from verl_omni.utils.reward_score.trajectory import (
    CHUNK_STEPS,
    CHUNKS,
    GeometryConfig,
    RolloutGeometry,
    chunk_of_step,
    chunk_sum,
)
from verl_omni.utils.reward_score.types import RewardBatch

NAV_LAYERS = tuple(f"nav_{k}" for k in range(1, CHUNKS + 1))


@dataclass(frozen=True)
class CollisionConfig(RewardModuleConfig):
    """Options of the ``collision`` reward (see module docstring)."""

    hard_penalty: float = 1.0
    risk_weight: float = 0.5
    safety_clearance_m: float = 0.4
    recovery_weight: float = 1.0
    recovery_cap_m: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("hard_penalty", "risk_weight", "recovery_weight"):
            check_non_negative("collision", name, getattr(self, name))
        check_positive("collision", "safety_clearance_m", self.safety_clearance_m)
        check_positive("collision", "recovery_cap_m", self.recovery_cap_m)


def hard_collision_per_chunk(collision_step: np.ndarray, collided: np.ndarray) -> np.ndarray:
    """``[N]`` collision steps + ``bool [N]`` -> ``[N, 4]`` one-hot (0/1) of the colliding chunk."""
    one_hot = chunk_of_step(collision_step)[:, None] == np.arange(CHUNKS)[None, :]
    return (one_hot & collided[:, None]).astype(np.float64)


def clearance_risk_per_chunk(
    clearance: np.ndarray, active: np.ndarray, robot_radius: float, safety_clearance: float
) -> np.ndarray:
    """``[N, 33]`` clearance (m) at scored poses -> ``[N, 4]`` mean risk in [0, 1] per chunk step."""
    risk = np.clip((safety_clearance - clearance[:, 1:]) / (safety_clearance - robot_radius), 0.0, 1.0)
    return chunk_sum(np.where(active, risk, 0.0)) / CHUNK_STEPS


def recovery_per_chunk(clearance: np.ndarray, eligible: np.ndarray, cap: float) -> np.ndarray:
    """Per-chunk increments of the capped clearance gained since the start.

    Args:
        clearance: ``[N, 33]`` metres at scored poses.
        eligible: ``bool [N]`` rollouts starting from a collision-precursor state.
        cap: Largest total gain credited (m).

    Returns:
        ``[N, 4]`` metres; rows sum to a value in ``[0, cap]``; 0 for ineligible rollouts.
    """
    gained = np.minimum(np.maximum(clearance[:, ::CHUNK_STEPS] - clearance[:, :1], 0.0), cap)  # [N, 5], h_0 = 0
    return np.where(eligible[:, None], np.diff(gained, axis=1), 0.0)


@register_reward("collision")
class CollisionReward(RewardModule):
    config_class = CollisionConfig
    layers = NAV_LAYERS

    def __init__(self, config: CollisionConfig, geometry_config: GeometryConfig) -> None:
        super().__init__(config, geometry_config)
        if config.safety_clearance_m <= geometry_config.robot_radius:
            raise ValueError(
                f"reward 'collision': safety_clearance_m ({config.safety_clearance_m}) must exceed "
                f"robot_radius ({geometry_config.robot_radius})"
            )

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: CollisionConfig = self.config  # type: ignore[assignment]
        hard = hard_collision_per_chunk(geometry.collision_step, geometry.collided)
        risk = clearance_risk_per_chunk(
            geometry.clearance, geometry.active, self.geometry_config.robot_radius, cfg.safety_clearance_m
        )
        eligible = batch.has_event("collision_precursor") & geometry.valid
        recovery = recovery_per_chunk(geometry.clearance, eligible, cfg.recovery_cap_m)
        total = -cfg.hard_penalty * hard - cfg.risk_weight * risk + cfg.recovery_weight * recovery
        return ModuleResult(
            scores={layer: total[:, k] for k, layer in enumerate(NAV_LAYERS)},
            diagnostics={"hard": hard, "risk": risk, "recovery": recovery},
        )
