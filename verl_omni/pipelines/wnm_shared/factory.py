"""Builds a rollout backend by name for a model of a given WNM variant."""

from __future__ import annotations

from verl_omni.pipelines.wnm_shared.backend import RolloutBackend
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.native import NativeRolloutBackend

BACKENDS = ("native",)


def build_rollout_backend(
    model,
    variant: str,
    backend: str = "native",
    sampler: SamplerConfig | None = None,
    config: NativeBackendConfig | None = None,
) -> RolloutBackend:
    """A backend around ``model`` after checking that the model is of ``variant``.

    Args:
        model: A ``WNMModel``.
        variant: ``wnm_3d`` or ``wnm_2d``; must equal ``model.config.variant``.
        backend: Backend name; ``native`` is the one this build provides.
        sampler: Sampler configuration (defaults when None).
        config: Native-backend execution configuration (defaults when None).
    """
    model_variant = getattr(model.config, "variant", None)
    if model_variant != variant:
        raise ValueError(
            f"the {variant} pipeline got a model of variant {model_variant!r}; load a {variant} checkpoint "
            f"or use the verl_omni.pipelines.{model_variant} pipeline"
        )
    if backend not in BACKENDS:
        raise ValueError(f"rollout backend {backend!r} is not available; choose one of {list(BACKENDS)}")
    return NativeRolloutBackend.from_model(model, sampler, config)
