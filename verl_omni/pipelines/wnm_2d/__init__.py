"""WNM-2D baseline: the same world-action model without geometry tokens.

The actor worker builds everything of a ``wnm_2d`` run through :data:`PIPELINE`: the model (refusing a checkpoint
of the other variant), the rollout backend over the shared machinery of :mod:`verl_omni.pipelines.wnm_shared`
and the actor, the same class as WNM-3D's (:mod:`.actor`).
"""

from __future__ import annotations

from verl_omni.pipelines.wnm_2d.actor import UpdateMicroBatch, WNMDiffusionActor
from verl_omni.pipelines.wnm_shared.pipeline import VariantPipeline

VARIANT = "wnm_2d"
PIPELINE = VariantPipeline(VARIANT, WNMDiffusionActor)
load_model = PIPELINE.load_model
build_backend = PIPELINE.build_backend

__all__ = ["PIPELINE", "VARIANT", "UpdateMicroBatch", "WNMDiffusionActor", "build_backend", "load_model"]
