"""The FP8 rollout copy: row-wise float8 linear layers (``torch._scaled_mm`` runs on CPU too).

Expected values are written out independently of the module: the dequantized product computed in float64 from
the e4m3 grid by hand (round to nearest e4m3 after scaling each row's max to 448).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from fp8_reference import dequantized_linear
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm.fp8 import FLOAT8, Float8Linear, float8_rollout_copy, load_float8_copy, quantize_rowwise

torch.set_num_threads(1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_rowwise_maps_each_rows_max_to_448_and_zero_rows_to_zero():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 7.0, -14.0]])
    q, s = quantize_rowwise(x)
    assert q.dtype == FLOAT8 and s.shape == (3, 1)
    # Row 0: max |x| = 2 -> scale 2/448, i.e. x * 224: 224, -448, 112, all on the e4m3 grid.
    assert torch.equal(q[0].float(), torch.tensor([224.0, -448.0, 112.0]))
    assert float(s[0]) == pytest.approx(2 / 448)
    assert torch.equal(q[1].float(), torch.zeros(3))  # a zero row stays zero (scale clamped, not 0/0)
    # Row 2: scale 14/448 = 1/32; 3 -> 96, 7 -> 224, -14 -> -448.
    assert torch.equal(q[2].float(), torch.tensor([96.0, 224.0, -448.0]))


def test_float8_linear_is_the_dequantized_product():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    q = Float8Linear.from_linear(lin)
    got = q(x)
    want = dequantized_linear(lin, x)  # independent reference: both operands dequantized by hand, in float64
    assert got.shape == (5, 7, 48) and got.dtype == torch.float32
    assert _rel(got, want) < 1e-6
    # And it is a few percent from the full-precision layer, e4m3's 3 mantissa bits.
    assert 1e-3 < _rel(got, lin(x).detach()) < 0.08


def test_float8_linear_keeps_its_storage_dtypes_through_module_casts():
    q = Float8Linear.from_linear(nn.Linear(32, 16))
    scale = q.weight_scale.clone()
    q.to(torch.bfloat16)
    assert q.weight_fp8.dtype == FLOAT8 and q.weight_scale.dtype == torch.float32 and q.bias.dtype == torch.float32
    assert torch.equal(q.weight_scale, scale)


def test_float8_linear_refuses_a_wrong_shape():
    q = Float8Linear.from_linear(nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"expected \(16, 32\)"):
        q.load(torch.zeros(32, 16), torch.zeros(16))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).eval()


def test_rollout_copy_converts_exactly_the_block_linears(model):
    dup = float8_rollout_copy(model)
    n_block_linears = sum(isinstance(m, nn.Linear) for m in model.blocks.modules())
    assert n_block_linears > 0
    assert sum(isinstance(m, Float8Linear) for m in dup.blocks.modules()) == n_block_linears
    assert not any(isinstance(m, nn.Linear) for m in dup.blocks.modules())
    outside = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("blocks.")]
    assert outside and all(isinstance(dup.get_submodule(n), nn.Linear) for n in outside)
    # The source is untouched.
    assert sum(isinstance(m, nn.Linear) for m in model.blocks.modules()) == n_block_linears


def test_rollout_copy_predicts_like_the_model_within_fp8_rounding(model):
    dup = float8_rollout_copy(model)
    x, a, s, ctx = random_dit_inputs(model.config)
    with torch.no_grad():
        (v, va), (fv, fva) = dup(x, a, s, ctx), model(x, a, s, ctx)
    assert 0 < _rel(v, fv) < 0.1 and 0 < _rel(va, fva) < 0.1


def test_load_float8_copy_follows_new_weights_and_refuses_bad_name_sets_untouched(model):
    dup = float8_rollout_copy(model)
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = updated.state_dict()
    fetched = []

    def source(name):
        fetched.append(name)
        return state[name]

    assert load_float8_copy(dup, list(state), source) == len(state)
    assert sorted(fetched) == sorted(state)  # each tensor fetched exactly once
    x, a, s, ctx = random_dit_inputs(model.config, seed=1)
    with torch.no_grad():
        got = dup(x, a, s, ctx)[0]
        fresh = float8_rollout_copy(updated)(x, a, s, ctx)[0]
    assert torch.equal(got, fresh)  # loading = converting the new weights from scratch
    before = {k: v.clone() for k, v in dup.state_dict().items()}
    bad_sets = {
        "missing": [k for k in state if not k.endswith("attn1.to_q.weight")],
        "unknown": [*state, "blocks.0.nope"],
        "repeated": [*state, next(iter(state))],
    }
    for what, names in bad_sets.items():
        fetched.clear()
        with pytest.raises(KeyError, match=f"{what} \\['.+'\\].*nothing was loaded"):
            load_float8_copy(dup, names, source)
        assert not fetched  # refused before any tensor was fetched
    assert all(torch.equal(v, before[k]) for k, v in dup.state_dict().items())  # and nothing was written


def test_rollout_copy_compiles_without_graph_breaks(model):
    """The GPU runs the FP8 copy compiled; dynamo must trace the quantization and ``torch._scaled_mm`` whole."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    eager, compiled = float8_rollout_copy(model), float8_rollout_copy(model)
    compiled.compile_blocks()
    x, a, s, ctx = random_dit_inputs(model.config, seed=2)
    with torch.no_grad():
        (ve, vae), (vc, vac) = eager(x, a, s, ctx), compiled(x, a, s, ctx)
    assert not dynamo.utils.counters["graph_break"]
    # Inductor may round a token's scale differently from eager, moving it to a neighbouring e4m3 step.
    assert _rel(vc, ve) < 1e-2 and _rel(vac, vae) < 1e-2


def test_rollout_copy_converts_only_the_chosen_layer_groups_and_reloads_them(model):
    dup = float8_rollout_copy(model, groups=["feed_forward_in"])
    converted = sorted(n for n, m in dup.named_modules() if isinstance(m, Float8Linear))
    # Written out from the block's module names: one feed-forward input layer per block (2 blocks).
    assert converted == ["blocks.0.ffn.net.0.proj", "blocks.1.ffn.net.0.proj"]
    assert isinstance(dup.get_submodule("blocks.0.attn1.to_q"), nn.Linear)
    assert isinstance(dup.get_submodule("blocks.1.ffn.net.2"), nn.Linear)
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = updated.state_dict()
    assert load_float8_copy(dup, list(state), state.__getitem__) == len(state)
    x, a, s, ctx = random_dit_inputs(model.config, seed=3)
    with torch.no_grad():
        got = dup(x, a, s, ctx)[0]
        fresh = float8_rollout_copy(updated, groups=["feed_forward_in"])(x, a, s, ctx)[0]
        all_fp8 = float8_rollout_copy(updated)(x, a, s, ctx)[0]
        full = updated(x, a, s, ctx)[0]
    assert torch.equal(got, fresh)
    assert _rel(got, full) < _rel(all_fp8, full)  # fewer layers rounded to e4m3, closer to the full model
    for bad in (["attention", "nope"], []):
        with pytest.raises(ValueError, match="groups must be a non-empty subset"):
            float8_rollout_copy(model, groups=bad)
