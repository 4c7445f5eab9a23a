"""FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL kernels for Hopper and Blackwell) as a PyTorch op.

Why our own op and not PyTorch's registry (``torch.nn.attention.activate_flash_attention_impl("FA4")``): torch
2.11's adapter unpacks two values from ``flash_attn.cute.interface._flash_attn_fwd``, which returns five in every
``flash-attn-4`` release we could install (4.0.0b36, b40), so each call fails. The adapter also moves the heads
to dimension 1 and copies the output back to that layout, while FlashAttention's own layout, ``[B, S, H, Dh]``, is
the one our projections already produce: called here, no tensor is copied on the way in or out.

``wnm::fa4_attention`` is a ``torch.library`` custom op with a fake (shape) implementation and an autograd
formula, so ``torch.compile`` keeps it as one opaque kernel call in the graph (fullgraph included) and the backward
runs FlashAttention-4's backward kernel. The package is imported on the first call only, so importing this module
costs nothing where it is not installed.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

FA4_INSTALL_HINT = (
    "attention_backend 'fa4' needs FlashAttention-4 on a Hopper or Blackwell GPU: pip install flash-attn-4 "
    "'nvidia-cutlass-dsl[cu13]' (the cu13 extra for a CUDA 13 torch)"
)


def fa4_available() -> bool:
    """Whether FlashAttention-4's interface (``flash_attn.cute.interface``) imports (see :func:`fa4_import_problem`)."""
    return fa4_import_problem() is None


def fa4_import_problem() -> str | None:
    """Why FlashAttention-4's interface does not import here, or None when it does.

    A real import, not a lookup: the package can be found while its CuTe DSL dependency (the ``cutlass`` module of
    ``nvidia-cutlass-dsl``) is missing or only partly installed, which fails only at import (seen on the device with
    ``pip install --target``).

    Returns:
        The install hint, the import error and, when the failing module is ``cutlass``, which wheels make it up.
    """
    try:
        _interface()
    except ImportError as e:
        return str(e)
    return None


def _interface():
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise ImportError(f"{FA4_INSTALL_HINT}; import failed with: {e}{_partial_cutlass_hint(e)}") from e
    except Exception as e:  # a native library that fails to load (OSError and the like) is a failed import too
        raise ImportError(f"{FA4_INSTALL_HINT}; import failed with {type(e).__name__}: {e}") from e
    return interface


def _partial_cutlass_hint(error: ImportError) -> str:
    # nvidia-cutlass-dsl 4.8 spreads its ``cutlass`` module over several wheels that fill one nvidia_cutlass_dsl/
    # folder. An install without the resolver (--no-deps, offline wheel sets) can miss one, and
    # ``pip install --target --upgrade`` of one wheel replaces the folder the others filled. Either leaves a
    # ``cutlass`` that imports in part, whose error ("No module named 'cutlass.cute'") does not say which wheel.
    if (error.name or "").split(".")[0] != "cutlass":
        return ""
    return (
        ". The 'cutlass' module of nvidia-cutlass-dsl is missing or incomplete: its Python is in "
        "nvidia-cutlass-dsl-libs-core, its MLIR bindings in nvidia-cutlass-dsl-libs-base and -libs-cu13 (or -cu12), "
        "all in one nvidia_cutlass_dsl folder. Install them in one pip call; a later `pip install --target "
        "--upgrade` of one of them replaces that folder"
    )


@torch.library.custom_op("wnm::fa4_attention", mutates_args=())
def fa4_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal, unmasked attention of ``q [B, S, H, Dh]`` over ``k, v [B, L, H, Dh]`` (bf16 or fp16, CUDA).

    Returns:
        ``(out [B, S, H, Dh] in q's dtype, lse [B, H, S] float32)``: the output and each query's log-sum-exp
        of its scaled scores (what the backward needs).
    """
    # The kernel needs dense inputs. The block's q/k/v (projection outputs viewed as heads) already are, so these
    # calls copy nothing there; a caller with strided inputs pays one copy each.
    out, lse, *_ = _interface()._flash_attn_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale=softmax_scale, causal=False, return_lse=True
    )
    return out, lse


@fa4_attention_with_lse.register_fake
def _fa4_attention_fake(q, k, v, softmax_scale):
    b, s, h, _ = q.shape
    return q.new_empty(b, s, h, v.shape[-1]), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("wnm::fa4_attention_backward", mutates_args=())
def fa4_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`fa4_attention_with_lse`'s output, shaped like ``q, k, v``.

    The backward kernel accumulates dq with atomics, so its bits can change from run to run, like cuDNN's attention
    backward. Under ``torch.use_deterministic_algorithms(..., warn_only=True)`` (``trainer.deterministic``) this
    warns, as PyTorch does for cuDNN. FlashAttention-4 also has a deterministic backward; it is not used because it
    has not been measured here.
    """
    if torch.are_deterministic_algorithms_enabled():
        warnings.warn(
            "wnm::fa4_attention_backward (FlashAttention-4) does not have a deterministic implementation in use: its "
            "gradients may differ in the last bits between runs",
            stacklevel=2,
        )
    dq, dk, dv = _interface()._flash_attn_bwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        grad_out.contiguous(),
        lse.contiguous(),
        softmax_scale=softmax_scale,
        causal=False,
    )[:3]
    return dq, dk, dv


@fa4_attention_backward.register_fake
def _fa4_attention_backward_fake(grad_out, q, k, v, out, lse, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale


def _backward(ctx, grad_out, grad_lse):
    # The log-sum-exp is an auxiliary output our callers never differentiate; its gradient is ignored.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = fa4_attention_backward(grad_out, q, k, v, out, lse, ctx.softmax_scale)
    return dq, dk, dv, None


fa4_attention_with_lse.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [B, S, H, Dh]`` over ``k, v [B, L, H, Dh]`` -> ``[B, S, H, Dh]``, scale ``1/sqrt(Dh)``
    (``F.scaled_dot_product_attention``'s default), by FlashAttention-4."""
    return fa4_attention_with_lse(q, k, v, 1.0 / math.sqrt(q.shape[-1]))[0]


def _heads_first(shape) -> tuple[int, int, int, int]:
    """``[B, S, H, Dh]`` (FlashAttention's layout) -> ``[B, H, S, Dh]`` (the layout PyTorch's SDPA counts take)."""
    b, s, h, d = shape
    return b, h, s, d


# FLOP formulas, so that torch.utils.flop_counter counts these ops as it counts PyTorch's own attention kernels.
# Why it matters beyond reports: under an activation memory budget (actor.activation_memory_budget), inductor's
# partitioner weighs each candidate for recomputation by its FLOPs (torch._functorch.partitioners.estimate_runtime,
# the "flops" estimator), and an op without a formula counts as 1 FLOP, i.e. free to recompute. The H200 profile of
# the training step with fa4 (session 40) shows it: every attention forward ran twice, the second time in backward
# (238 forward calls for 120 attention calls, about 0.24 s of a 3.9 s step at a budget of 0.05).
@register_flop_formula(torch.ops.wnm.fa4_attention)
def _fa4_attention_flops(q_shape, k_shape, v_shape, softmax_scale, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_heads_first(q_shape), _heads_first(k_shape), _heads_first(v_shape))


@register_flop_formula(torch.ops.wnm.fa4_attention_backward)
def _fa4_attention_backward_flops(
    grad_out_shape, q_shape, k_shape, v_shape, out_value_shape, lse_shape, softmax_scale, *args, out_shape=None, **kw
) -> int:
    return sdpa_backward_flop_count(
        _heads_first(grad_out_shape), _heads_first(q_shape), _heads_first(k_shape), _heads_first(v_shape)
    )
