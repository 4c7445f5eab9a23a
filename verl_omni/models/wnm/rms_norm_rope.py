"""The self-attention's q/k RMS norm and Wan's RoPE as one Triton kernel (CUDA, bf16/fp16 inference).

Why hand-written: compiled, inductor already fuses ``RMSNorm`` (across all heads) and the interleaved-pair
rotation into one kernel per block, in our model and in diffusers' alike, but that kernel moves q and k at about a
third of the card's bandwidth (H100 profile, session 34: 1.04 ms a block for one read and one write of q and k at
Wan-1.3B batch 16, 30 ms of a 473 ms forward). It is a looped reduction that reads each row a second time for the
output and loads the even and odd elements of each pair separately. No library we know fuses a norm over the
whole width with a per-head rotation (Liger has an RMS norm kernel and a RoPE kernel, one pass each). Here one
program owns one token: it loads the token's ``heads * head_dim`` values once as pairs, reduces, normalises,
rotates and stores, so each element is read and written once.

Same arithmetic as the eager path (``attention._qk_norm`` then ``attention._apply_rope``): the sum of squares in
fp32, ``x * rsqrt(mean + eps) * weight`` rounded to the activation dtype (what the norm returns), then the
rotation of each pair in fp32, rounded once on store. The reduction order differs, so the result equals the
eager one to bf16 rounding, not bit for bit.

``wnm::rms_norm_rope`` is a ``torch.library.triton_op``: eager it launches the kernel; under ``torch.compile``
inductor sees the Triton kernel itself and keeps it in the graph (fullgraph included). It has no autograd formula:
the block uses it only without grad (the rollout's forwards); training keeps the composite form inductor
differentiates. Triton is imported here only, so the package imports without it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# Whether Triton is installed (it comes with PyTorch's CUDA wheels; CPU-only installs may lack it). Looked up, not
# imported, so that importing the model stays cheap; read as a module constant so that compiled code only guards it.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the fused kernel can replace norm + RoPE for the projection output ``x [B, S, D]``.

    Only where it computes what the eager path computes: CUDA, bf16/fp16 activations, no grad (the op has no
    backward), an affine norm, a dense last dimension, fewer than 2**31 elements (the kernel's offsets are 32-bit),
    and Triton installed. Everything else keeps the composite form (the fp32 path included, so its bits do not
    change).
    """
    return (
        weight is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.ndim == 3
        and x.stride(-1) == 1
        and x.numel() < 2**31
        and not torch.is_grad_enabled()
        and TRITON_INSTALLED
    )


@functools.cache
def _kernel():
    """Builds the Triton kernel on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rope_kernel(
        x_ptr,
        weight_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        seq_len,
        x_stride_b,
        x_stride_s,
        cos_stride_s,
        cos_stride_d,
        sin_stride_s,
        sin_stride_d,
        eps,
        PAIRS: tl.constexpr,
        PAIRS_BLOCK: tl.constexpr,
        HALF_HEAD: tl.constexpr,
    ):
        # One program per token: its PAIRS = heads * head_dim / 2 interleaved (even, odd) pairs as [PAIRS_BLOCK, 2].
        row = tl.program_id(0)
        b = row // seq_len
        s = row % seq_len
        pair = tl.arange(0, PAIRS_BLOCK)
        in_row = pair < PAIRS
        offsets = pair[:, None] * 2 + tl.arange(0, 2)[None, :]
        mask = in_row[:, None]
        x = tl.load(x_ptr + b * x_stride_b + s * x_stride_s + offsets, mask=mask, other=0.0).to(tl.float32)
        mean_square = tl.sum(tl.sum(x * x, axis=1), axis=0) / (PAIRS * 2)
        weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # The norm's output in the activation dtype, as RMSNorm returns it before the rotation reads it.
        normed = (x * tl.rsqrt(mean_square + eps) * weight).to(out_ptr.dtype.element_ty).to(tl.float32)
        even, odd = tl.split(normed)
        # Wan's tables repeat each pair's angle: the pair's cosine at its even index, its sine at its odd one.
        freq = pair % HALF_HEAD
        cos = tl.load(cos_ptr + s * cos_stride_s + (2 * freq) * cos_stride_d, mask=in_row, other=0.0)
        sin = tl.load(sin_ptr + s * sin_stride_s + (2 * freq + 1) * sin_stride_d, mask=in_row, other=0.0)
        rotated = tl.join(even * cos - odd * sin, even * sin + odd * cos)
        tl.store(out_ptr + row * (PAIRS * 2) + offsets, rotated.to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_rope_kernel


@torch.library.triton_op("wnm::rms_norm_rope", mutates_args=())
def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, eps: float
) -> torch.Tensor:
    """``rope(rms_norm(x) * weight)`` of a projection output, fused.

    Args:
        x: ``[B, S, D]`` bf16/fp16 with ``D = heads * head_dim``, dense last dimension (any batch/sequence strides).
        weight: ``[D]`` the norm's weight (any float dtype).
        cos: ``[S, head_dim]`` fp32 (Wan's table; each pair's angle at its even index), any strides.
        sin: ``[S, head_dim]`` fp32 (each pair's angle at its odd index), any strides.
        head_dim: Per-head width (even).
        eps: The norm's epsilon.

    Returns:
        ``[B, S, D]`` contiguous, ``x``'s dtype.
    """
    batch, seq_len, width = x.shape
    out = torch.empty((batch, seq_len, width), dtype=x.dtype, device=x.device)
    pairs = width // 2
    torch.library.wrap_triton(_kernel())[(batch * seq_len,)](
        x,
        weight,
        cos,
        sin,
        out,
        seq_len,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        eps,
        PAIRS=pairs,
        PAIRS_BLOCK=max(16, 1 << (pairs - 1).bit_length()),
        HALF_HEAD=head_dim // 2,
        num_warps=4,
    )
    return out


def fused_rms_norm_rope(
    norm: torch.nn.Module, x: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor], heads: int
) -> torch.Tensor:
    """The q or k of Wan self-attention from its projection: ``x [B, S, D]`` -> ``[B, S, heads, D / heads]``.

    Equal (to bf16 rounding) to ``_apply_rope(_qk_norm(norm, x).unflatten(2, (heads, -1)), *rotary_emb)``.

    Args:
        norm: The block's ``RMSNorm`` over the full width (``rms_norm_across_heads``).
        x: Projection output; :func:`applies` must hold.
        rotary_emb: ``(cos, sin)`` each ``[1, S, 1, head_dim]`` fp32.
        heads: Attention heads.
    """
    width = x.shape[-1]
    if width % heads or (width // heads) % 2:
        raise ValueError(f"width {width} must split into {heads} heads of even size")
    if x.shape[-1] != norm.weight.shape[-1]:
        raise ValueError(f"norm width {norm.weight.shape[-1]} does not match the projection's {width}")
    cos, sin = (t[0, :, 0, :] for t in rotary_emb)
    if cos.shape != (x.shape[1], width // heads):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not match {x.shape[1]} tokens of {width // heads}")
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return rms_norm_rope(x, norm.weight, cos, sin, width // heads, float(eps)).unflatten(2, (heads, -1))
