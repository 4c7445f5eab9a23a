"""Reward workers: CPU processes that score rollouts with the registered reward set (verl single controller).

Each worker builds the reward set once (validating its config) and keeps its scene cache for the whole
run, so occupancy maps and geodesic fields are computed once per worker, not per batch.
"""

from __future__ import annotations

import time

import numpy as np
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class RewardWorker(Worker):
    """Scores a shard of rollouts.

    Args:
        reward_set: The ``reward.reward_set`` config (see ``verl_omni.utils.reward_score``).
    """

    def __init__(self, reward_set: dict) -> None:
        super().__init__()
        from verl_omni.utils.reward_score import build_reward_set

        self.reward_set = build_reward_set(reward_set)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def score(self, batch: dict) -> dict:
        """Scores one shard.

        Args:
            batch: Keyword arguments of ``RewardBatch`` (numpy arrays / lists; latents optional).

        Returns:
            ``{"scores": float32 [N, 9] in LAYER_NAMES order, "diagnostics": {name: array},
            "warnings": [str], "score_s": float}``.
        """
        from verl_omni.utils.reward_score import RewardBatch

        t0 = time.perf_counter()
        if len(batch["rollout_id"]) == 0:
            return {"scores": np.zeros((0, 9), np.float32), "diagnostics": {}, "warnings": [], "score_s": 0.0}
        out = self.reward_set.score(RewardBatch(**batch))
        return {
            "scores": out.as_matrix(),
            "diagnostics": out.diagnostics,
            "warnings": out.warnings,
            "score_s": time.perf_counter() - t0,
        }
