"""What a variant's pipeline package gives the actor worker: its model, its rollout backend and its actor.

Each variant package (:mod:`verl_omni.pipelines.wnm_3d`, :mod:`verl_omni.pipelines.wnm_2d`) holds one
:class:`VariantPipeline` as ``PIPELINE``; :func:`verl_omni.pipelines.pipeline_for` picks it by the configured
``model.variant``. The pipeline refuses a checkpoint (before reading a weight) or a model of the other variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from verl_omni.contracts import VARIANTS, check_checkpoint_variant
from verl_omni.pipelines.wnm_shared.backend import RolloutBackend
from verl_omni.pipelines.wnm_shared.config import SamplerConfig
from verl_omni.pipelines.wnm_shared.factory import build_rollout_backend


@dataclass(frozen=True)
class VariantPipeline:
    """The model, backend and actor of one WNM variant.

    Attributes:
        variant: ``wnm_3d`` or ``wnm_2d``.
        actor_class: The per-rank actor class (``WNMDiffusionActor``, shared by both variants).
    """

    variant: str
    actor_class: type

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown WNM variant {self.variant!r}; choose one of {list(VARIANTS)}")

    def load_model(
        self,
        checkpoint: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        field: str = "model.variant",
    ):
        """Loads a complete checkpoint of this variant (a ``WNMModel``).

        Args:
            checkpoint: Complete WNM checkpoint directory.
            device / dtype: Where and in which dtype to place the model.
            field: The config field the variant came from, named when the checkpoint is of the other variant.

        Raises:
            VariantMismatchError: The checkpoint's ``model_config.variant`` is not this pipeline's variant.
        """
        from verl_omni.models.wnm import load_wnm_checkpoint

        check_checkpoint_variant(checkpoint, self.variant, field)
        return load_wnm_checkpoint(checkpoint, device=device, dtype=dtype)

    def build_backend(
        self, model, backend: str = "native", sampler: SamplerConfig | None = None, config=None
    ) -> RolloutBackend:
        """Rollout backend around ``model`` (refuses a model of the other variant); see ``build_rollout_backend``."""
        return build_rollout_backend(model, self.variant, backend, sampler, config)

    def build_actor(self, module: torch.nn.Module, layout, optimizer, scheduler=None, **kwargs):
        """The per-rank actor over ``module`` (arguments of ``WNMDiffusionActor``)."""
        return self.actor_class(module, layout, optimizer, scheduler, **kwargs)


__all__ = ["VariantPipeline"]
