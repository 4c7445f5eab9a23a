"""Device and process-group selection of our own.

verl 0.9.1 has no CPU platform: on a machine without GPUs it still reports ``cuda`` and builds
``cuda:nccl`` backend strings. The trainer therefore decides here, once, from the topology config (GPU
count per node) and what torch actually sees, and every worker uses this answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """Where a worker computes.

    Attributes:
        kind: ``cuda`` or ``cpu``.
        backend: torch.distributed backend (``nccl`` or ``gloo``).
        dit_dtype: Compute dtype of the DiT (bf16 on GPU, fp32 on CPU unless configured).
    """

    kind: str
    backend: str
    dit_dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        if self.kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def resolve_device(use_gpu: bool, dtype: str = "auto") -> DeviceSpec:
    """Picks the device of the calling process.

    Args:
        use_gpu: The topology asked for GPU workers.
        dtype: ``auto``, ``bfloat16`` or ``float32``.

    Raises:
        RuntimeError: GPUs were asked for but torch sees none (names CUDA_VISIBLE_DEVICES).
    """
    if use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "topology asks for GPU workers but torch sees no CUDA device in this process "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); set gpus_per_node=0 for CPU"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.device_count() > 1:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        kind, backend = "cuda", "nccl"
    else:
        kind, backend = "cpu", "gloo"
    if dtype == "auto":
        dit_dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    else:
        dit_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    return DeviceSpec(kind=kind, backend=backend, dit_dtype=dit_dtype)


def peak_memory_gb(spec: DeviceSpec) -> float:
    """Peak allocated accelerator memory (GB) since the last reset; resident set size on CPU."""
    if spec.kind == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    except (ImportError, OSError):
        return float("nan")


def reset_peak_memory(spec: DeviceSpec) -> None:
    if spec.kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
