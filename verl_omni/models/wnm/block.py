"""The WNM transformer block: diffusers' Wan block with grouped (clean / noisy) modulation and a context mask.

The grouped modulation and gating helpers live here too, since only the block uses them; attention is in
``attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from . import residual_norm
from .attention import _cross_attention, _self_attention

# Eager inference with low-precision activations uses one addcmul per group in _modulate and _gate (see there);
# False restores the mul-then-add form, so that a benchmark can time both in one process.
LOW_PRECISION_ADDCMUL = True
# Eager inference with low-precision activations runs the block's LayerNorms on the activations in their own dtype
# (see _layer_norm); False restores the fp32 copy that diffusers' FP32LayerNorm makes, for the same benchmark.
LOW_PRECISION_NORM = True
# Compiled blocks pick each token's modulation row with torch.where (see _per_token); False restores the split and
# concatenate form that eager autograd runs, so that a benchmark can time both in one process.
COMPILED_GROUP_SELECT = True


def _slow_path() -> bool:
    """True where the grouped elementwise ops must be out-of-place: under autograd, or compiled (where inductor
    fuses them and the per-group writes into one output would only get in its way)."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling()


def _per_token(table: torch.Tensor, lengths: list[int], seq_len: int) -> torch.Tensor:
    """Each token's row of a per-group table: ``table [B, G, D]`` -> ``[B, S, D]`` (token s takes the row of the
    group it falls in, groups of ``lengths`` consecutive tokens).

    Written as one ``torch.where`` per group boundary on a token position so that, compiled, the selection is
    index arithmetic inside whatever kernel consumes it. The split-and-concatenate form that eager autograd uses
    made inductor write the LayerNorm's output and apply the modulation in a second kernel on the GPU (H100
    profile, session 33: two kernels per modulated norm where compiled diffusers has one). With this form each
    modulated norm is one kernel, and the compiled Wan-1.3B forward at batch 16 takes 491.7 ms against 507.7 ms
    with split/concatenate (H100, session 34, ``scripts/bench_modulation.py``).
    """
    pos = torch.arange(seq_len, device=table.device).view(1, -1, 1)
    rows = table[:, :1]
    start = 0
    for g in range(1, len(lengths)):
        start += lengths[g - 1]
        rows = torch.where(pos >= start, table[:, g : g + 1], rows)
    return rows


def _layer_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x.float())``: diffusers' ``FP32LayerNorm`` of the residual stream ``x [B, S, D]``, or the same
    normalisation stored in ``x``'s dtype in eager low-precision inference.

    Why: ``FP32LayerNorm`` first writes an fp32 copy of ``x`` and then an fp32 result that the modulation reads
    back, three full fp32 passes over ``[B, S, D]`` per norm that the eager bf16 forward spends on memory
    traffic alone (measured in ``scripts/bench_modulation.py``). PyTorch's LayerNorm kernel already reads bf16,
    accumulates mean and variance in fp32 and normalises in fp32, so the fast form is the same arithmetic with one
    extra rounding of the normalised value to bf16 before the modulation, well inside bf16 tolerance. The fp32
    path, autograd (training keeps diffusers' numerics) and inductor (which fuses the fp32 form anyway) are
    untouched.

    Returns:
        ``[B, S, D]``: fp32, or ``x``'s dtype on the eager low-precision path.
    """
    fast = (
        LOW_PRECISION_NORM
        and x.dtype != torch.float32
        and isinstance(norm, torch.nn.LayerNorm)
        and (norm.weight is None or norm.weight.dtype == x.dtype)
        and not _slow_path()
    )
    if fast:
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return norm(x.float())


def _modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, lengths: list[int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``(x * (1 + scale) + shift).to(dtype)`` with one (scale, shift) per token group.

    Args:
        x: ``[B, S, D]`` normed activations: fp32, or the activation dtype from :func:`_layer_norm`'s fast path.
        scale: ``[B, G, D]`` fp32 (``G = 1`` without ``lengths``).
        shift: ``[B, G, D]`` fp32.
        lengths: The G consecutive group lengths along the sequence, or None for a single group.
        dtype: Output dtype (the activation dtype).

    Returns:
        ``[B, S, D]`` in ``dtype``.
    """
    if lengths is None:
        return (x * (1 + scale) + shift).to(dtype)
    if COMPILED_GROUP_SELECT and torch.compiler.is_compiling():  # same arithmetic, fusable (see _per_token)
        seq_len = x.shape[1]
        return (x * (1 + _per_token(scale, lengths, seq_len)) + _per_token(shift, lengths, seq_len)).to(dtype)
    if _slow_path():
        parts = x.split(lengths, dim=1)
        return torch.cat([p * (1 + scale[:, g : g + 1]) + shift[:, g : g + 1] for g, p in enumerate(parts)], 1).to(
            dtype
        )
    # Inference, eager: each group writes its slice of one output, and the add writes the activation dtype
    # directly (computed in fp32, rounded once on store), so neither a concatenated fp32 copy nor a separate
    # cast pass exists. Same operations in the same order as above, hence the same bits.
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if dtype != torch.float32 and LOW_PRECISION_ADDCMUL:
        # Low-precision activations: one addcmul per group (shift + x * (1 + scale), computed in fp32 and rounded
        # once on store) instead of a mul into an fp32 temporary and an add that reads it back. The GPU may fuse
        # the multiply-add (one rounding fewer in fp32), which the bf16 store rounds away; the fp32 path below
        # keeps its exact operation order and bits.
        start = 0
        for g, n in enumerate(lengths):
            torch.addcmul(shift[:, g : g + 1], x[:, start : start + n], 1 + scale[:, g : g + 1],
                          out=out[:, start : start + n])  # fmt: skip
            start += n
        return out
    tmp = torch.empty(x[:, : max(lengths)].shape, dtype=torch.promote_types(x.dtype, scale.dtype), device=x.device)
    start = 0
    for g, n in enumerate(lengths):
        t = tmp[:, :n]
        torch.mul(x[:, start : start + n], 1 + scale[:, g : g + 1], out=t)
        torch.add(t, shift[:, g : g + 1], out=out[:, start : start + n])
        start += n
    return out


def _gate(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, lengths: list[int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``(x.float() + y * gate).to(dtype)`` with one gate per token group (see :func:`_modulate`).

    Args:
        x: ``[B, S, D]`` residual stream (any float dtype; added in fp32).
        y: ``[B, S, D]`` branch output.
        gate: ``[B, G, D]`` fp32.
        lengths: Group lengths, or None for a single group.
        dtype: Output dtype.
    """
    if lengths is None:
        return (x.float() + y * gate).to(dtype)
    if COMPILED_GROUP_SELECT and torch.compiler.is_compiling():  # same arithmetic, fusable (see _per_token)
        return (x.float() + y * _per_token(gate, lengths, y.shape[1])).to(dtype)
    if _slow_path():
        parts = y.split(lengths, dim=1)
        return (x.float() + torch.cat([p * gate[:, g : g + 1] for g, p in enumerate(parts)], dim=1)).to(dtype)
    # Inference, eager: the residual is read in its own dtype and widened inside the add (no fp32 copy of x),
    # and the sum is stored in ``dtype`` directly. fp32 addition commutes, so the bits are those of the form above.
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if dtype != torch.float32 and LOW_PRECISION_ADDCMUL:
        # As in _modulate: one addcmul per group (x + y * gate in fp32, rounded once on store to ``dtype``).
        start = 0
        for g, n in enumerate(lengths):
            torch.addcmul(x[:, start : start + n], y[:, start : start + n], gate[:, g : g + 1],
                          out=out[:, start : start + n])  # fmt: skip
            start += n
        return out
    tmp = torch.empty(y[:, : max(lengths)].shape, dtype=torch.promote_types(y.dtype, gate.dtype), device=y.device)
    start = 0
    for g, n in enumerate(lengths):
        t = tmp[:, :n]
        torch.mul(y[:, start : start + n], gate[:, g : g + 1], out=t)
        torch.add(t, x[:, start : start + n], out=out[:, start : start + n])
        start += n
    return out


def _feed_forward(ffn: torch.nn.Module, x: torch.Tensor, epilogue: bool = True) -> torch.Tensor:
    """``ffn(x)``: diffusers' ``FeedForward`` (tanh GELU) of ``x [B, S, D]``, with the GELU in the GEMM on CUDA.

    Why: the feed-forward's hidden activation ``[B, S, ffn_dim]`` is the block's widest tensor (5.8x the model
    width at Wan sizes). As a GEMM followed by a GELU kernel it is written, read and written again; inductor cannot
    fuse a pointwise op into cuBLAS's GEMM. ``torch._addmm_activation(..., use_gelu=True)`` has cuBLASLt apply the
    bias and the tanh GELU in the GEMM's epilogue, on the fp32 accumulator, so the activation is stored once, with
    one bf16 rounding fewer than the two-kernel form. Inductor keeps the op as an ATen call, so compiled blocks get
    it too.

    Only where it computes the same function: inference (the op has no autograd formula, so training keeps the
    two-kernel form), CUDA (PyTorch's CPU kernel computes the exact GELU instead of the tanh form), a plain
    ``nn.Linear`` whose weight shares ``x``'s low-precision dtype (not the FP8 copy's ``Float8Linear``, not
    autocast), and a GELU module with ``approximate="tanh"``. Everything else, and ``epilogue=False``, runs
    ``ffn(x)`` unchanged.

    Returns:
        ``[B, S, D]`` in ``x``'s dtype.
    """
    act = ffn.net[0]
    proj = getattr(act, "proj", None)
    fused = (
        epilogue
        and not torch.is_grad_enabled()
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and type(proj) is torch.nn.Linear
        and proj.bias is not None
        and proj.weight.dtype == x.dtype
        and getattr(act, "approximate", None) == "tanh"
    )
    if not fused:
        return ffn(x)
    hidden = torch._addmm_activation(proj.bias, x.flatten(0, -2), proj.weight.t(), use_gelu=True)
    hidden = hidden.unflatten(0, x.shape[:-1])
    for layer in ffn.net[1:]:  # dropout (identity at inference), the output projection
        hidden = layer(hidden)
    return hidden


def _add_and_norm(
    norm: torch.nn.Module,
    x: torch.Tensor,
    branch: torch.Tensor | None,
    gate: torch.Tensor | None,
    lengths: list[int] | None,
    modulation: tuple[torch.Tensor, torch.Tensor] | None,
    stream_dtype: torch.dtype,
    kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A branch joins the residual stream and the stream is normalised: ``(stream, normed)``, each ``[B, S, D]``.

    ``stream`` is ``x`` plus ``branch`` (through the per-group ``gate`` when given; ``x`` itself without a branch)
    in ``stream_dtype``; ``normed`` is ``norm(stream)``, modulated by ``modulation = (scale, shift)`` when given, in
    the stream's dtype. Where the fused kernel applies (``kernel``, CUDA, bf16/fp16, no grad; see
    ``residual_norm.applies``) it computes both in one pass over the rows; otherwise the composite form below, whose
    fp32 and autograd bits are those of the block before the kernel.
    """
    fused = (
        kernel
        and stream_dtype == x.dtype
        and (branch is None or (branch.dtype == x.dtype and branch.stride(-1) == 1))
        and residual_norm.applies(x, norm, lengths)
    )
    if fused:
        scale, shift = modulation if modulation is not None else (None, None)
        return residual_norm.fused_residual_layer_norm(norm, x, branch, gate, lengths, scale, shift)
    if branch is None:
        stream = x
    elif gate is None:
        stream = x + branch
    else:
        stream = _gate(x, branch, gate, lengths, stream_dtype)
    if modulation is None:
        return stream, _layer_norm(norm, stream).type_as(stream)
    return stream, _modulate(_layer_norm(norm, stream), modulation[0], modulation[1], lengths, stream.dtype)


def _groups_from(lengths: list[int] | None, start: int, seq_len: int) -> tuple[list[int] | None, int]:
    """The modulation groups of tokens ``start:`` of a sequence of ``seq_len`` tokens.

    Args:
        lengths: Group lengths summing to ``seq_len``, or None (one group for all tokens).
        start: First kept token; with ``lengths`` it must be where a group begins.

    Returns:
        ``(kept lengths or None, index of the first kept group)``.
    """
    if not 0 <= start < seq_len:
        raise ValueError(f"outputs_from must be in [0, {seq_len}) for a sequence of {seq_len} tokens, got {start}")
    if lengths is None or start == 0:
        return lengths, 0
    boundaries = [sum(lengths[:g]) for g in range(len(lengths))]
    if start not in boundaries:
        raise ValueError(f"outputs_from={start} must fall where a modulation group begins ({boundaries})")
    first = boundaries.index(start)
    return lengths[first:], first


class PendingResidual:
    """A block's feed-forward output and gate not yet added to the residual stream (see ``defer_residual``).

    Attributes:
        branch: ``[B, S, D]`` the feed-forward output, in the activation dtype.
        gate: ``[B, G, D]`` fp32, one row per modulation group.

    A plain class rather than a tuple or a dataclass on purpose: FSDP2's mixed precision casts every floating
    tensor it finds in a module's inputs, looking through tuples, lists, dicts and dataclasses, to the compute
    dtype. That would round the fp32 gate to bf16 on its way into the next block, a rounding the in-block add never
    had; other objects it passes on as they are.
    """

    def __init__(self, branch: torch.Tensor, gate: torch.Tensor) -> None:
        self.branch = branch
        self.gate = gate


class WNMTransformerBlock(WanTransformerBlock):
    """diffusers' ``WanTransformerBlock`` (same modules and keys) with grouped modulation and a context mask.

    The parent's forward takes either one modulation per sample or a full ``[B, S, 6, D]`` per-token table,
    and never masks cross-attention. We need two modulation groups (clean history, noisy target + actions) and
    a padding mask over the context tokens, so the forward is re-stated here with the parent's numerics (fp32
    norms and modulation, rounded to the activation dtype); a test checks equality with the parent.

    Where the time goes, and why it is written this way: at Wan-1.3B size the block's matmuls and attention
    are a fixed cost shared with diffusers, and the rest is memory-bound elementwise work over ``[B, S, D]``
    fp32 tensors (one pass is about 0.5 GB at batch 16). In eager inference the grouped modulation and gating
    write straight into their output's slices in the activation dtype (:func:`_modulate`, :func:`_gate`)
    instead of splitting, concatenating and casting; compiled, inductor fuses either form.
    """

    # Activation checkpointing happens inside the block's forward, i.e. inside FSDP2's per-block hooks, so the
    # recomputation sees the same (already cast, already gathered) inputs as the first pass.
    activation_checkpointing = False
    # Attention kernel family (ATTENTION_BACKENDS); set for all blocks through WNMTransformer.attention_backend.
    attention_backend = "default"
    # Inference on CUDA puts the feed-forward's GELU into its first GEMM (_feed_forward); set for all blocks
    # through WNMTransformer.gelu_epilogue (rollout.gelu_epilogue in the trainer).
    gelu_epilogue = True
    # Inference on CUDA computes self-attention's q/k RMS norm and RoPE in one Triton kernel (rms_norm_rope.py);
    # set for all blocks through WNMTransformer.norm_rope_kernel.
    norm_rope_kernel = True
    # Inference on CUDA adds each branch to the residual stream and computes the LayerNorm after it in one Triton
    # kernel (residual_norm.py); set for all blocks through WNMTransformer.residual_norm_kernel.
    residual_norm_kernel = True

    def forward(self, *args, **kwargs):  # type: ignore[override]
        """Runs :meth:`block_forward`, under activation checkpointing when it is on and grad is enabled."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.block_forward, *args, use_reentrant=False, **kwargs)
        return self.block_forward(*args, **kwargs)

    def block_forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        encoder_attention_mask: torch.Tensor | None = None,
        group_lengths: list[int] | None = None,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_kv: bool = False,
        *,
        outputs_from: int = 0,
        pending: PendingResidual | None = None,
        defer_residual: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Runs the block.

        Args:
            hidden_states: ``[B, S, D]``.
            encoder_hidden_states: ``[B, L, D]``.
            temb: ``[B, 6, D]`` (one group) or ``[B, G, 6, D]`` with ``group_lengths`` summing to S.
            rotary_emb: ``(cos, sin)`` each ``[1, S, 1, head_dim]``.
            encoder_attention_mask: ``[B, L]`` bool (True = attend) or None.
            group_lengths: Token counts of the G modulation groups, or None for ``temb [B, 6, D]``.
            prefix_kv: Keys/values ``[B, P, heads, head_dim]`` that self-attention sees before this sequence's
                own (the history of an ``isolated`` model); the P prefix tokens are not updated.
            return_kv: Also return this sequence's own self-attention ``(key, value)``.
            outputs_from: Return only tokens ``outputs_from:`` (0 = all). Every token still gives its key and
                value to self-attention, but the others ask no query and skip the cross-attention and the
                feed-forward: the last block's history outputs are never read, and they are about half its tokens.
                With ``group_lengths`` it must fall on a group boundary.
            pending: The previous block's feed-forward output and gate (its ``defer_residual`` result), added to
                ``hidden_states`` here before the first norm.
            defer_residual: Return the feed-forward output and its gate instead of adding them to the residual
                stream, for the next block's ``pending``. Why: the gated residual add that ends a block and the
                LayerNorm that starts the next were two passes over the rows, the second reading back what the
                first had just written. Moved into the next block, its add + norm kernel (``residual_norm.py``)
                reads the stream and the branch once and writes the sum and the normed row. The same operations in the
                same order, so eager and fp32 results keep their bits. ``WNMTransformer`` defers in inference with
                the add + norm kernel on, whose kernel then does the add.

        Returns:
            ``[B, S', D]`` with ``S' = S - outputs_from``; ``([B, S', D], (key, value))`` with ``return_kv`` (keys
            and values of all S tokens); ``([B, S, D], (ff_output [B, S, D], gate [B, G, D]))`` with
            ``defer_residual``, the stream before this block's feed-forward residual (the caller wraps the pair in a
            :class:`PendingResidual` for the next block; a compiled block returns plain tensors).
        """
        if defer_residual and (return_kv or outputs_from):
            raise ValueError(
                "defer_residual returns the block's pending residual; it excludes return_kv and outputs_from"
            )
        if temb.ndim == 4:
            if group_lengths is None or len(group_lengths) != temb.shape[1]:
                raise ValueError("grouped temb [B, G, 6, D] needs group_lengths with G entries")
            mods = (self.scale_shift_table.unsqueeze(0) + temb.float()).unbind(dim=2)  # 6 x [B, G, D]
        else:
            mods = (self.scale_shift_table + temb.float()).unbind(dim=1)  # 6 x [B, D]
            mods = tuple(m.unsqueeze(1) for m in mods)
            group_lengths = None
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods
        kernel, backend = self.residual_norm_kernel, self.attention_backend
        # The previous block's feed-forward residual (its defer_residual), added where the norm reads the stream.
        branch, gate = (None, None) if pending is None else (pending.branch, pending.gate)
        hidden_states, normed = _add_and_norm(
            self.norm1, hidden_states, branch, gate, group_lengths, (scale_msa, shift_msa),
            encoder_hidden_states.dtype, kernel,
        )  # fmt: skip
        dtype = hidden_states.dtype
        # The tokens whose outputs are returned, and their modulation groups (the leading groups dropped).
        kept_lengths, first_group = _groups_from(group_lengths, outputs_from, hidden_states.shape[1])
        gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            m[:, first_group:] for m in (gate_msa, c_shift_msa, c_scale_msa, c_gate_msa)
        )

        # 1. Self-attention over the joint sequence (queries from the returned tokens only).
        attn_output, kv = _self_attention(
            self.attn1, normed, rotary_emb, prefix_kv, backend, outputs_from, self.norm_rope_kernel
        )
        if outputs_from:
            hidden_states = hidden_states[:, outputs_from:]
        hidden_states, normed = _add_and_norm(
            self.norm2, hidden_states, attn_output, gate_msa, kept_lengths, None, dtype, kernel
        )

        # 2. Cross-attention to the context; the mask broadcasts over heads and queries.
        mask = None if encoder_attention_mask is None else encoder_attention_mask[:, None, None, :]
        cross_output = _cross_attention(self.attn2, normed, encoder_hidden_states, mask, backend)
        hidden_states, normed = _add_and_norm(
            self.norm3, hidden_states, cross_output, None, kept_lengths, (c_scale_msa, c_shift_msa), dtype, kernel
        )

        # 3. Feed-forward.
        ff_output = _feed_forward(self.ffn, normed, self.gelu_epilogue)
        if defer_residual:
            return hidden_states, (ff_output, c_gate_msa)
        hidden_states = _gate(hidden_states, ff_output, c_gate_msa, kept_lengths, encoder_hidden_states.dtype)
        return (hidden_states, kv) if return_kv else hidden_states


def run_blocks(
    blocks: torch.nn.ModuleList,
    x: torch.Tensor,
    block_args: tuple,
    prefixes: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
    last_outputs_from: int = 0,
    defer: bool = False,
) -> torch.Tensor:
    """Runs ``blocks`` in order over ``x [B, S, D]``.

    Args:
        blocks: The model's :class:`WNMTransformerBlock` s.
        x: ``[B, S, D]`` input tokens.
        block_args: ``(context, temb, rotary_emb, context_mask, group_lengths)`` for every block.
        prefixes: Per block, the history keys/values it attends to (``isolated`` models), or None.
        last_outputs_from: The last block returns tokens ``last_outputs_from:`` only (0 = all).
        defer: Each block but the last leaves its feed-forward residual to the next (``defer_residual``, passed on
            as a :class:`PendingResidual`), whose first add + norm does the add.

    Returns:
        ``[B, S', D]``, the last block's output.
    """
    if prefixes is not None and len(prefixes) != len(blocks):
        raise ValueError(f"history keys/values for {len(prefixes)} blocks, but the model has {len(blocks)}")
    last = len(blocks) - 1
    pending = None
    for i, block in enumerate(blocks):
        prefix = None if prefixes is None else prefixes[i]
        kwargs = {} if pending is None else {"pending": pending}
        if i == last:
            x = block(x, *block_args, prefix, outputs_from=last_outputs_from, **kwargs)
        elif defer:
            x, (branch, gate) = block(x, *block_args, prefix, defer_residual=True, **kwargs)
            pending = PendingResidual(branch, gate)
        else:
            x = block(x, *block_args, prefix, **kwargs)
    return x
