"""Process-wide torch.compile settings for the DiT's compiled blocks, and what dynamo holds for them.

``WNMTransformer.compile_blocks`` compiles one function that every block shares; these helpers set the dynamo and
inductor options it depends on and read back how many graphs dynamo keeps for it.
"""

from __future__ import annotations

import functools

from .block import WNMTransformerBlock

# Dynamo keeps its compiled graphs per code object, so every compiled model in a process shares one budget of
# recompilations for ``WNMTransformerBlock.block_forward``: the rollout's graph (no grad), the update's (grad,
# checkpointed or not), the last block's (outputs of the target tokens only), a context with and without a mask,
# a new batch or context length (after which that size turns dynamic), and the FP8 rollout copy's graphs. That is
# more than dynamo's default of 8, and past the limit dynamo runs the block eagerly for every new variant with
# only a log warning: on an H100 the masked-context and FP8 forwards at batch 16 then took 756 and 1267 ms, their
# eager times, where the compiled bf16 forward took 522 ms (session 32, scripts/bench_modulation.py). 64 leaves room
# for all of them.
MIN_BLOCK_RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = MIN_BLOCK_RECOMPILE_LIMIT) -> None:
    """Raises dynamo's per-code-object recompile limit to at least ``limit`` (never lowers it)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * limit)


def compiled_block_graphs() -> tuple[int, int]:
    """``(graphs dynamo holds for WNMTransformerBlock.block_forward, dynamo's recompile limit)`` in this process.

    At the limit, every further variant of the block runs eagerly; the trainer reports both numbers so that a run
    which reaches it says so. ``_debug_get_cache_entry_list`` is private to dynamo, but it is the only per-function
    count of compiled graphs it offers.
    """
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(WNMTransformerBlock.block_forward.__code__)), dynamo_config.recompile_limit


def set_activation_memory_budget(budget: float | None) -> float:
    """Sets inductor's activation memory budget for what this process compiles next; returns the previous value.

    The budget is a process-wide setting of PyTorch's partitioner (``torch._functorch.config``), read when a
    compiled graph's backward is first built, i.e. at the first backward after :meth:`WNMTransformer.compile_blocks`,
    not at the ``compile_blocks`` call. A Ray actor worker compiles only its DiT, so it sets the budget and keeps
    it; a benchmark that compiles several variants in one process restores the returned value after each.

    Setting a budget also lets the partitioner weigh custom ops (``is_non_builtin_to_include``). Why: under a
    budget below 1 its most aggressive pass treats any op outside its own lists as free to recompute, and that
    includes our FlashAttention-4 op (``wnm::fa4_attention``), so every attention forward ran twice in training
    (H200 profile, session 40). With the flag the op joins the knapsack that trades recomputation time against
    memory, where its FLOP formula (``flash_attention4.py``) gives it its real cost. Our Triton kernels never appear
    in a training graph (they run without grad only), so the flag changes nothing else here.

    The same pass would recompute cuDNN's attention, the kernel PyTorch picks for our default backend on Hopper: the
    partitioner's list of compute-intensive ops names the flash and memory-efficient SDPA ops but not
    ``aten._scaled_dot_product_cudnn_attention`` (torch 2.11 to 2.13), and a built-in op does not get the flag's
    treatment. :func:`count_cudnn_attention_as_compute_intensive` adds it to that list.

    Args:
        budget: Fraction in (0, 1] of the activations to keep for the backward (the rest is recomputed); None
            leaves the current setting.

    Returns:
        The setting before the call.
    """
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    if budget is not None:
        functorch_config.activation_memory_budget = float(budget)
        functorch_config.is_non_builtin_to_include = True
        count_cudnn_attention_as_compute_intensive()
    return before


def count_cudnn_attention_as_compute_intensive() -> bool:
    """Adds cuDNN's SDPA op to the compute-intensive ops of PyTorch's min-cut partitioner, once per process.

    Why a wrapper around a private function: the list is built inside
    ``torch._functorch.partitioners.get_default_op_list`` with no setting to extend it, and an op outside it is
    treated as free to recompute by the partitioner under a memory budget; the partitioner looks the function up
    by its module name on every call, so wrapping it there is the narrowest change. A compute-intensive op is never
    recomputed for free: under a budget it enters the knapsack with its FLOPs (PyTorch's own cuDNN SDPA formula),
    as the flash and memory-efficient SDPA ops already do.

    Returns:
        True if cuDNN's op now counts (newly or from an earlier call); False if this torch lacks the op or the
        function, in which case nothing is changed.
    """
    import torch
    from torch._functorch import partitioners

    original = getattr(partitioners, "get_default_op_list", None)
    cudnn_attention = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    if original is None or cudnn_attention is None:
        return False
    if getattr(original, "counts_cudnn_attention", False):
        return True

    @functools.wraps(original)  # keeps PyTorch's function as __wrapped__
    def get_default_op_list():
        op_types = original()
        op_types.compute_intensive_ops.add(cudnn_attention)
        return op_types

    get_default_op_list.counts_cudnn_attention = True
    partitioners.get_default_op_list = get_default_op_list
    return True
