"""In inference each block but the last leaves its feed-forward residual to the next block (``DEFER_FFN_RESIDUAL``).

The expected values are the same model run with every block adding its own residual (the flag off): the deferral
moves one add from the end of a block to the start of the next, so eager results must keep their bits, in fp32 and
bf16 alike. The block-level test checks the pending pair against the gated residual written out by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm import transformer as transformer_module
from verl_omni.models.wnm.block import PendingResidual

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # Three blocks: the first leaves its residual, the middle takes one and leaves one, the last takes one.
    return WNMTransformer(WNMConfig.from_size("tiny", num_layers=3)).eval()


def _both(model, inputs, monkeypatch):
    with torch.no_grad():
        deferred = model(*inputs)
        monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", False)
        added = model(*inputs)
    monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", True)
    return deferred, added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("history_attention", ["full", "isolated"])
def test_deferred_residual_keeps_the_eager_outputs_bit_for_bit(model, monkeypatch, dtype, history_attention):
    m = copy.deepcopy(model).to(dtype)
    m.set_history_attention(history_attention)
    x, a, s, ctx = random_dit_inputs(m.config, b=3, seed=2)
    ctx = type(ctx)(ctx.history_latents.to(dtype), ctx.encoder_tokens.to(dtype), ctx.encoder_mask)
    deferred, added = _both(m, (x.to(dtype), a.to(dtype), s, ctx), monkeypatch)
    for d, r in zip(deferred, added, strict=True):
        assert d.dtype == dtype and torch.equal(d, r)


def test_blocks_pass_the_residual_on_only_in_inference_with_the_add_norm_kernel_on(model):
    seen = []
    hooks = [
        blk.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append((kwargs.get("defer_residual", False), "pending" in kwargs)),
            with_kwargs=True,
        )
        for blk in model.blocks
    ]
    inputs = random_dit_inputs(model.config, seed=3)

    def blocks_of_one_forward(grad: bool) -> list[tuple[bool, bool]]:
        seen.clear()
        with torch.set_grad_enabled(grad):
            model(*inputs)
        return list(seen)

    try:
        inference = blocks_of_one_forward(False)
        training = blocks_of_one_forward(True)  # the update keeps the add in its block (memory, first ratios)
        model.residual_norm_kernel = False  # the deferral exists for the kernel's add; off with it
        without_kernel = blocks_of_one_forward(False)
    finally:
        model.residual_norm_kernel = True
        for h in hooks:
            h.remove()
    # (defers its residual, takes the previous one) per block.
    assert inference == [(True, False), (True, True), (False, True)]
    assert training == without_kernel == [(False, False)] * 3


def test_the_pending_pair_is_the_gated_residual_the_block_would_have_added(model):
    block, d = model.blocks[0], model.config.dim
    g = torch.Generator().manual_seed(4)
    h, ctx = torch.randn(2, 10, d, generator=g), torch.randn(2, 4, d, generator=g)
    rope = tuple(r[:, :10] for r in model.rotary_embedding(h.device))
    temb = torch.randn(2, 2, 6, d, generator=g)
    lengths = [6, 4]
    with torch.no_grad():
        full = block(h, ctx, temb, rope, None, lengths)
        stream, (ff_out, gate) = block(h, ctx, temb, rope, None, lengths, defer_residual=True)
        assert ff_out.shape == (2, 10, d) and gate.shape == (2, 2, d)
        # By hand: token t of group k adds ff_out[:, t] * gate[:, k] to the stream.
        by_hand = stream.clone()
        by_hand[:, :6] += ff_out[:, :6] * gate[:, 0:1]
        by_hand[:, 6:] += ff_out[:, 6:] * gate[:, 1:2]
        assert torch.equal(by_hand, full)
        # The next block takes the pair as pending and gives what it gives on the summed stream.
        nxt = model.blocks[1]
        assert torch.equal(nxt(stream, ctx, temb, rope, None, lengths, pending=PendingResidual(ff_out, gate)),
                           nxt(full, ctx, temb, rope, None, lengths))  # fmt: skip


def test_defer_residual_refuses_outputs_from_and_return_kv(model):
    block, d = model.blocks[0], model.config.dim
    h, ctx = torch.randn(1, 10, d), torch.randn(1, 4, d)
    rope = tuple(r[:, :10] for r in model.rotary_embedding(h.device))
    temb = torch.randn(1, 2, 6, d)
    with torch.no_grad():
        with pytest.raises(ValueError, match="excludes return_kv and outputs_from"):
            block(h, ctx, temb, rope, None, [6, 4], defer_residual=True, outputs_from=6)
        with pytest.raises(ValueError, match="excludes return_kv and outputs_from"):
            block(h, ctx, temb, rope, None, [6, 4], None, True, defer_residual=True)


def test_history_keys_values_for_the_wrong_number_of_blocks_are_refused(model):
    iso = copy.deepcopy(model)
    iso.set_history_attention("isolated")
    x, a, s, ctx = random_dit_inputs(iso.config, seed=5)
    with torch.no_grad():
        kv = iso.history_kv(ctx)
        ctx = type(ctx)(ctx.history_latents, ctx.encoder_tokens, ctx.encoder_mask, history_kv=kv[:2])
        with pytest.raises(ValueError, match="history keys/values for 2 blocks, but the model has 3"):
            iso(x, a, s, ctx)


def test_compiled_inference_traces_three_block_graphs(model, monkeypatch):
    """The first block (leaves its residual), the middle ones (take one, leave one) and the last (takes one, returns
    the target tokens) are three graphs of the shared compiled block; a longer model adds no more."""
    import functools

    import torch._dynamo as dynamo

    from verl_omni.models.wnm.compilation import compiled_block_graphs

    # Graph capture is what is tested, so the cheap "eager" backend stands in for inductor (the GPU test compares
    # inductor's numerics).
    # fullgraph: a graph break at the pending residual (an object passed in) would split every block in two.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager", fullgraph=True))
    dynamo.reset()
    try:
        for layers in (3, 5):
            torch.manual_seed(0)
            m = WNMTransformer(WNMConfig.from_size("tiny", num_layers=layers)).eval()
            m.compile_blocks(dynamic=False)
            inputs = random_dit_inputs(m.config, seed=6)
            with torch.no_grad():
                compiled = m(*inputs)
                monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", False)
                added = m(*inputs)
                monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", True)
            for c, r in zip(compiled, added, strict=True):
                assert torch.equal(c, r)  # the eager backend runs the traced ops as they are
        # Deferred: first, middle, last; then, with the flag off, the blocks before the last and the last block
        # without a pending residual. The 5-block model reuses all five.
        assert compiled_block_graphs()[0] == 5
    finally:
        dynamo.reset()


def test_the_gate_reaches_the_next_block_in_fp32_under_fsdp2_mixed_precision(model):
    """FSDP2 casts a module's floating inputs to the compute dtype; the pending gate must get through unrounded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        for block in sharded.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(sharded, mesh=mesh, mp_policy=mp)
        gates = []
        hook = sharded.blocks[1].register_forward_pre_hook(
            lambda mod, args, kwargs: gates.append(kwargs["pending"].gate.dtype), with_kwargs=True
        )
        x, a, s, ctx = random_dit_inputs(sharded.config, seed=8)
        with torch.no_grad():
            v, _ = sharded(x, a, s, ctx)
        hook.remove()
        assert torch.isfinite(v.float()).all() and gates == [torch.float32]
    finally:
        dist.destroy_process_group()
