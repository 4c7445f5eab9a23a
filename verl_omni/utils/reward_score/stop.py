"""STOP reward (layers ``stop_1..stop_4``).

The first step with a stop flag ends the episode for scoring. A STOP *happens* when that step exists and
no hard collision ended the scored episode before it (``RolloutGeometry.stopped``). Let ``s`` be the STOP
step, ``k_s = s // 8 + 1`` its chunk, ``G_s`` the geodesic distance from the STOP pose to the goal (metres)
and ``rho`` the rollout's success radius. Success is geodesic, ``G_s <= rho``, exactly the closed-loop
evaluator's rule (``verl_omni.sim.closed_loop``: STOP with the geodesic distance to the goal at most the
success radius); a Euclidean test would reward STOPs behind a wall next to the goal. Terms (all credited to
``stop_{k_s}``, except the missed STOP):

* ``success = 1`` when a STOP happens with ``G_s <= rho``.
* ``premature = min(premature_base + premature_scale * G_s, premature_cap)`` when a STOP happens with
  ``G_s > rho`` (``premature_cap`` also when ``G_s`` is not finite). With the default ``premature_base = 0`` it is
  proportional to the remaining geodesic distance, so a STOP at 5 rho costs 2.5 times a STOP at 2 rho until the
  cap. ``premature_base`` charges every premature STOP a fixed amount first: just outside the radius the
  distance term is small, and a STOP there scored above standing still (which is charged the required STOP it
  misses) in 70% of the study's query states 0 to 0.5 m beyond the radius whose expert drives on
  (``scripts/reward_ranking.py``, "by distance"), where the evaluator ranks them the other way: a STOP ends the
  episode in failure, a missed one can still be made at the next call. With ``premature_base`` at the missed-STOP
  penalty (1.0, cap 3.0), 8%. What the expert would still have gained
  after the STOP is forfeited on the same layer by the ``navigation`` reward, so on progress a premature STOP
  scores like standing still from the same pose, below continuing like the expert, and this penalty comes on
  top. (Standing still can still score lower where it pays for lingering near a wall or for a required STOP it
  never makes.)
* ``near_goal = 1`` when a STOP happens with ``G_s > rho`` and the query state carries the
  ``near_goal_continuation`` event (the expert keeps driving near the goal).
* ``missed = 1`` when the query state carries ``required_stop`` and no STOP happens; credited to the last
  live STOP layer (``stop_4``, or the chunk of a hard collision that ended the rollout first: later chunks are
  masked out of the loss and would swallow the penalty).

``stop_k = success_reward * success - premature - near_goal_penalty * near_goal - missed_stop_penalty *
missed`` for the chunk each term is credited to; every other stop layer is 0. Diagnostics (``[N, 4]``, the
same chunk placement): ``success``, ``premature`` (the capped penalty, already scaled), ``near_goal``,
``missed``; and ``[N]``: ``stop_distance_m`` (``G_s``, NaN when no STOP happened).
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
from verl_omni.utils.reward_score.trajectory import CHUNKS, RolloutGeometry, chunk_of_step
from verl_omni.utils.reward_score.types import RewardBatch

STOP_LAYERS = tuple(f"stop_{k}" for k in range(1, CHUNKS + 1))


@dataclass(frozen=True)
class StopConfig(RewardModuleConfig):
    """Options of the ``stop`` reward (see module docstring)."""

    success_reward: float = 1.0
    premature_scale: float = 0.5
    premature_cap: float = 2.0
    premature_base: float = 0.0
    missed_stop_penalty: float = 1.0
    near_goal_penalty: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "success_reward",
            "premature_scale",
            "premature_cap",
            "premature_base",
            "missed_stop_penalty",
            "near_goal_penalty",
        ):
            check_non_negative("stop", name, getattr(self, name))


def stop_terms(
    stopped: np.ndarray,
    stop_step: np.ndarray,
    stop_geodesic: np.ndarray,
    success_radius: np.ndarray,
    required: np.ndarray,
    near_goal_event: np.ndarray,
    missed_chunk: np.ndarray,
    cfg: StopConfig,
) -> dict[str, np.ndarray]:
    """Per-chunk STOP terms.

    Args:
        stopped: ``bool [N]`` a STOP happened.
        stop_step: ``int [N]`` STOP step (any value where ``stopped`` is False).
        stop_geodesic: ``[N]`` geodesic metres to the goal where the robot stops.
        success_radius: ``[N]`` metres.
        required: ``bool [N]`` the query state requires a STOP.
        near_goal_event: ``bool [N]`` the query state is a near-goal continuation.
        missed_chunk: ``int [N]`` 0-based chunk a missed STOP is credited to (the last live one).
        cfg: Weights and cap.

    Returns:
        ``{"success", "premature", "near_goal", "missed": [N, 4], "stop_distance_m": [N]}``.
    """
    finite = np.isfinite(stop_geodesic)
    inside = stopped & finite & (np.where(finite, stop_geodesic, np.inf) <= success_radius)
    outside = stopped & ~inside
    at_stop = chunk_of_step(stop_step)[:, None] == np.arange(CHUNKS)[None, :]  # [N, 4]
    scaled = cfg.premature_base + cfg.premature_scale * np.where(finite, stop_geodesic, 0.0)
    premature_value = np.where(finite, np.minimum(scaled, cfg.premature_cap), cfg.premature_cap)
    at_missed = np.asarray(missed_chunk)[:, None] == np.arange(CHUNKS)[None, :]
    missed = (at_missed & (required & ~stopped)[:, None]).astype(np.float64)
    return {
        "success": (at_stop & inside[:, None]).astype(np.float64),
        "premature": np.where(at_stop & outside[:, None], premature_value[:, None], 0.0),
        "near_goal": (at_stop & (outside & near_goal_event)[:, None]).astype(np.float64),
        "missed": missed,
        "stop_distance_m": np.where(stopped, stop_geodesic, np.nan),
    }


@register_reward("stop")
class StopReward(RewardModule):
    config_class = StopConfig
    layers = STOP_LAYERS

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: StopConfig = self.config  # type: ignore[assignment]
        terms = stop_terms(
            stopped=geometry.stopped,
            stop_step=geometry.stop_step,
            stop_geodesic=geometry.stop_geodesic(),
            success_radius=np.nan_to_num(batch.success_radius),
            required=batch.has_event("required_stop") & geometry.valid,
            near_goal_event=batch.has_event("near_goal_continuation"),
            missed_chunk=np.where(geometry.collided, chunk_of_step(geometry.collision_step), CHUNKS - 1),
            cfg=cfg,
        )
        total = (
            cfg.success_reward * terms["success"]
            - terms["premature"]
            - cfg.near_goal_penalty * terms["near_goal"]
            - cfg.missed_stop_penalty * terms["missed"]
        )
        return ModuleResult(scores={layer: total[:, k] for k, layer in enumerate(STOP_LAYERS)}, diagnostics=terms)
