"""A residual add and the LayerNorm after it as one Triton kernel (CUDA, bf16/fp16 inference).

Each Wan block has three places where a branch joins the residual stream and the stream is normalised at once:
the previous block's gated feed-forward output before ``norm1`` (modulated), the gated self-attention output
before ``norm2`` (affine), and the cross-attention output before ``norm3`` (modulated). Per token, each reads the
stream and the branch, writes the new stream, and writes the normalised (and modulated) row for the next GEMM:
four rows of the model width, the least any form can move.

Why hand-written: inductor fuses each of these into one reduction kernel too, but over the model width (1536 at
Wan-1.3B, above its 1024-element limit for keeping a row in registers) it writes a loop that reads the row twice,
and it does not keep the new stream for the first norm of a block once the previous block's add has moved there
(``WNMTransformerBlock.block_forward``'s ``pending``): it recomputes it from the stream and the branch in both of
its consumers. On an H100 at batch 16 the norm before self-attention took 0.29 ms for two rows and the add before
it 0.29 ms for three, where four rows at the card's bandwidth take about 0.33 ms (session 39 profile). PyTorch
and Liger offer an add + RMS norm or a plain LayerNorm, not one with a per-token-group gate and modulation.

One program owns one token: it loads the stream row and the branch row once, adds them (through the token's gate
row, if any) in fp32, rounds the sum to the activation dtype and stores it (the new stream, as the composite form
rounds it), normalises that rounded sum in fp32 (mean, then the mean of squared deviations: the biased variance
``F.layer_norm`` uses), applies the norm's weight and bias and the token's modulation row in fp32, and rounds once
on store. The token's modulation group comes from its position: up to three consecutive groups (clean history,
noisy target, actions), given by where the second and third begin.

``wnm::residual_layer_norm`` is a ``torch.library.triton_op``: eager it launches the kernel; under ``torch.compile``
inductor keeps the Triton kernel in the graph. It has no autograd formula: the block uses it only without grad.
"""

from __future__ import annotations

import functools

import torch

from .rms_norm_rope import TRITON_INSTALLED

# Group tables [B, G, D] with G up to this many consecutive groups per sequence (history, target, actions).
MAX_GROUPS = 3


def applies(x: torch.Tensor, norm: torch.nn.Module, lengths: list[int] | None) -> bool:
    """Whether the fused kernel can replace residual add + norm (+ modulation) for the stream ``x [B, S, D]``.

    Only where it computes what the composite form computes: CUDA, bf16/fp16 activations, no grad (the op has no
    backward), a ``LayerNorm`` over the last dimension (diffusers' ``FP32LayerNorm`` is one), at most
    :data:`MAX_GROUPS` modulation groups, a dense last dimension, fewer than 2**31 elements (32-bit offsets), and
    Triton installed. Everything else, the fp32 path included, keeps the composite form and its bits.
    """
    return (
        isinstance(norm, torch.nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.ndim == 3
        and x.shape[-1] == norm.normalized_shape[0]
        and x.stride(-1) == 1
        and x.numel() < 2**31
        and (lengths is None or len(lengths) <= MAX_GROUPS)
        and not torch.is_grad_enabled()
        and TRITON_INSTALLED
    )


@functools.cache
def _kernel():
    """Builds the Triton kernel on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def residual_layer_norm_kernel(
        x_ptr,
        y_ptr,
        gate_ptr,
        weight_ptr,
        bias_ptr,
        scale_ptr,
        shift_ptr,
        stream_ptr,
        out_ptr,
        seq_len,
        second_group,
        third_group,
        x_stride_b,
        x_stride_s,
        y_stride_b,
        y_stride_s,
        gate_stride_b,
        gate_stride_g,
        scale_stride_b,
        scale_stride_g,
        shift_stride_b,
        shift_stride_g,
        eps,
        WIDTH: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_BRANCH: tl.constexpr,
        HAS_GATE: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_MODULATION: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = row // seq_len
        s = row % seq_len
        group = (s >= second_group).to(tl.int32) + (s >= third_group).to(tl.int32)
        col = tl.arange(0, BLOCK)
        mask = col < WIDTH
        x = tl.load(x_ptr + b * x_stride_b + s * x_stride_s + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_BRANCH:
            y = tl.load(y_ptr + b * y_stride_b + s * y_stride_s + col, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                gate = tl.load(gate_ptr + b * gate_stride_b + group * gate_stride_g + col, mask=mask, other=0.0)
                y = y * gate.to(tl.float32)
            # The new stream in the activation dtype, as the composite form stores it and normalises it.
            rounded = (x + y).to(stream_ptr.dtype.element_ty)
            tl.store(stream_ptr + row * WIDTH + col, rounded, mask=mask)
            x = rounded.to(tl.float32)
        mean = tl.sum(x, axis=0) / WIDTH
        centred = tl.where(mask, x - mean, 0.0)
        variance = tl.sum(centred * centred, axis=0) / WIDTH
        normed = centred * tl.rsqrt(variance + eps)
        if HAS_WEIGHT:
            normed = normed * tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            normed = normed + tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_MODULATION:
            scale = tl.load(scale_ptr + b * scale_stride_b + group * scale_stride_g + col, mask=mask, other=0.0)
            shift = tl.load(shift_ptr + b * shift_stride_b + group * shift_stride_g + col, mask=mask, other=0.0)
            normed = normed * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)
        tl.store(out_ptr + row * WIDTH + col, normed.to(out_ptr.dtype.element_ty), mask=mask)

    return residual_layer_norm_kernel


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


@torch.library.triton_op("wnm::residual_layer_norm", mutates_args=())
def residual_layer_norm(
    x: torch.Tensor,
    y: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    second_group: int,
    third_group: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stream = x + y * gate`` (rounded), ``out = layer_norm(stream) * weight + bias``, modulated, fused.

    Args:
        x: ``[B, S, D]`` bf16/fp16 residual stream, dense last dimension (any batch/sequence strides).
        y: ``[B, S, D]`` branch output in ``x``'s dtype, or None (no add: ``stream`` comes back empty).
        gate: ``[B, G, D]`` per-group gate (fp32), dense last dimension, or None (the branch is added as it is).
        weight: ``[D]`` the norm's weight, or None.
        bias: ``[D]`` the norm's bias, or None.
        scale: ``[B, G, D]`` per-group modulation scale (``out * (1 + scale) + shift``), or None (no modulation).
        shift: ``[B, G, D]`` per-group modulation shift; given with ``scale``.
        second_group: Position where the second group begins (``S`` for one group).
        third_group: Position where the third group begins (``S`` for at most two).
        eps: The norm's epsilon.

    Returns:
        ``(stream [B, S, D] contiguous, or [0] without y; out [B, S, D] contiguous)``, both in ``x``'s dtype.
    """
    batch, seq_len, width = x.shape
    out = torch.empty((batch, seq_len, width), dtype=x.dtype, device=x.device)
    stream = torch.empty((batch, seq_len, width) if y is not None else (0,), dtype=x.dtype, device=x.device)
    torch.library.wrap_triton(_kernel())[(batch * seq_len,)](
        x,
        # A pointer that a constexpr flag leaves untouched points at ``out``, the op's own output: if inductor's
        # analysis of which arguments the kernel writes ever fell back to "all of them", no input would be taken
        # for written.
        out if y is None else y,
        out if gate is None else gate,
        out if weight is None else weight,
        out if bias is None else bias,
        out if scale is None else scale,
        out if shift is None else shift,
        out if y is None else stream,
        out,
        seq_len,
        second_group,
        third_group,
        x.stride(0),
        x.stride(1),
        *_strides(y),
        *_strides(gate),
        *_strides(scale),
        *_strides(shift),
        eps,
        WIDTH=width,
        BLOCK=max(16, 1 << (width - 1).bit_length()),
        HAS_BRANCH=y is not None,
        HAS_GATE=gate is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        HAS_MODULATION=scale is not None,
        num_warps=8 if width > 2048 else 4,
    )
    return stream, out


def _group_starts(lengths: list[int] | None, seq_len: int) -> tuple[int, int]:
    """Where the second and third modulation groups begin (``seq_len`` for a group that does not exist)."""
    if lengths is None:
        return seq_len, seq_len
    if sum(lengths) != seq_len or len(lengths) > MAX_GROUPS:
        raise ValueError(f"group lengths {lengths} must be at most {MAX_GROUPS} and sum to the {seq_len} tokens")
    starts = [sum(lengths[:g]) for g in range(1, len(lengths))] + [seq_len] * (MAX_GROUPS - len(lengths))
    return starts[0], starts[1]


def _table(t: torch.Tensor | None, name: str, x: torch.Tensor, groups: int) -> None:
    """Refuses a per-group table that is not ``[B, groups, D]`` with a dense last dimension."""
    if t is not None and (tuple(t.shape) != (x.shape[0], groups, x.shape[2]) or t.stride(-1) != 1):
        raise ValueError(f"{name} must be [{x.shape[0]}, {groups}, {x.shape[2]}] with a dense last dimension, got "
                         f"{tuple(t.shape)} with strides {t.stride()}")  # fmt: skip


def fused_residual_layer_norm(
    norm: torch.nn.LayerNorm,
    x: torch.Tensor,
    branch: torch.Tensor | None,
    gate: torch.Tensor | None,
    lengths: list[int] | None,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new stream and its normalised (modulated) row: equal, to bf16 rounding, to the composite form
    ``stream = _gate(x, branch, gate, lengths)`` (or ``x + branch`` without a gate, or ``x`` without a branch) and
    ``_modulate(norm(stream.float()), scale, shift, lengths)`` (or ``norm(stream.float())`` without ``scale``), both
    rounded to ``x``'s dtype.

    Args:
        norm: The block's ``LayerNorm`` over the width (affine or not).
        x: ``[B, S, D]`` stream; :func:`applies` must hold.
        branch: ``[B, S, D]`` in ``x``'s dtype, or None.
        gate: ``[B, G, D]`` per-group gate, or None.
        lengths: The G consecutive group lengths, or None for one group.
        scale: ``[B, G, D]`` modulation scale, or None.
        shift: ``[B, G, D]`` modulation shift, with ``scale``.

    Returns:
        ``(stream [B, S, D], normed [B, S, D])``; ``stream`` is ``x`` itself without a branch.
    """
    groups = 1 if lengths is None else len(lengths)
    second, third = _group_starts(lengths, x.shape[1])
    if branch is not None and (branch.shape != x.shape or branch.dtype != x.dtype or branch.stride(-1) != 1):
        raise ValueError(f"branch must be {tuple(x.shape)} {x.dtype} with a dense last dimension, got "
                         f"{tuple(branch.shape)} {branch.dtype}")  # fmt: skip
    if (scale is None) != (shift is None):
        raise ValueError("modulation needs both scale and shift")
    for t, name in ((gate, "gate"), (scale, "scale"), (shift, "shift")):
        _table(t, name, x, groups)
    eps = float(norm.eps)
    stream, out = residual_layer_norm(x, branch, gate, norm.weight, norm.bias, scale, shift, second, third, eps)
    return (x if branch is None else stream), out
