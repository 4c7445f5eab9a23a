"""Attention of the WNM transformer blocks: Wan's RoPE, the scaled-dot-product backends, self/cross-attention.

These restate diffusers' ``WanAttnProcessor`` (same projections, q/k RMS norms, RoPE and attention call, so the
same numerics) with two additions the joint model needs: self-attention can attend to cached prefix keys/values
(the history of an ``isolated`` model), and the kernel family is selectable (:data:`ATTENTION_BACKENDS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rms_norm_rope


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs: ``x [B, S, H, Dh]``, ``cos/sin [1, S, 1, Dh]`` -> ``x``'s
    shape, dtype and layout.

    Why written into ``empty_like(x)`` (diffusers' form) rather than stacked: the same arithmetic (fp32 products
    rounded once to ``x``'s dtype on store; the same bits, CPU test), but the result has ``x``'s layout. A stacked
    result is a fresh pointwise value with no layout of its own, and by our reading of inductor's attention-input
    constraint (``sdpa_constraint``) it is then laid out ``[B, H, S, Dh]`` contiguous, while the values (a GEMM's
    output) stay ``[B, S, H, Dh]``. cuDNN returns its output in the query's layout, so the output projection would
    need a transposing copy first. The H100 profile of the stacked form (session 33) shows such a copy of every
    self-attention output, 0.2 ms a block at Wan-1.3B batch 16, which compiled diffusers does not have. With this
    form the copy is gone from the profile (session 34, H100; ``scripts/inspect_block_kernels.py`` shows the same on
    CPU), but the forward is no faster within the benchmark's spread, and cuDNN's attention kernel takes as long as
    before: the layout was not why our attention is slower than diffusers'. Kept because it matches diffusers'
    processor and removes a kernel at no cost.
    """
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def _qk_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (the q/k RMS norm of ``x [B, S, D]``), in ``x``'s dtype.

    Why the cast: under autocast the projections hand bfloat16 activations to norms whose weights stay float32,
    and PyTorch runs its fused RMSNorm kernel only when input and weight share a dtype; otherwise it composes the
    norm from about six operators forward and more backward (it warns "Cannot dispatch to fused
    implementation"), for each of the four norms of every block. Casting ``x`` to the weight's dtype keeps the
    fused kernel; the result is cast back, so what follows sees the dtype it saw before. Outside autocast (or
    with equal dtypes) this is ``norm(x)`` exactly.
    """
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dtype == x.dtype or not torch.is_autocast_enabled(x.device.type):
        return norm(x)
    return norm(x.to(weight.dtype)).to(x.dtype)


# Scaled-dot-product attention backends. "default": PyTorch's own choice, which is what diffusers' native dispatch
# gets; with torch 2.11 on an H100 that is already cuDNN's fused kernel for our unmasked bf16 calls (1.6-1.7x
# flash attention 2's forward at the Wan-1.3B shapes; scripts/bench_attention.py). "cudnn": forces cuDNN's kernel
# where it applies (CUDA, bf16/fp16, no mask), for a torch whose own choice differs; other calls keep the default.
# "fa4": FlashAttention-4's kernels (optional package, flash_attention4.py) where they apply (CUDA, bf16/fp16, no
# mask); other calls, and every call on CPU, keep the default.
ATTENTION_BACKENDS = ("default", "cudnn", "fa4")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, backend: str):
    """Attention of ``q [B, S, H, Dh]`` over ``k, v [B, L, H, Dh]`` -> ``[B, S, H * Dh]`` (q's dtype).

    ``mask``: ``[B, 1, 1, L]`` bool (True = attend) or None. Same call as diffusers' native dispatch (heads
    moved to dim 1 as strided views, no copies); ``backend`` picks the kernel family (:data:`ATTENTION_BACKENDS`).
    """
    fused_ok = mask is None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if backend == "fa4" and fused_ok:
        from .flash_attention4 import fa4_attention

        return fa4_attention(q, k, v).flatten(2, 3)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if backend == "cudnn" and fused_ok:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).flatten(2, 3).type_as(q)


def _self_attention(
    attn,
    x: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    prefix_kv,
    backend: str,
    queries_from: int = 0,
    fused_norm_rope: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Wan self-attention whose keys/values are ``prefix_kv`` (if given) followed by ``x``'s own.

    The same projections, q/k RMS norms, RoPE and attention call as diffusers' ``WanAttnProcessor``; it also
    returns ``x``'s own (roped) keys and values so that a later call can attend to them.

    Args:
        queries_from: Only tokens ``queries_from:`` of ``x`` ask queries (every token still gives its key and
            value), for a block whose first outputs nobody reads (the last block's history tokens).
        fused_norm_rope: Where it applies (CUDA, bf16/fp16, no grad; ``rms_norm_rope.applies``), compute each of
            q and k's norm and RoPE in one Triton kernel (``rms_norm_rope.py``): the same arithmetic to bf16
            rounding, one read and one write of q and k.

    Returns:
        ``(output [B, S - queries_from, D], (key, value) [B, S, heads, head_dim])``.
    """
    xq = x if queries_from == 0 else x[:, queries_from:]
    q_rope = rotary_emb if queries_from == 0 else tuple(r[:, queries_from:] for r in rotary_emb)
    q, k = attn.to_q(xq), attn.to_k(x)
    if (
        fused_norm_rope
        and rms_norm_rope.applies(q, attn.norm_q.weight)
        and rms_norm_rope.applies(k, attn.norm_k.weight)
    ):
        q = rms_norm_rope.fused_rms_norm_rope(attn.norm_q, q, q_rope, attn.heads)
        k = rms_norm_rope.fused_rms_norm_rope(attn.norm_k, k, rotary_emb, attn.heads)
    else:
        q = _apply_rope(_qk_norm(attn.norm_q, q).unflatten(2, (attn.heads, -1)), *q_rope)
        k = _apply_rope(_qk_norm(attn.norm_k, k).unflatten(2, (attn.heads, -1)), *rotary_emb)
    v = attn.to_v(x).unflatten(2, (attn.heads, -1))
    keys, values = (k, v) if prefix_kv is None else (torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1))
    out = _attention(q, keys, values, None, backend)
    return attn.to_out[1](attn.to_out[0](out)), (k, v)


def _cross_attention(attn, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None, backend: str):
    """Wan cross-attention (``WanAttnProcessor`` without the I2V image branch): ``x [B, S, D]`` over
    ``context [B, L, D]`` with ``mask [B, 1, 1, L]`` or None -> ``[B, S, D]``."""
    q = _qk_norm(attn.norm_q, attn.to_q(x)).unflatten(2, (attn.heads, -1))
    k = _qk_norm(attn.norm_k, attn.to_k(context)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(context).unflatten(2, (attn.heads, -1))
    return attn.to_out[1](attn.to_out[0](_attention(q, k, v, mask, backend)))
