"""The feed-forward's first product with its bias and tanh GELU by QuACK's GEMM (optional ``quack-kernels``).

Why another GEMM: cuBLASLt's bias + GELU epilogue (``torch._addmm_activation``, the block's default in inference)
runs that product at about 634 TFLOP/s on an H100 at Wan-1.3B batch 16, against about 731 for the block's plain
GEMMs (session 39 profile): about 13 ms of a 451 ms forward, in cuBLASLt's kernel choice, which PyTorch gives no
handle on. QuACK (the CuTe DSL kernel library FlashAttention-4 depends on, so installed with it) applies the bias
and the GELU in its own Hopper/Blackwell GEMM's epilogue on the fp32 accumulator, the same arithmetic as
cuBLASLt's epilogue. ``quack.gemm_interface.gemm_act`` is a ``torch.library`` op, so compiled blocks keep it as one
call. Imported on first use only.
"""

from __future__ import annotations

import torch

QUACK_INSTALL_HINT = "the 'quack' feed-forward GEMM needs QuACK on a Hopper or Blackwell GPU: pip install quack-kernels"


def quack_available() -> bool:
    """Whether QuACK's GEMM interface imports (it needs the CuTe DSL, ``nvidia-cutlass-dsl``)."""
    try:
        _gemm_interface()
    except ImportError:
        return False
    return True


def _gemm_interface():
    try:
        from quack import gemm_interface
    except ImportError as e:
        raise ImportError(f"{QUACK_INSTALL_HINT}; import failed with: {e}") from e
    return gemm_interface


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x W^T + b)`` in one GEMM; only the activation is stored.

    Args:
        x: ``[M, K]`` bf16/fp16 CUDA, dense last dimension.
        weight: ``[N, K]`` (an ``nn.Linear`` weight), x's dtype.
        bias: ``[N]``, x's dtype.

    Returns:
        ``[M, N]`` in x's dtype.
    """
    _, postact = _gemm_interface().gemm_act(
        x, weight.t(), bias=bias, activation="gelu_tanh_approx", store_preact=False, tuned=False
    )
    return postact
