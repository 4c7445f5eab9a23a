"""Process-wide compile settings of the DiT's compiled blocks (``verl_omni.models.wnm.compilation``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm.compilation import compiled_block_graphs


def test_activation_memory_budget_sets_pytorchs_partitioner_setting_returns_the_old_one_and_null_leaves_it():
    import torch._functorch.config as functorch_config

    from verl_omni.models.wnm.compilation import set_activation_memory_budget

    before, custom_before = functorch_config.activation_memory_budget, functorch_config.is_non_builtin_to_include
    try:
        functorch_config.is_non_builtin_to_include = False
        assert set_activation_memory_budget(None) == before
        assert functorch_config.activation_memory_budget == before
        assert not functorch_config.is_non_builtin_to_include  # None touches nothing
        assert set_activation_memory_budget(0.2) == before
        assert functorch_config.activation_memory_budget == 0.2
        assert functorch_config.is_non_builtin_to_include  # custom ops are weighed by the budget's knapsack
        assert set_activation_memory_budget(before) == 0.2  # how a caller compiling several variants restores it
        assert functorch_config.activation_memory_budget == before
    finally:
        functorch_config.activation_memory_budget = before
        functorch_config.is_non_builtin_to_include = custom_before


def test_a_memory_budget_counts_cudnn_attention_as_compute_intensive_once(monkeypatch):
    import torch._functorch.config as functorch_config
    from torch._functorch import partitioners

    from verl_omni.models.wnm import compilation

    # PyTorch's own function (an earlier test in this process may have set a budget already), restored after.
    own = partitioners.get_default_op_list
    monkeypatch.setattr(partitioners, "get_default_op_list", getattr(own, "__wrapped__", own))
    # Not monkeypatch for PyTorch's config module: pytest's undo deletes an attribute it did not find in the
    # instance __dict__, and deleting a torch config entry hides it for the rest of the process. Its own patch()
    # restores the values.
    with functorch_config.patch(
        activation_memory_budget=functorch_config.activation_memory_budget,
        is_non_builtin_to_include=functorch_config.is_non_builtin_to_include,
    ):
        _check_cudnn_attention_counts_once(partitioners, compilation, own)


def _check_cudnn_attention_counts_once(partitioners, compilation, own):
    aten = torch.ops.aten
    cudnn = SimpleNamespace(target=aten._scaled_dot_product_cudnn_attention.default)
    flash = SimpleNamespace(target=aten._scaled_dot_product_flash_attention.default)
    mm, add = SimpleNamespace(target=aten.mm.default), SimpleNamespace(target=aten.add.Tensor)
    # PyTorch's own list: flash SDPA and mm are compute-intensive, cuDNN's SDPA is not (the gap being closed).
    ops = partitioners.get_default_op_list()
    assert ops.is_compute_intensive(flash) and ops.is_compute_intensive(mm) and not ops.is_compute_intensive(cudnn)

    assert compilation.set_activation_memory_budget(None) is not None
    assert not partitioners.get_default_op_list().is_compute_intensive(cudnn)  # no budget, nothing changed
    compilation.set_activation_memory_budget(0.2)
    ops = partitioners.get_default_op_list()
    assert ops.is_compute_intensive(cudnn) and ops.is_compute_intensive(flash) and ops.is_compute_intensive(mm)
    assert not ops.is_compute_intensive(add) and ops.is_recomputable(add)  # the rest of the lists as they were
    wrapped = partitioners.get_default_op_list
    assert compilation.count_cudnn_attention_as_compute_intensive()
    assert partitioners.get_default_op_list is wrapped  # a second call wraps nothing again
    assert wrapped.__wrapped__ is getattr(own, "__wrapped__", own)


def test_compiled_blocks_keep_compiling_past_dynamos_default_recompile_limit(monkeypatch):
    """Every compiled model in a process shares ``block_forward``'s recompile budget (dynamo's default is 8);
    past it dynamo silently runs the block eagerly. Here 8 batch sizes x (the first block, which leaves its
    feed-forward residual to the next; the last block, which adds it) = 16 graphs."""
    import functools

    import torch._dynamo as dynamo
    import torch._dynamo.config as dynamo_config

    # dynamo's graph capture and guards are what is tested, so the cheap "eager" backend stands in for inductor.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    # fail_on_recompile_limit_hit: raise where dynamo would otherwise fall back to eager with a log warning.
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=256, fail_on_recompile_limit_hit=True):
        dynamo.reset()
        model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).eval()
        model.compile_blocks(dynamic=False)  # static shapes: each batch size is a new graph
        assert dynamo_config.recompile_limit == 64
        with torch.no_grad():
            for b in range(1, 9):
                v, _ = model(*random_dit_inputs(model.config, b=b))
                assert v.shape[0] == b
        assert compiled_block_graphs() == (16, 64)  # what the trainer reports as compile/block_graphs
    dynamo.reset()


def test_raise_recompile_limit_never_lowers_it():
    import torch._dynamo.config as dynamo_config

    from verl_omni.models.wnm.compilation import raise_recompile_limit

    with dynamo_config.patch(recompile_limit=100, accumulated_recompile_limit=1000):
        raise_recompile_limit(64)
        assert (dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit) == (100, 1000)
        raise_recompile_limit(200)
        assert (dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit) == (200, 1000)


def test_multi_kernel_asks_inductor_for_persistent_reduction_candidates_and_refuses_a_mode(monkeypatch):
    import pytest

    seen = {}

    def recording_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=1))
    model.compile_blocks(multi_kernel=True)
    assert seen["options"] == {"triton.multi_kernel": 1, "fx_graph_cache": False} and seen["mode"] is None
    seen.clear()
    WNMTransformer(WNMConfig.from_size("tiny", num_layers=1)).compile_blocks()
    assert seen["options"] is None  # the default compile is unchanged
    with pytest.raises(ValueError, match="multi_kernel cannot be combined with mode='max-autotune'"):
        WNMTransformer(WNMConfig.from_size("tiny", num_layers=1)).compile_blocks(mode="max-autotune", multi_kernel=True)
