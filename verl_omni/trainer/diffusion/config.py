"""Typed configuration of the layer-conditioned advantages and the clipped GRPO loss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES

BASELINES = ("stratum", "prompt")
STD_SCOPES = ("prompt", "global")


@dataclass(frozen=True)
class AdvantageConfig:
    """How per-layer rewards become advantages (:mod:`verl_omni.trainer.diffusion.advantages`).

    Attributes:
        baseline: ``stratum`` (mean over the rollout's own stratum) or ``prompt`` (mean over the prompt).
        std: ``prompt`` (population std over the prompt's rollouts) or ``global`` (over the whole batch).
        eps: Added to the std.
        a_max: Advantages are clipped to ``[-a_max, a_max]``.
        num_strata, num_branches: Expected plan shape; every prompt group must match it.
        layer_conditioned: True gives every layer its own advantage; False is the summed-reward ablation (one
            advantage from the weighted mean of the layer rewards, shared by every layer).
    """

    baseline: str = "stratum"
    std: str = "prompt"
    eps: float = 1e-4
    a_max: float = 5.0
    num_strata: int = 4
    num_branches: int = 4
    layer_conditioned: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.layer_conditioned, bool):
            raise ValueError(f"AdvantageConfig.layer_conditioned must be a bool, got {self.layer_conditioned!r}")
        if self.baseline not in BASELINES:
            raise ValueError(f"AdvantageConfig.baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.std not in STD_SCOPES:
            raise ValueError(f"AdvantageConfig.std must be one of {STD_SCOPES}, got {self.std!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"AdvantageConfig.eps must be > 0, got {self.eps!r}")
        if not (isinstance(self.a_max, (int, float)) and self.a_max > 0 and math.isfinite(self.a_max)):
            raise ValueError(f"AdvantageConfig.a_max must be a finite number > 0, got {self.a_max!r}")
        for name in ("num_strata", "num_branches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdvantageConfig.{name} must be a positive int, got {v!r}")
        if self.baseline == "stratum" and self.num_branches < 2:
            raise ValueError("AdvantageConfig.baseline='stratum' needs num_branches >= 2 (a lone branch has no signal)")


@dataclass(frozen=True)
class LossConfig:
    """The clipped surrogate (:mod:`verl_omni.trainer.diffusion.loss`).

    Attributes:
        clip_eps: Ratio clip range ``[1 - eps, 1 + eps]``.
        layer_weights: Weight per layer name; missing layers weigh 1.0, unknown names are refused.
        kl_beta: Weight of the KL term against the reference policy (0 disables it).
    """

    clip_eps: float = 1e-4
    layer_weights: dict[str, float] = field(default_factory=dict)
    kl_beta: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.clip_eps, (int, float)) and 0 < self.clip_eps < 1):
            raise ValueError(f"LossConfig.clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if not (isinstance(self.kl_beta, (int, float)) and self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"LossConfig.kl_beta must be a finite number >= 0, got {self.kl_beta!r}")
        unknown = sorted(set(self.layer_weights) - set(LAYER_NAMES))
        if unknown:
            raise ValueError(f"LossConfig.layer_weights: unknown layer(s) {unknown}; layers are {list(LAYER_NAMES)}")
        weights = {name: float(self.layer_weights.get(name, 1.0)) for name in LAYER_NAMES}
        bad = [n for n, w in weights.items() if not (math.isfinite(w) and w >= 0)]
        if bad:
            raise ValueError(f"LossConfig.layer_weights must be finite and >= 0; bad: {bad}")
        if sum(weights.values()) <= 0:
            raise ValueError("LossConfig.layer_weights must not all be 0")
        object.__setattr__(self, "layer_weights", weights)

    def weight_vector(self) -> torch.Tensor:
        """``[9]`` float64 weights in :data:`LAYER_NAMES` order."""
        return torch.tensor([self.layer_weights[n] for n in LAYER_NAMES], dtype=torch.float64)
