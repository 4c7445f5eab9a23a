"""``residual_layer_norm``: the fused residual add + LayerNorm (+ modulation) Triton kernel, run on the CPU by Triton's
interpreter (the GPU test runs it on CUDA, eager and compiled, inside the model).

Expected values are float64 computations of the formula from the same bf16/fp16 inputs: ``x + y * gate`` (the gate
row of the token's group), then the LayerNorm of the rounded sum with the biased variance, the norm's weight and
bias, and ``* (1 + scale) + shift`` with the group's rows.

Error bounds (unit roundoff ``u``, rounding to nearest): the stream is the exact sum rounded once, so
``|got - exact| <= u |exact|``; the normed row is computed in fp32 from the stored (rounded) stream and rounded once
on store, so ``|got - exact| <= u |exact|`` plus fp32 noise, taken as ``1e-5`` of the magnitudes involved. Triton's
interpreter truncates fp32 -> bf16 casts (see ``test_wnm_rms_norm_rope_on_cpu.py``), up to one ulp, so interpreted
bf16 gets ``2 u``.
"""

from __future__ import annotations

import pytest
import torch
from triton_checks import INTERPRETED_ROUNDINGS, UNIT_ROUNDOFF, run_interpreted

# The kernel runs in a child process under Triton's interpreter (tests/triton_checks.py says why).
_RUNNER = """
from verl_omni.models.wnm import residual_norm
def run(case):
    if case["kind"] == "op":
        return residual_norm.residual_layer_norm(*case["args"])
    norm = torch.nn.LayerNorm(case["width"], eps=case["eps"], elementwise_affine=False)
    return residual_norm.fused_residual_layer_norm(norm, *case["args"])
"""


def _per_token(table: torch.Tensor | None, lengths: list[int]) -> torch.Tensor | None:
    """``[B, G, D]`` -> ``[B, S, D]`` float64, token s taking its group's row (written out with repeat_interleave)."""
    if table is None:
        return None
    return table.double().repeat_interleave(torch.tensor(lengths), dim=1)


def _exact_stream(x, y, gate, lengths):
    if y is None:
        return x.double()
    g = _per_token(gate, lengths)
    return x.double() + (y.double() if g is None else y.double() * g)


def _exact_normed(stream, weight, bias, scale, shift, lengths, eps):
    s = stream.double()
    mean = s.mean(-1, keepdim=True)
    var = (s - mean).pow(2).mean(-1, keepdim=True)
    n = (s - mean) / torch.sqrt(var + eps)
    if weight is not None:
        n = n * weight.double()
    if bias is not None:
        n = n + bias.double()
    if scale is None:
        return n, n.abs()
    sc, sh = _per_token(scale, lengths), _per_token(shift, lengths)
    return n * (1 + sc) + sh, (n * (1 + sc)).abs() + sh.abs()


def _case(dtype, b, s, d, lengths, *, branch=True, gated=True, affine=False, modulated=True, seq_offset=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = len(lengths)
    # The stream as a slice of a longer sequence (the last block's kept tokens): batch and sequence strides.
    x = (torch.randn(b, s + seq_offset, d, generator=g) * 3).to(dtype)[:, seq_offset:]
    y = torch.randn(b, s, d, generator=g).to(dtype) if branch else None
    mods = torch.randn(b, groups, 6, d, generator=g).unbind(2)  # [B, G, D] views, as the block's modulation
    gate = mods[0] if gated and branch else None
    weight = torch.randn(d, generator=g).to(dtype) if affine else None
    bias = torch.randn(d, generator=g).to(dtype) if affine else None
    scale, shift = (mods[1], mods[2]) if modulated else (None, None)
    starts = [sum(lengths[:i]) for i in range(1, groups)] + [s] * (3 - groups)
    return {"kind": "op", "args": (x, y, gate, weight, bias, scale, shift, starts[0], starts[1], 1e-6)}, lengths


CASES = {
    # name: (dtype, batch, seq, width, group lengths, options)
    "modulated, gated, three groups, padded width, strided stream": (torch.bfloat16, 2, 9, 48, [4, 3, 2],
                                                                    {"seq_offset": 3}),
    "affine, gated, two groups (norm2)": (torch.float16, 2, 7, 64, [5, 2], {"affine": True, "modulated": False}),
    "modulated, plain add, one group (norm3)": (torch.bfloat16, 3, 5, 40, [5], {"gated": False}),
    "modulated, no branch (a first block's norm1)": (torch.float16, 2, 6, 32, [2, 4], {"branch": False}),
}  # fmt: skip


def _built(name: str) -> tuple[dict, list[int]]:
    dtype, b, s, d, lengths, opts = CASES[name]
    return _case(dtype, b, s, d, lengths, seed=len(name), **opts)


MODULE_CASE = _case(torch.bfloat16, 2, 6, 32, [2, 4], branch=False, seed=3)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case through the interpreter in one child process (each start costs seconds)."""
    cases = {name: _built(name)[0] for name in CASES}
    x, _, _, _, _, scale, shift, *_ = MODULE_CASE[0]["args"]
    cases["module"] = {"kind": "module", "width": 32, "eps": 1e-6, "args": (x, None, None, [2, 4], scale, shift)}
    return run_interpreted(_RUNNER, cases, tmp_path_factory.mktemp("residual_norm"))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_within_one_rounding_of_float64(name, interpreted):
    dtype, b, s, d, _, _ = CASES[name]
    case, lengths = _built(name)
    stream, normed = interpreted[name]
    x, y, gate, weight, bias, scale, shift, _, _, eps = case["args"]
    u = INTERPRETED_ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype]
    if y is None:
        assert stream.numel() == 0
        stored = x
    else:
        assert stream.shape == (b, s, d) and stream.dtype == dtype and stream.is_contiguous()
        exact = _exact_stream(x, y, gate, lengths)
        assert bool(((stream.double() - exact).abs() <= u * exact.abs() + 1e-6).all())
        stored = stream
    want, size = _exact_normed(stored, weight, bias, scale, shift, lengths, eps)
    err = (normed.double() - want).abs()
    assert normed.shape == (b, s, d) and normed.dtype == dtype
    assert bool((err <= u * want.abs() + 1e-5 * (size + 1)).all()), float(err.max())


def test_module_entry_point_returns_the_stream_itself_without_a_branch_and_refuses_bad_tables(interpreted):
    from verl_omni.models.wnm import residual_norm

    case, lengths = MODULE_CASE
    x, _, _, _, _, scale, shift, *_ = case["args"]
    out = interpreted["module"]
    assert torch.equal(out[0], x)  # no branch: the stream is the input
    want, size = _exact_normed(x, None, None, scale, shift, lengths, 1e-6)
    assert bool(((out[1].double() - want).abs() <= 2**-7 * want.abs() + 1e-5 * (size + 1)).all())
    norm = torch.nn.LayerNorm(32, elementwise_affine=False)
    with pytest.raises(ValueError, match=r"scale must be \[2, 2, 32\]"):
        residual_norm.fused_residual_layer_norm(norm, x, None, None, lengths, scale[:, :1], shift)
    with pytest.raises(ValueError, match="must be at most 3 and sum to the 6 tokens"):
        residual_norm.fused_residual_layer_norm(norm, x, None, None, [1, 2, 2, 1], None, None)
    with pytest.raises(ValueError, match="must be at most 3 and sum to the 6 tokens"):
        residual_norm.fused_residual_layer_norm(norm, x, None, None, [1, 2], None, None)
    with pytest.raises(ValueError, match="needs both scale and shift"):
        residual_norm.fused_residual_layer_norm(norm, x, None, None, lengths, scale, None)


def test_kernel_applies_only_to_cuda_low_precision_inference_with_a_layer_norm():
    from verl_omni.models.wnm import residual_norm

    norm = torch.nn.LayerNorm(8)
    x = torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    assert not residual_norm.applies(x, norm, None)  # CPU
    assert not residual_norm.applies(x.float(), torch.nn.Identity(), None)
