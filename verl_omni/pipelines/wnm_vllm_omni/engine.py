"""Engines behind the vllm_omni backend: the real vLLM-Omni one and an in-process stand-in.

Both implement :class:`EngineClient`, the small surface the backend needs:

- :class:`VllmOmniEngine` starts vLLM-Omni (``AsyncOmni``) with ``model_class_name="WNMDiTPipeline"`` and
  our worker extension, submits one diffusion request per rollout (vLLM-Omni batches and schedules them,
  and runs sequence/CFG/VAE-patch parallelism as configured) and uses ``collective_rpc`` for contexts,
  results, weight buckets and ``sleep``/``wake_up``. It needs vLLM's CUDA engine, i.e. an NVIDIA GPU.
- :class:`InProcessEngine` is the stand-in at exactly that boundary, for machines without a GPU (CI): it
  builds the same ``WNMDiTPipeline`` class in-process and calls the same ``forward``-side code
  (``run_batch``) and the same worker-extension methods, without vLLM's scheduler, worker processes and
  CUDA memory pool. Everything on our side of the boundary is the code that runs under vLLM-Omni.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from verl_omni.pipelines.wnm_vllm_omni.weight_sync import WeightBucket
from verl_omni.pipelines.wnm_vllm_omni.worker_ext import WORKER_EXTENSION, WNMWorkerExtension


class EngineClient(Protocol):
    def put_contexts(self, key: str, contexts) -> None: ...
    def drop_contexts(self, key: str) -> None: ...
    def generate(self, payloads: Sequence[dict]) -> list[dict]: ...
    def begin_weight_sync(self, version: int, num_buckets: int) -> None: ...
    def load_weight_bucket(self, bucket: WeightBucket) -> None: ...
    def commit_weight_sync(self, version: int) -> int: ...
    def weight_version(self) -> int: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def shutdown(self) -> None: ...


@dataclass
class VllmOmniEngineConfig:
    """How vLLM-Omni runs the WNM pipeline.

    Attributes:
        checkpoint: Complete WNM checkpoint directory (``od_config.model``).
        dtype: DiT dtype in the engine (``bfloat16`` on GPU).
        sampler: ``SamplerConfig`` fields (``pipeline.sampler_to_args``); must equal the trainer's.
        deterministic: Per-request evaluation (bit-identical whatever the batch); None = sampler default.
        max_num_seqs: Rollouts vLLM-Omni may batch into one pipeline call.
        ulysses_degree, ring_degree: Sequence parallelism (DiT attention) across GPUs.
        cfg_parallel_size: Classifier-free-guidance parallelism (1: the WNM sampler uses no CFG).
        vae_patch_parallel_size: VAE patch parallelism (the rollout sends latents; decoding is optional).
        enable_sleep_mode: Let ``sleep()`` release the weights' GPU memory (CuMem pool) during training.
        extra: Further ``AsyncOmni`` keyword arguments.
    """

    checkpoint: str
    dtype: str = "bfloat16"
    sampler: dict = field(default_factory=dict)
    deterministic: bool | None = None
    chunk_size: int | None = None
    max_num_seqs: int = 16
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    vae_patch_parallel_size: int = 1
    enable_sleep_mode: bool = True
    extra: dict = field(default_factory=dict)

    def custom_pipeline_args(self) -> dict:
        return {"sampler": dict(self.sampler), "deterministic": self.deterministic, "chunk_size": self.chunk_size}


class InProcessEngine:
    """The WNM pipeline without vLLM's engine (stand-in for the GPU engine; see the module docstring).

    Args:
        pipeline: A ``WNMDiTPipeline`` (built with ``model=`` or from a checkpoint).
        max_num_seqs: Requests per pipeline call, as vLLM-Omni's scheduler would batch them.
    """

    def __init__(self, pipeline, max_num_seqs: int = 16) -> None:
        self.pipeline = pipeline
        self.max_num_seqs = max(1, int(max_num_seqs))
        # The worker extension's methods, bound to an object shaped like vLLM-Omni's worker.
        self.worker = type("InProcessWorker", (WNMWorkerExtension,), {})()
        self.worker.model_runner = SimpleNamespace(pipeline=pipeline)
        self.calls = 0

    def put_contexts(self, key, contexts):
        self.worker.wnm_put_contexts(key, contexts)

    def drop_contexts(self, key):
        self.worker.wnm_drop_contexts(key)

    def generate(self, payloads):
        ids = [p["request_id"] for p in payloads]
        for i in range(0, len(payloads), self.max_num_seqs):
            chunk = payloads[i : i + self.max_num_seqs]
            requests = [
                SimpleNamespace(request_id=p["request_id"], sampling_params=SimpleNamespace(extra_args={"wnm": p}))
                for p in chunk
            ]
            self.pipeline.run_batch(requests)
            self.calls += 1
        return self.worker.wnm_take_results(ids)

    def begin_weight_sync(self, version, num_buckets):
        self.worker.wnm_begin_weight_sync(version, num_buckets)

    def load_weight_bucket(self, bucket):
        self.worker.wnm_load_weight_bucket(bucket)

    def commit_weight_sync(self, version):
        return self.worker.wnm_commit_weight_sync(version)

    def weight_version(self):
        return self.worker.wnm_weight_version()

    def sleep(self):
        self.pipeline.core.sleep()

    def wake_up(self):
        self.pipeline.core.wake_up()

    def shutdown(self):
        pass


class VllmOmniEngine:
    """vLLM-Omni's ``AsyncOmni`` running ``WNMDiTPipeline``, driven from synchronous code.

    An event loop in a background thread owns the ``AsyncOmni`` instance; every method submits a
    coroutine to it and waits. Needs an NVIDIA GPU (vLLM's CUDA engine); not exercised on CPU.
    """

    def __init__(self, config: VllmOmniEngineConfig) -> None:
        from verl_omni.pipelines.wnm_vllm_omni.extra import require_vllm_omni

        require_vllm_omni("the vllm_omni rollout engine")
        from verl_omni.pipelines.wnm_vllm_omni.pipeline import PIPELINE_ARCH
        from verl_omni.pipelines.wnm_vllm_omni.registration import register

        register()  # this process; worker processes register through the entry point
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wnm-vllm-omni-loop", daemon=True)
        self._thread.start()

        async def start():
            from vllm_omni import AsyncOmni

            kwargs: dict[str, Any] = {
                "model_class_name": PIPELINE_ARCH,
                "dtype": config.dtype,
                "worker_extension_cls": WORKER_EXTENSION,
                "custom_pipeline_args": config.custom_pipeline_args(),
                "enable_sleep_mode": config.enable_sleep_mode,
                "max_num_seqs": config.max_num_seqs,
                "ulysses_degree": config.ulysses_degree,
                "ring_degree": config.ring_degree,
                "cfg_parallel_size": config.cfg_parallel_size,
                "vae_patch_parallel_size": config.vae_patch_parallel_size,
            }
            kwargs.update(config.extra)
            return AsyncOmni(model=config.checkpoint, **kwargs)

        self._omni = self._run(start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _rpc(self, method: str, *args, rank0: bool = False):
        out = self._run(self._omni.collective_rpc(method, args=args))
        # AsyncOmni returns one entry per stage; a diffusion stage's entry holds one reply per rank.
        replies = out[0] if isinstance(out, list) and out and isinstance(out[0], list) else out
        return replies[0] if rank0 and isinstance(replies, list) else replies

    def put_contexts(self, key, contexts):
        self._rpc("wnm_put_contexts", key, contexts)

    def drop_contexts(self, key):
        self._rpc("wnm_drop_contexts", key)

    def generate(self, payloads):
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        async def one(p):
            # The schedule, steps and noise are the WNM sampler's (extra_args); vLLM-Omni's own fields stay unset.
            params = OmniDiffusionSamplingParams(extra_args={"wnm": p})
            final = None
            async for out in self._omni.generate(
                prompt=f"wnm rollout {p['request_id']}", sampling_params=params, request_id=uuid.uuid4().hex
            ):
                final = out
            return final

        async def all_():
            return await asyncio.gather(*(one(p) for p in payloads))

        self._run(all_())
        return self._rpc("wnm_take_results", [p["request_id"] for p in payloads], rank0=True)

    def begin_weight_sync(self, version, num_buckets):
        self._rpc("wnm_begin_weight_sync", version, num_buckets)

    def load_weight_bucket(self, bucket):
        self._rpc("wnm_load_weight_bucket", bucket)

    def commit_weight_sync(self, version):
        return self._rpc("wnm_commit_weight_sync", version, rank0=True)

    def weight_version(self):
        return self._rpc("wnm_weight_version", rank0=True)

    def sleep(self):
        self._run(self._omni.sleep(level=1))

    def wake_up(self):
        self._run(self._omni.wake_up())

    def shutdown(self):
        try:
            close = getattr(self._omni, "shutdown", None) or getattr(self._omni, "close", None)
            if close is not None:
                res = close()
                if asyncio.iscoroutine(res):
                    self._run(res)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
