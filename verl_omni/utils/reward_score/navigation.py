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

* Option ``charge_stop_chunk``: a premature STOP at step ``E`` of chunk ``k_E`` is also charged, on
  ``nav_{k_E}``, the expert's gain over the chunk's remaining steps ``E .. 8 k_E - 1`` (added to ``missed``): the
  robot stood still there, and standing still is charged the progress it misses. Without it a chunk cut short by
  a STOP is scored on fewer steps than its siblings that drive on, and since a policy's relative progress and guard
  terms are mostly negative, the STOP-er's motion looks better than theirs on the layer that credits motion. On the
  study's 2,640 Stage-III query states (R1's collection), the noisy imitator (0.25 rad) STOPping at step 2 / 4 / 6
  scored a higher ``nav_1`` than the same rollout driving on in 90 / 82 / 66% of the states whose expert does
  not stop in the first 12 steps; with the option, in 36 / 31 / 21% (``scripts/reward_ranking.py`` loads them).
  The forfeit on ``stop_{k_E}`` is unchanged (the STOP decision still sees all it gave up), so in the summed-reward
  ablation this remainder counts twice.

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
    charge_stop_chunk: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("progress_weight", "deviation_weight", "deviation_tolerance_m", "deviation_cap_m"):
            check_non_negative("navigation", name, getattr(self, name))
        if not isinstance(self.charge_stop_chunk, bool):
            raise ValueError(f"navigation.charge_stop_chunk must be true or false, got {self.charge_stop_chunk!r}")


def progress_per_chunk(geodesic: np.ndarray) -> np.ndarray:
    """``[N, 33]`` geodesic metres at scored poses -> ``[N, 4]`` metres gained per chunk."""
    bounds = geodesic[:, ::CHUNK_STEPS]  # poses 0, 8, 16, 24, 32
    return bounds[:, :-1] - bounds[:, 1:]


def missed_per_chunk(reference_geodesic: np.ndarray, active: np.ndarray) -> np.ndarray:
    """``[N, 33]`` geodesic metres at the reference poses + ``bool [N, 32]`` charged steps (the active ones, plus a
    premature STOP's chunk remainder under ``charge_stop_chunk``) -> ``[N, 4]`` metres the expert gained over them."""
    gained = reference_geodesic[:, :-1] - reference_geodesic[:, 1:]
    return chunk_sum(np.where(active, gained, 0.0))


def stop_chunk_remainder(end_step: np.ndarray, stopped_early: np.ndarray) -> np.ndarray:
    """The steps a premature STOP leaves in its own chunk: ``E .. 8 k_E - 1`` (``charge_stop_chunk``).

    Args:
        end_step: ``int [N]`` end step ``E`` (32: none).
        stopped_early: ``bool [N]`` rollouts ended by a premature STOP.

    Returns:
        ``bool [N, 32]``.
    """
    steps = np.arange(STEPS)[None, :]
    end = np.asarray(end_step)[:, None]
    same_chunk = chunk_of_step(steps) == chunk_of_step(end)
    return (np.asarray(stopped_early)[:, None] & (end < STEPS)) & (steps >= end) & same_chunk


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
        premature = geometry.stopped & ~geometry.succeeded(batch.success_radius)
        charged = geometry.active
        if cfg.charge_stop_chunk:
            charged = charged | stop_chunk_remainder(geometry.end_step, premature)
        missed = missed_per_chunk(geometry.reference_geodesic, charged)
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
