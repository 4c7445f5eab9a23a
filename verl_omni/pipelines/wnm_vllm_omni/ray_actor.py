"""The vllm_omni rollout engine as a Ray actor, and the backend that drives it.

:func:`start_rollout_actor` starts :class:`VllmOmniRolloutActor` (one engine per actor: the GPUs it is given
serve vLLM-Omni's sequence/CFG-parallel ranks) and returns a :class:`VllmOmniRolloutBackend` over a
:class:`RayEngineClient`: the trainer sees an ordinary :class:`RolloutBackend` (``generate``,
``update_weights``, ``sleep``/``wake_up``, ``weight_version``) whose calls become actor calls.

``engine="vllm"`` runs vLLM-Omni (NVIDIA GPU); ``engine="in_process"`` runs the same pipeline class
without vLLM's engine (``engine.InProcessEngine``), which is how the actor is tested on CPU.
"""

from __future__ import annotations

from dataclasses import asdict

from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngineConfig


class VllmOmniRolloutActor:
    """Owns one engine; its methods are the :class:`~verl_omni.pipelines.wnm_vllm_omni.engine.EngineClient`.

    Args:
        engine: ``vllm`` or ``in_process``.
        config: :class:`VllmOmniEngineConfig` fields (``checkpoint`` is required).
    """

    def __init__(self, engine: str, config: dict) -> None:
        cfg = VllmOmniEngineConfig(**config)
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


def start_rollout_actor(
    model_config,
    action_normalization,
    config: VllmOmniEngineConfig,
    sampler=None,
    engine: str = "vllm",
    num_gpus: float = 1,
    runtime_env: dict | None = None,
    bucket_bytes: int | None = None,
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
    """
    import ray

    from verl_omni.data.actions import ActionLayout
    from verl_omni.pipelines.wnm_shared.config import SamplerConfig
    from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import sampler_to_args

    sampler = sampler or SamplerConfig()
    config.sampler = sampler_to_args(sampler)
    # On CPU the actor takes no CPU slot of its own: it runs next to the trainer rank that drives it.
    options = {"num_gpus": num_gpus, "num_cpus": 0 if not num_gpus else 1}
    if runtime_env:
        options["runtime_env"] = runtime_env
    handle = ray.remote(VllmOmniRolloutActor).options(**options).remote(engine, asdict(config))
    layout = ActionLayout(steps=model_config.action_steps, chunks=model_config.action_chunks)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return VllmOmniRolloutBackend(
        RayEngineClient(handle), tuple(model_config.target_latent_shape), action_normalization, sampler, layout, **kw
    )
