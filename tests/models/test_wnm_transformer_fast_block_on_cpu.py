"""The faster DiT block (issue 21) computes what the previous block computed: fp32 bit for bit, bf16 within rounding.

The reference is the block forward as it stood before the change (split/cat grouped modulation, diffusers'
attention processors, the context mask always passed), kept here verbatim as ``_reference_block_forward`` and
bound onto a copy of the same model, so both run the same weights on the same inputs.
"""

from __future__ import annotations

import copy
import types
from unittest import mock

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
from verl_omni.models.wnm import transformer as transformer_module
from verl_omni.models.wnm.attention import _self_attention

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- the previous implementation
def _ref_modulate(x, scale, shift, lengths):
    if lengths is None:
        return x * (1 + scale) + shift
    parts = x.split(lengths, dim=1)
    return torch.cat([p * (1 + scale[:, g : g + 1]) + shift[:, g : g + 1] for g, p in enumerate(parts)], dim=1)


def _ref_gate(x, y, gate, lengths):
    if lengths is None:
        return x + y * gate
    parts = y.split(lengths, dim=1)
    return x + torch.cat([p * gate[:, g : g + 1] for g, p in enumerate(parts)], dim=1)


def _reference_block_forward(
    self,
    hidden_states,
    encoder_hidden_states,
    temb,
    rotary_emb,
    encoder_attention_mask=None,
    group_lengths=None,
    prefix_kv=None,
    return_kv=False,
    *,
    outputs_from=0,
):
    if temb.ndim == 4:
        mods = (self.scale_shift_table.unsqueeze(0) + temb.float()).unbind(dim=2)
    else:
        mods = (self.scale_shift_table + temb.float()).unbind(dim=1)
        mods = tuple(m.unsqueeze(1) for m in mods)
        group_lengths = None
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods
    normed = _ref_modulate(self.norm1(hidden_states.float()), scale_msa, shift_msa, group_lengths)
    kv = None
    if prefix_kv is None and not return_kv:
        attn_output = self.attn1(normed.type_as(hidden_states), None, None, rotary_emb)  # diffusers' processor
    else:
        attn_output, kv = _self_attention(self.attn1, normed.type_as(hidden_states), rotary_emb, prefix_kv, "default")
    hidden_states = _ref_gate(hidden_states.float(), attn_output, gate_msa, group_lengths).type_as(hidden_states)
    mask = None if encoder_attention_mask is None else encoder_attention_mask[:, None, None, :]
    normed = self.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + self.attn2(normed, encoder_hidden_states, mask, None)
    normed = _ref_modulate(self.norm3(hidden_states.float()), c_scale_msa, c_shift_msa, group_lengths)
    ff_output = self.ffn(normed.type_as(hidden_states))
    hidden_states = _ref_gate(hidden_states.float(), ff_output.float(), c_gate_msa, group_lengths)
    hidden_states = hidden_states.type_as(encoder_hidden_states)[:, outputs_from:]  # all tokens ran; some are kept
    return (hidden_states, kv) if return_kv else hidden_states


def _reference_copy(model: WNMTransformer) -> WNMTransformer:
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        block.block_forward = types.MethodType(_reference_block_forward, block)
    ref._context_mask = lambda context: context.encoder_mask  # the previous forward always passed the mask on
    ref.forward = types.MethodType(_every_block_adds_its_residual, ref)
    return ref


def _every_block_adds_its_residual(self, *args, **kwargs):
    """The previous loop: no block leaves its feed-forward residual to the next."""
    with mock.patch.object(transformer_module, "DEFER_FFN_RESIDUAL", False):
        return WNMTransformer.forward(self, *args, **kwargs)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).eval()
    return model, _reference_copy(model)


def _inputs(cfg, b=2, seed=0, pad: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, cfg.context_tokens, dtype=torch.bool)
    if pad:
        mask[0, cfg.context_tokens // 3 - pad : cfg.context_tokens // 3] = False  # padded text of one prompt
    ctx = WNMContext(
        history_latents=torch.randn(b, *cfg.history_latent_shape, generator=g).to(dtype),
        encoder_tokens=torch.randn(b, cfg.context_tokens, cfg.dim, generator=g).to(dtype),
        encoder_mask=mask,
    )
    x = torch.randn(b, *cfg.target_latent_shape, generator=g).to(dtype)
    a = torch.randn(b, cfg.action_steps, cfg.action_channels, generator=g).to(dtype)
    return x, a, torch.rand(b, generator=g), ctx


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("pad", [0, 5])
def test_fp32_inference_is_bit_identical(models, pad):
    model, ref = models
    x, a, s, ctx = _inputs(model.config, b=3, pad=pad)
    with torch.no_grad():
        got, ref_out = model(x, a, s, ctx), ref(x, a, s, ctx)
    for g, r in zip(got, ref_out, strict=True):
        assert torch.equal(g, r)


@pytest.mark.parametrize("skip_unread", [False, True])
def test_fp32_training_forward_and_gradients_are_bit_identical(models, monkeypatch, skip_unread):
    model, ref = models
    model, ref = copy.deepcopy(model).train(), copy.deepcopy(ref).train()
    monkeypatch.setattr(transformer_module, "SKIP_UNREAD_OUTPUTS", skip_unread)
    x, a, s, ctx = _inputs(model.config, pad=3, seed=4)
    outs = []
    for m in (model, ref):
        v, va = m(x, a, s, ctx)
        (v.square().mean() + va.square().mean()).backward()
        outs.append((v.detach(), va.detach(), [p.grad.clone() for p in m.blocks.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for g, r in zip(outs[0][2], outs[1][2], strict=True):
        if skip_unread:
            # The last block's weight gradients then sum over the target and action rows only: the history rows
            # it no longer runs contributed exact zeros, so only the order of the sums (and their rounding) moves.
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-8)
        else:
            assert torch.equal(g, r)


def test_the_last_block_runs_only_the_tokens_the_heads_read(models, monkeypatch):
    model, _ = models
    layout = model.sequence_layout()
    nh, seq = layout["history"].stop, model.config.sequence_length
    seen = []
    hooks = [blk.ffn.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1])) for blk in model.blocks]
    x, a, s, ctx = _inputs(model.config, seed=5, pad=2)
    try:
        with torch.no_grad():
            skipped = model(x, a, s, ctx)
            monkeypatch.setattr(transformer_module, "SKIP_UNREAD_OUTPUTS", False)
            everything = model(x, a, s, ctx)
    finally:
        for h in hooks:
            h.remove()
    # Feed-forward rows per block: all tokens but in the last block, then all tokens everywhere (flag off).
    n = len(model.blocks)
    assert seen == [seq] * (n - 1) + [seq - nh] + [seq] * n
    for g, r in zip(skipped, everything, strict=True):
        assert torch.equal(g, r)


def test_outputs_from_must_fall_on_a_modulation_group_boundary(models):
    model, _ = models
    block, d = model.blocks[0], model.config.dim
    h, ctx = torch.randn(1, 10, d), torch.randn(1, 4, d)
    rope = tuple(r[:, :10] for r in model.rotary_embedding(h.device))
    temb = torch.randn(1, 2, 6, d)
    # The same values up to fp32 rounding, not bit for bit: the skipped rows change the row count of the query and
    # feed-forward products, and the CPU BLAS may pick another kernel, and so another summation order, by row count
    # (seen on one CI machine: 1 ulp apart; another gave equal bits).
    with torch.no_grad():
        full = block(h, ctx, temb, rope, None, [6, 4])
        torch.testing.assert_close(block(h, ctx, temb, rope, None, [6, 4], outputs_from=6), full[:, 6:])
        one = block(h, ctx, temb[:, 0], rope)
        torch.testing.assert_close(block(h, ctx, temb[:, 0], rope, outputs_from=3), one[:, 3:])
        with pytest.raises(ValueError, match="where a modulation group begins"):
            block(h, ctx, temb, rope, None, [6, 4], outputs_from=5)
        with pytest.raises(ValueError, match="outputs_from must be in"):
            block(h, ctx, temb, rope, None, [6, 4], outputs_from=10)


def test_fp32_isolated_history_and_activation_checkpointing_are_bit_identical(models):
    model, ref = models
    x, a, s, ctx = _inputs(model.config, seed=7)
    iso, iso_ref = copy.deepcopy(model), copy.deepcopy(ref)
    iso.set_history_attention("isolated")
    iso_ref.set_history_attention("isolated")
    with torch.no_grad():
        for g, r in zip(iso(x, a, s, ctx), iso_ref(x, a, s, ctx), strict=True):
            assert torch.equal(g, r)
    ckpt = copy.deepcopy(model).train()
    ckpt.gradient_checkpointing = True
    v, va = ckpt(x, a, s, ctx)
    v_ref, va_ref = ref(x, a, s, ctx)
    assert torch.equal(v, v_ref) and torch.equal(va, va_ref)


def test_bf16_inference_within_rounding_of_the_previous_block(models):
    model, ref = models
    model16, ref16 = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    x, a, s, ctx = _inputs(model.config, seed=9, dtype=torch.bfloat16)
    with torch.no_grad():
        v, va = model16(x, a, s, ctx)
        rv, rva = ref16(x, a, s, ctx)
        fv, fva = ref(x.float(), a.float(), s, ctx.to(dtype=torch.float32))
    # As close to the previous bf16 block as bf16 rounding allows, and no further from fp32 than it was.
    assert _rel(v, rv) < 1e-2 and _rel(va, rva) < 1e-2
    assert _rel(v, fv) <= 1.05 * _rel(rv, fv) + 1e-4 and _rel(va, fva) <= 1.05 * _rel(rva, fva) + 1e-4


def test_attention_backend_is_validated_and_set_on_every_block(models):
    model, _ = models
    m = copy.deepcopy(model)
    assert m.attention_backend == "default"
    m.attention_backend = "cudnn"
    assert all(b.attention_backend == "cudnn" for b in m.blocks)
    x, a, s, ctx = _inputs(m.config, seed=2)
    with torch.no_grad():  # on CPU the cudnn choice falls back to PyTorch's own kernel: same outputs
        for g, r in zip(m(x, a, s, ctx), model(x, a, s, ctx), strict=True):
            assert torch.equal(g, r)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        m.attention_backend = "flash3"


@pytest.mark.parametrize("affine", [False, True])
def test_bf16_eager_layer_norm_is_diffusers_fp32_layer_norm_rounded_once(affine):
    """The eager bf16 fast path of the block's norms reads bf16 and stores bf16; the reference is diffusers'
    ``FP32LayerNorm`` on the fp32 upcast, rounded to bf16 (what the block fed its modulation before, less that
    one rounding). With grad enabled or fp32 activations the block keeps the fp32 form."""
    from diffusers.models.normalization import FP32LayerNorm

    from verl_omni.models.wnm import block

    torch.manual_seed(3)
    norm = FP32LayerNorm(48, 1e-6, elementwise_affine=affine)
    if affine:
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    norm16 = copy.deepcopy(norm).to(torch.bfloat16)
    x = (torch.randn(2, 9, 48) * 4 + 2).to(torch.bfloat16)
    with torch.no_grad():
        fast = block._layer_norm(norm16, x)
        reference = norm16(x.float())
    assert fast.dtype == torch.bfloat16 and reference.dtype == torch.float32
    assert torch.equal(fast, reference.to(torch.bfloat16))
    with torch.enable_grad():
        assert block._layer_norm(norm16, x).dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(block._layer_norm(norm, x.float()), norm(x.float()))
