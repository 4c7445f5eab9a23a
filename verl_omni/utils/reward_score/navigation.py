"""Navigation reward (layers ``nav_1..nav_4``): geodesic progress and deviation from the reference path.

Definitions (chunk ``k`` covers steps ``8(k-1) .. 8k-1``; ``scored``, ``active`` and ``geodesic`` are the
batch's ``RolloutGeometry``; ``G_j = geodesic[j]`` metres from scored pose ``j`` to the goal):

* ``progress_k = G_{8(k-1)} - G_{8k}`` metres (positive when the chunk brings the robot closer to the
  goal along free space). Because scored poses freeze at the end step, chunks after a STOP or a hard
  collision have 0 progress and the motion of a colliding step is never credited.
* ``deviation_k = (1/8) * sum over active steps j of chunk k of min(max(d_{j+1} - tol, 0), cap)`` metres,
  where ``d_{j+1}`` is the distance from scored pose ``j + 1`` to the reference polyline (the 33
  reference poses joined by segments), ``tol = deviation_tolerance_m`` and ``cap = deviation_cap_m``.

``nav_k = progress_weight * progress_k - deviation_weight * deviation_k``. Diagnostics (``[N, 4]``):
``progress`` and ``deviation`` as defined above (un-weighted, deviation >= 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
class NavigationConfig(RewardModuleConfig):
    """Options of the ``navigation`` reward (see module docstring)."""

    progress_weight: float = 1.0
    deviation_weight: float = 0.5
    deviation_tolerance_m: float = 0.3
    deviation_cap_m: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("progress_weight", "deviation_weight", "deviation_tolerance_m", "deviation_cap_m"):
            check_non_negative("navigation", name, getattr(self, name))


def progress_per_chunk(geodesic: np.ndarray) -> np.ndarray:
    """``[N, 33]`` geodesic metres at scored poses -> ``[N, 4]`` metres gained per chunk."""
    bounds = geodesic[:, ::CHUNK_STEPS]  # poses 0, 8, 16, 24, 32
    return bounds[:, :-1] - bounds[:, 1:]


def deviation_per_chunk(distance: np.ndarray, active: np.ndarray, tolerance: float, cap: float) -> np.ndarray:
    """Mean over each chunk's 8 steps of the capped excess distance to the reference path.

    Args:
        distance: ``[N, 32]`` metres from scored pose ``j + 1`` to the reference polyline.
        active: ``bool [N, 32]`` scored steps.
        tolerance: Distance (m) not penalized.
        cap: Largest per-step excess (m).

    Returns:
        ``[N, 4]`` metres (>= 0).
    """
    excess = np.minimum(np.maximum(distance - tolerance, 0.0), cap)
    return chunk_sum(np.where(active, excess, 0.0)) / CHUNK_STEPS


@register_reward("navigation")
class NavigationReward(RewardModule):
    config_class = NavigationConfig
    layers = NAV_LAYERS

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: NavigationConfig = self.config  # type: ignore[assignment]
        progress = progress_per_chunk(geometry.geodesic)
        deviation = deviation_per_chunk(
            geometry.reference_distance, geometry.active, cfg.deviation_tolerance_m, cfg.deviation_cap_m
        )
        total = cfg.progress_weight * progress - cfg.deviation_weight * deviation
        return ModuleResult(
            scores={layer: total[:, k] for k, layer in enumerate(NAV_LAYERS)},
            diagnostics={"progress": progress, "deviation": deviation},
        )
