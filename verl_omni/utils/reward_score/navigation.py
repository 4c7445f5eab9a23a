"""Navigation reward (layers ``nav_1..nav_4``, and ``stop_k`` for a premature STOP's forfeit).

Definitions (chunk ``k`` covers steps ``8(k-1) .. 8k-1``; ``scored``, ``active``, ``geodesic`` and
``reference_geodesic`` are the batch's ``RolloutGeometry``; ``G_j`` / ``G*_j`` are the geodesic metres to the
goal at scored pose ``j`` / reference pose ``j``; ``E`` the end step; ``rho`` the success radius):

* ``progress_k = G_{8(k-1)} - G_{8k}`` metres gained by the rollout in chunk ``k`` (scored poses freeze at
  ``E``, so a chunk after a STOP or a hard collision gains 0 and a colliding step's motion is never credited).
* ``missed_k = sum over active steps j of chunk k of (G*_j - G*_{j+1})``: what the expert gained over the same
  steps. ``progress_k - missed_k`` is the progress *relative to the expert*: 0 for the expert, ``-missed_k``
  for standing still, so standing still is charged the progress it misses instead of scoring a free 0.
* ``forfeit = max(G*_E - G*_32, 0)`` metres the expert would still have gained after the end step, when the
  rollout ended by a hard collision or by a *premature* STOP (geodesic ``G_E > rho``); 0 when it did not end
  early or its STOP succeeded (it has arrived: nothing is left to gain). Credited to the layer of the decision
  that ended the rollout: ``nav_{k_E}`` for a collision (the motion collided), ``stop_{k_E}`` for a STOP (the
  stop channel ended it). The chunks after ``E`` are masked out of the loss (``RolloutGeometry.layer_valid``), so
  without this term what they would have earned would simply vanish from the comparison; and because the
  advantages are normalised per prompt and layer, only a term placed on a *live* layer of the deciding channel
  changes what that decision is credited with. With ``missed`` and ``forfeit``, stopping (or colliding) at step
  ``E`` scores like standing still from ``E`` to the end of the horizon, before the STOP and collision terms.
* ``deviation_k = (1/8) * sum over active steps j of chunk k of min(max(d_{j+1} - tol, 0), cap)`` metres,
  where ``d_{j+1}`` is the distance from scored pose ``j + 1`` to the reference polyline (the 33
  reference poses joined by segments), ``tol = deviation_tolerance_m`` and ``cap = deviation_cap_m``.

``nav_k = progress_weight * (progress_k - missed_k - forfeit_k^nav) - deviation_weight * deviation_k`` and
``stop_k = -progress_weight * forfeit_k^stop``. Diagnostics (``[N, 4]``, un-weighted, >= 0 except progress):
``progress``, ``missed``, ``forfeit`` (in the chunk of ``E``, whichever layer it went to) and ``deviation``.
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
from verl_omni.utils.reward_score.trajectory import (
    CHUNK_STEPS,
    CHUNKS,
    STEPS,
    RolloutGeometry,
    chunk_of_step,
    chunk_sum,
)
from verl_omni.utils.reward_score.types import RewardBatch

NAV_LAYERS = tuple(f"nav_{k}" for k in range(1, CHUNKS + 1))
STOP_LAYERS = tuple(f"stop_{k}" for k in range(1, CHUNKS + 1))


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


def missed_per_chunk(reference_geodesic: np.ndarray, active: np.ndarray) -> np.ndarray:
    """``[N, 33]`` geodesic metres at the reference poses + ``bool [N, 32]`` active steps -> ``[N, 4]`` metres the
    expert gained over the rollout's active steps of each chunk."""
    gained = reference_geodesic[:, :-1] - reference_geodesic[:, 1:]
    return chunk_sum(np.where(active, gained, 0.0))


def forfeit_per_chunk(reference_geodesic: np.ndarray, end_step: np.ndarray, ended_early: np.ndarray) -> np.ndarray:
    """What the expert would still have gained after an early end, placed in the chunk of the end step.

    Args:
        reference_geodesic: ``[N, 33]`` metres at the reference poses.
        end_step: ``int [N]`` end step ``E`` (32: none).
        ended_early: ``bool [N]`` rollouts that forfeit (a hard collision or a premature STOP).

    Returns:
        ``[N, 4]`` metres (>= 0), non-zero at most in chunk ``E // 8``.
    """
    rows = np.arange(reference_geodesic.shape[0])
    left = np.maximum(reference_geodesic[rows, np.minimum(end_step, STEPS)] - reference_geodesic[:, -1], 0.0)
    at_end = chunk_of_step(end_step)[:, None] == np.arange(CHUNKS)[None, :]
    return np.where(at_end & (ended_early & (end_step < STEPS))[:, None], left[:, None], 0.0)


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
    layers = NAV_LAYERS + STOP_LAYERS

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: NavigationConfig = self.config  # type: ignore[assignment]
        progress = progress_per_chunk(geometry.geodesic)
        missed = missed_per_chunk(geometry.reference_geodesic, geometry.active)
        premature = geometry.stopped & ~geometry.succeeded(batch.success_radius)
        forfeit = forfeit_per_chunk(geometry.reference_geodesic, geometry.end_step, geometry.collided | premature)
        on_stop = np.where(premature[:, None], forfeit, 0.0)
        deviation = deviation_per_chunk(
            geometry.reference_distance, geometry.active, cfg.deviation_tolerance_m, cfg.deviation_cap_m
        )
        nav = cfg.progress_weight * (progress - missed - (forfeit - on_stop)) - cfg.deviation_weight * deviation
        stop = -cfg.progress_weight * on_stop
        scores = {layer: nav[:, k] for k, layer in enumerate(NAV_LAYERS)}
        scores.update({layer: stop[:, k] for k, layer in enumerate(STOP_LAYERS)})
        return ModuleResult(
            scores=scores,
            diagnostics={"progress": progress, "missed": missed, "forfeit": forfeit, "deviation": deviation},
        )
