"""GRPO learning math for WNM diffusion policies: advantages, clipped loss, metrics, log-prob recomputation.

Pure functions, no Ray: the Ray workers call them.
"""

from verl_omni.trainer.diffusion.advantages import (
    AdvantageResult,
    compute_layer_advantages,
    estimate_advantages,
    rewards_matrix,
    summed_layer_rewards,
)
from verl_omni.trainer.diffusion.config import AdvantageConfig, LossConfig
from verl_omni.trainer.diffusion.loss import LossOutput, clipped_layer_loss, logprob_consistency_metrics
from verl_omni.trainer.diffusion.recompute import recompute_layer_logprobs, recompute_results_logprobs

__all__ = [
    "AdvantageConfig",
    "AdvantageResult",
    "LossConfig",
    "LossOutput",
    "clipped_layer_loss",
    "compute_layer_advantages",
    "estimate_advantages",
    "logprob_consistency_metrics",
    "recompute_layer_logprobs",
    "recompute_results_logprobs",
    "rewards_matrix",
    "summed_layer_rewards",
]
