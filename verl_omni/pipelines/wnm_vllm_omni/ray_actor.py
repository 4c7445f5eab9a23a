"""The vllm_omni rollout engine as a Ray actor, and the backend that drives it.

:func:`start_rollout_actor` starts :class:`VllmOmniRolloutActor` (one engine per actor: the GPUs it is given
serve vLLM-Omni's sequence/CFG-parallel ranks) and returns a :class:`VllmOmniRolloutBackend` over a
:class:`RayEngineClient`: the trainer sees an ordinary :class:`RolloutBackend` (``generate``,
``update_weights``, ``sleep``/``wake_up``, ``weight_version``) whose calls become actor calls.

``engine="vllm"`` runs vLLM-Omni (NVIDIA GPU); ``engine="in_process"`` runs the same pipeline class
without vLLM's engine (``engine.InProcessEngine``), which is how the actor is tested on CPU.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngineConfig

# torch.distributed / torchrun variables a trainer rank's process carries; the engine's process drops them.
DISTRIBUTED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


class VllmOmniRolloutActor:
    """Owns one engine; its methods are the :class:`~verl_omni.pipelines.wnm_vllm_omni.engine.EngineClient`.

    Args:
        engine: ``vllm`` or ``in_process``.
        config: :class:`VllmOmniEngineConfig` fields (``checkpoint`` is required).
    """

    def __init__(self, engine: str, config: dict) -> None:
        cfg = VllmOmniEngineConfig(**config)
        # A Ray actor started from a trainer rank inherits the rank's runtime_env, i.e. the torch.distributed
        # variables of the FSDP group (verl sets them per rank). This process only hosts the engine: vLLM-Omni
        # would take MASTER_PORT as its own master port (diffusion/data.py, _resolve_master_port), the same one
        # for every rank's engine (EADDRINUSE); without them it picks a free port and builds its own WORLD.
        self.dropped_env = {k: os.environ.pop(k) for k in DISTRIBUTED_ENV if k in os.environ}
        if engine == "vllm":
            from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngine

            self.engine = VllmOmniEngine(cfg)
        elif engine == "in_process":
            from types import SimpleNamespace

            from verl_omni.pipelines.wnm_vllm_omni.engine import InProcessEngine
            from verl_omni.pipelines.wnm_vllm_omni.pipeline import WNMDiTPipeline

            od = SimpleNamespace(model=cfg.checkpoint, dtype=cfg.dtype, custom_pipeline_args=cfg.custom_pipeline_args())
            self.engine = InProcessEngine(WNMDiTPipeline(od_config=od), cfg.max_num_seqs)
        else:
            raise ValueError(f"engine must be 'vllm' or 'in_process', got {engine!r}")

    def sleep_mode(self) -> bool:
        return bool(getattr(self.engine, "sleep_mode", True))

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)


class RayEngineClient:
    """:class:`EngineClient` whose calls run in a :class:`VllmOmniRolloutActor` (blocking ``ray.get``)."""

    def __init__(self, handle, timeout_s: float | None = None) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args):
        import ray

        return ray.get(self.handle.call.remote(method, *args), timeout=self.timeout_s)

    def put_contexts(self, key, contexts):
        return self._call("put_contexts", key, contexts)

    def drop_contexts(self, key):
        return self._call("drop_contexts", key)

    def generate(self, payloads):
        return self._call("generate", list(payloads))

    def begin_weight_sync(self, version, num_buckets):
        return self._call("begin_weight_sync", version, num_buckets)

    def load_weight_bucket(self, bucket):
        return self._call("load_weight_bucket", bucket)

    def commit_weight_sync(self, version):
        return self._call("commit_weight_sync", version)

    def weight_version(self):
        return self._call("weight_version")

    @property
    def sleep_mode(self) -> bool:
        """Whether the engine in the actor frees memory on sleep (off on CPU)."""
        import ray

        return bool(ray.get(self.handle.sleep_mode.remote(), timeout=self.timeout_s))

    def sleep(self):
        return self._call("sleep")

    def wake_up(self):
        return self._call("wake_up")

    def shutdown(self):
        import ray

        try:
            self._call("shutdown")
        finally:
            ray.kill(self.handle)


def caller_cuda_device() -> str | None:
    """The physical id of the calling process's current CUDA device (as ``CUDA_VISIBLE_DEVICES`` names it),
    or None when CUDA is not in use here."""
    import os

    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[index] if index < len(visible) else str(index)


def colocated_actor_options(runtime_env: dict | None = None) -> dict:
    """Ray options for an engine actor next to the calling rank (see ``start_rollout_actor(colocate=True)``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    device = caller_cuda_device()
    if device is not None:
        env_vars["CUDA_VISIBLE_DEVICES"] = device
    if env_vars:
        env["env_vars"] = env_vars
    options = {
        "num_cpus": 0,
        "num_gpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    }
    if env:
        options["runtime_env"] = env
    return options


def start_rollout_actor(
    model_config,
    action_normalization,
    config: VllmOmniEngineConfig,
    sampler=None,
    engine: str = "vllm",
    num_gpus: float = 1,
    runtime_env: dict | None = None,
    bucket_bytes: int | None = None,
    colocate: bool = False,
):
    """Starts a :class:`VllmOmniRolloutActor` and returns the :class:`VllmOmniRolloutBackend` driving it.

    Args:
        model_config: The checkpoint's ``WNMConfig`` (shapes, action layout).
        action_normalization: The checkpoint's action normalization.
        config: Engine configuration (checkpoint, dtype, parallelism); its sampler is set from ``sampler``.
        sampler: ``SamplerConfig`` (the trainer's).
        engine: ``vllm`` (GPU) or ``in_process``.
        num_gpus: GPUs for the actor (vLLM-Omni's parallel ranks run on them); 0 for ``in_process`` on CPU.
        runtime_env: Ray runtime environment for the actor (e.g. another Python environment).
        colocate: Start the engine next to the calling process (a trainer rank), on its node and its device,
            claiming no Ray resources of its own (the rank holds them): ``num_cpus=0``, ``num_gpus=0``, node
            affinity to the caller's node, and on a GPU rank ``CUDA_VISIBLE_DEVICES`` set to the rank's current
            device (Ray leaves that variable alone for an actor with zero GPUs). The engine's process has its
            own torch.distributed WORLD (vLLM-Omni builds it from the engine's own parallel sizes), not the
            rank's FSDP group, which vLLM-Omni would otherwise reuse and refuse ("data_parallel_size (1) does
            not match WORLD-derived value (N)"). ``num_gpus`` is then ignored.
    """
    import ray

    from verl_omni.data.actions import ActionLayout
    from verl_omni.pipelines.wnm_shared.config import SamplerConfig
    from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import sampler_to_args

    sampler = sampler or SamplerConfig()
    config.sampler = sampler_to_args(sampler)
    if colocate:
        options = colocated_actor_options(runtime_env)
    else:
        # On CPU the actor takes no CPU slot of its own: it runs next to the process that drives it.
        options = {"num_gpus": num_gpus, "num_cpus": 0 if not num_gpus else 1}
        if runtime_env:
            options["runtime_env"] = runtime_env
    handle = ray.remote(VllmOmniRolloutActor).options(**options).remote(engine, asdict(config))
    layout = ActionLayout(steps=model_config.action_steps, chunks=model_config.action_chunks)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return VllmOmniRolloutBackend(
        RayEngineClient(handle), tuple(model_config.target_latent_shape), action_normalization, sampler, layout, **kw
    )
