"""WNM-3D: geometry-conditioned world-action model (text, image and 3D geometry tokens).

Rollouts use the shared machinery of :mod:`verl_omni.pipelines.wnm_shared`; this package only fixes the variant.
"""

from __future__ import annotations

from verl_omni.pipelines.wnm_shared.backend import RolloutBackend
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.factory import build_rollout_backend

VARIANT = "wnm_3d"


def build_backend(
    model,
    backend: str = "native",
    sampler: SamplerConfig | None = None,
    config: NativeBackendConfig | None = None,
) -> RolloutBackend:
    """Rollout backend for a wnm_3d ``WNMModel`` (refuses models of the other variant)."""
    return build_rollout_backend(model, VARIANT, backend, sampler, config)


__all__ = ["VARIANT", "build_backend"]
