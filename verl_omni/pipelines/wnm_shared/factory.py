"""Builds a rollout backend by name for a model of a given WNM variant."""

from __future__ import annotations

from verl_omni.pipelines.wnm_shared.backend import RolloutBackend
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.native import NativeRolloutBackend

BACKENDS = ("native", "vllm_omni")


def build_rollout_backend(
    model,
    variant: str,
    backend: str = "native",
    sampler: SamplerConfig | None = None,
    config=None,
) -> RolloutBackend:
    """A backend around ``model`` after checking that the model is of ``variant``.

    Args:
        model: A ``WNMModel``.
        variant: ``wnm_3d`` or ``wnm_2d``; must equal ``model.config.variant``.
        backend: ``native`` or ``vllm_omni`` (needs the ``vllm-omni`` extra; imported only when selected).
        sampler: Sampler configuration (defaults when None).
        config: ``NativeBackendConfig`` for ``native`` (defaults when None); for ``vllm_omni`` a
            ``VllmOmniEngineConfig`` (real engine, GPU).
    """
    model_variant = getattr(model.config, "variant", None)
    if model_variant != variant:
        raise ValueError(
            f"the {variant} pipeline got a model of variant {model_variant!r}; load a {variant} checkpoint "
            f"or use the verl_omni.pipelines.{model_variant} pipeline"
        )
    if backend not in BACKENDS:
        raise ValueError(f"rollout backend {backend!r} is not available; choose one of {list(BACKENDS)}")
    if backend == "vllm_omni":
        from verl_omni.pipelines.wnm_vllm_omni.extra import require_vllm_omni

        require_vllm_omni(f"rollout backend {backend!r}")
        from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend

        return VllmOmniRolloutBackend.from_model(model, sampler, config)
    if config is not None and not isinstance(config, NativeBackendConfig):
        raise TypeError(f"the native backend takes a NativeBackendConfig, got {type(config).__name__}")
    return NativeRolloutBackend.from_model(model, sampler, config)
