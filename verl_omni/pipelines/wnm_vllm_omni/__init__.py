"""``vllm_omni`` rollout backend: the WNM DiT as a vLLM-Omni diffusion pipeline (docs/vllm_omni.md).

Importing this package never imports vllm or vllm_omni; only ``engine.VllmOmniEngine``, ``pipeline.forward``
and ``registration`` do, when they run. Modules:

- ``extra``: is the ``vllm-omni`` extra installed (and the pinned version set)?
- ``protocol``: request fields in, per-request tensors out, assembly into ``RolloutResults``;
- ``core`` / ``pipeline``: the pipeline (sampling through the shared ``wnm_shared`` sampler);
- ``registration``: the out-of-tree registration hook (entry point ``vllm_omni.general_plugins``);
- ``worker_ext``: the worker RPCs (contexts, results, weight buckets);
- ``weight_sync``: bucketed, versioned weight sync from the FSDP2 actor;
- ``engine``: vLLM-Omni's ``AsyncOmni`` engine, and the in-process stand-in used without a GPU;
- ``backend``: :class:`RolloutBackend` implementation; ``ray_actor``: the engine as a Ray actor.
"""

from verl_omni.pipelines.wnm_vllm_omni.extra import (
    EXTRA,
    INSTALL_COMMAND,
    MissingExtraError,
    missing_extra_message,
    require_vllm_omni,
    vllm_omni_available,
)

__all__ = [
    "EXTRA",
    "INSTALL_COMMAND",
    "MissingExtraError",
    "missing_extra_message",
    "require_vllm_omni",
    "vllm_omni_available",
]
