"""Reward workers: CPU processes that score rollouts with the registered reward set (verl single controller).

Each worker builds the reward set once (validating its config) and keeps its scene cache for the whole
run, so occupancy maps and geodesic fields are computed once per worker, not per batch.
"""

from __future__ import annotations

import time

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl_omni.utils.reward_score.types import RewardBatch, RewardScores


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
    def score(self, batch: RewardBatch) -> RewardScores:
        """Scores one shard (``RewardBatch.select`` of the step's batch).

        Returns:
            The shard's ``float32 [N, 9]`` scores in ``LAYER_NAMES`` order, diagnostics, warnings and time.
        """
        t0 = time.perf_counter()
        if batch.size == 0:
            return RewardScores.empty()
        out = self.reward_set.score(batch)
        return RewardScores.from_output(out, time.perf_counter() - t0)
