"""bf16 cross-attention over the attended context tokens only (``transformer.COMPACT_CONTEXT``).

Dropping a prompt's padded text positions instead of masking them is exact in real arithmetic (a masked key
weighs exactly 0): the expected tokens below are picked out by hand from the mask, and the bf16 forward is held
against the masked forward and an fp32 reference. fp32 keeps the masked form (its bits are pinned elsewhere).
"""

from __future__ import annotations

import copy

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
from verl_omni.models.wnm import transformer as transformer_module

torch.set_num_threads(1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).eval()


def _context(cfg, valid: list[int], seed=0, dtype=torch.float32) -> WNMContext:
    """A context whose row ``i`` attends to its first ``valid[i]`` text positions and every other token."""
    g = torch.Generator().manual_seed(seed)
    b, length = len(valid), cfg.context_tokens
    mask = torch.ones(b, length, dtype=torch.bool)
    text = cfg.text_max_length
    for i, n in enumerate(valid):
        mask[i, n:text] = False
    return WNMContext(
        history_latents=torch.randn(b, *cfg.history_latent_shape, generator=g).to(dtype),
        encoder_tokens=torch.randn(b, length, cfg.dim, generator=g).to(dtype),
        encoder_mask=mask,
    )


def test_compaction_keeps_each_rows_attended_tokens_in_order(model):
    cfg = model.config
    text, length = cfg.text_max_length, cfg.context_tokens
    same = _context(cfg, [5, 5])
    tokens, mask = model._cross_attention_context(same, torch.bfloat16)
    keep = list(range(5)) + list(range(text, length))  # 5 text tokens, then the image/geometry tokens
    assert mask is None and tokens.shape == (2, len(keep), cfg.dim)
    assert torch.equal(tokens, same.encoder_tokens[:, keep].to(torch.bfloat16))
    mixed = _context(cfg, [3, 7])
    tokens, mask = model._cross_attention_context(mixed, torch.bfloat16)
    n = 7 + length - text  # the longer row's count
    assert tokens.shape == (2, n, cfg.dim)
    assert torch.equal(mask, torch.tensor([[True] * (n - 4) + [False] * 4, [True] * n]))
    row0 = list(range(3)) + list(range(text, length))
    assert torch.equal(tokens[0, : len(row0)], mixed.encoder_tokens[0, row0].to(torch.bfloat16))
    # fp32 and an all-attended context keep the masked form as it was.
    tokens, mask = model._cross_attention_context(mixed, torch.float32)
    assert torch.equal(tokens, mixed.encoder_tokens) and torch.equal(mask, mixed.encoder_mask)
    full = _context(cfg, [text, text])
    tokens, mask = model._cross_attention_context(full, torch.bfloat16)
    assert mask is None and tokens.shape[1] == length


@pytest.mark.parametrize("valid", [[6, 6], [2, 9]])
def test_bf16_forward_over_compacted_context_matches_the_masked_one(model, valid):
    cfg = model.config
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, *cfg.target_latent_shape, generator=g)
    a = torch.randn(2, cfg.action_steps, cfg.action_channels, generator=g)
    s = torch.rand(2, generator=g)
    ctx = _context(cfg, valid, seed=5)
    with torch.no_grad():
        fv, fva = model(x, a, s, ctx)  # fp32 masked reference
        compact = m16(x.bfloat16(), a.bfloat16(), s, ctx.to(dtype=torch.bfloat16))
        transformer_module.COMPACT_CONTEXT = False
        try:
            masked = m16(x.bfloat16(), a.bfloat16(), s, ctx.to(dtype=torch.bfloat16))
        finally:
            transformer_module.COMPACT_CONTEXT = True
    for c, mk, f in zip(compact, masked, (fv, fva), strict=True):
        assert _rel(c, mk) < 1e-2  # bf16 rounding of a differently ordered sum
        assert _rel(c, f) <= 1.05 * _rel(mk, f) + 1e-3  # and no further from fp32 than the masked form


def test_compiled_blocks_do_not_recompile_for_every_instruction_length(model, monkeypatch):
    """Compaction gives every prompt's context its own length. Dynamo must turn that length dynamic after the
    second one instead of compiling a graph per instruction length (which would exhaust the recompile budget)."""
    import functools

    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    # Graph capture and guards are what is tested, so the cheap "eager" backend stands in for inductor.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    dynamo.reset()
    counters.clear()
    compiled = copy.deepcopy(model).to(torch.bfloat16)
    compiled.compile_blocks()
    cfg = compiled.config
    g = torch.Generator().manual_seed(4)
    graphs = []
    for n in (3, 9, 17, 5, 30, 12):
        ctx = _context(cfg, [n, n], seed=n, dtype=torch.bfloat16)
        x = torch.randn(2, *cfg.target_latent_shape, generator=g).to(torch.bfloat16)
        a = torch.randn(2, cfg.action_steps, cfg.action_channels, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            v, _ = compiled(x, a, torch.rand(2, generator=g), ctx)
        assert torch.isfinite(v.float()).all()
        graphs.append(counters["stats"]["unique_graphs"])
    dynamo.reset()
    # The first length compiles two static graphs (the blocks, and the last block that returns only the target
    # tokens), the second length their forms with a dynamic context length; after that nothing new compiles.
    assert graphs == [2, 4, 4, 4, 4, 4], graphs


def test_attended_range_counted_once_gives_the_same_forward(model, monkeypatch):
    """A context that carries its attended-token counts (``with_attended_range``) is cut the same way without
    counting on the device again: the same bits, and no ``tolist`` in the forward."""
    cfg = model.config
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    ctx = _context(cfg, [2, 9], seed=6, dtype=torch.bfloat16)
    counted = ctx.with_attended_range()
    other = cfg.context_tokens - cfg.text_max_length  # the image/geometry tokens every row attends to
    assert counted.encoder_attended_range == (2 + other, 9 + other)  # counted by hand from _context's mask
    assert counted.to(dtype=torch.bfloat16).encoder_attended_range == (2 + other, 9 + other)
    assert counted.select(torch.tensor([0])).encoder_attended_range is None  # other rows, other counts
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, *cfg.target_latent_shape, generator=g).bfloat16()
    a = torch.randn(2, cfg.action_steps, cfg.action_channels, generator=g).bfloat16()
    s = torch.rand(2, generator=g)
    with torch.no_grad():
        want = m16(x, a, s, ctx)
        monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the forward counted on the device"))
        got = m16(x, a, s, counted)
    for g_, w in zip(got, want, strict=True):
        assert torch.equal(g_, w)


@pytest.mark.parametrize("bad", [(5, 3), (-1, 4), (0, 10**6), (0.0, 3), (True, 3), None])
def test_attended_range_out_of_bounds_is_refused(model, bad):
    """A hand-set range must fit the mask: integers, fewest <= most, both within [0, L]; and a range needs a mask."""
    import dataclasses

    from verl_omni.models.wnm.context import WNMContext

    cfg = model.config
    ctx = _context(cfg, [2, 9], seed=6, dtype=torch.float32)
    if bad is None:  # a range without a mask
        with pytest.raises(ValueError, match="encoder_attended_range"):
            dataclasses.replace(ctx, encoder_mask=None, encoder_attended_range=(1, 2))
        return
    with pytest.raises(ValueError, match="encoder_attended_range"):
        WNMContext(ctx.history_latents, ctx.encoder_tokens, ctx.encoder_mask, encoder_attended_range=bad)
    length = ctx.encoder_tokens.shape[1]
    assert WNMContext(ctx.history_latents, ctx.encoder_tokens, ctx.encoder_mask, encoder_attended_range=(0, length))
