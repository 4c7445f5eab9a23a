"""The fused residual add + LayerNorm kernel on CUDA: within one rounding of float64 at Wan widths, and the model
with it within bf16 rounding of the model without it, eager and compiled; training keeps the composite form."""

from __future__ import annotations

import pytest
import torch
from test_wnm_residual_norm_on_cpu import _case, _exact_normed, _exact_stream
from triton_checks import UNIT_ROUNDOFF
from wnm_inputs import cuda_bf16_dit_inputs, cuda_bf16_outputs_with_and_without
from wnm_inputs import relative_difference as _rel

from verl_omni.models.wnm import WNMConfig, WNMTransformer, residual_norm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 3072])
@pytest.mark.parametrize("affine", [False, True])
@torch.no_grad()
def test_kernel_within_one_rounding_of_float64_at_wan_widths(dtype, width, affine):
    case, lengths = _case(dtype, 2, 300, width, [100, 168, 32], affine=affine, modulated=not affine, seq_offset=5)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case["args"]]
    stream, normed = residual_norm.residual_layer_norm(*args)
    x, y, gate, weight, bias, scale, shift, _, _, eps = case["args"]
    u = UNIT_ROUNDOFF[dtype]
    exact = _exact_stream(x, y, gate, lengths)
    assert bool(((stream.cpu().double() - exact).abs() <= u * exact.abs() + 1e-6).all())
    want, size = _exact_normed(stream.cpu(), weight, bias, scale, shift, lengths, eps)
    err = (normed.cpu().double() - want).abs()
    assert bool((err <= u * want.abs() + 1e-5 * (size + 1)).all()), float(err.max())


@pytest.mark.parametrize("compiled", [False, True])
def test_model_with_the_kernel_stays_near_the_model_without(compiled):
    off = lambda m: setattr(m, "residual_norm_kernel", False)  # noqa: E731
    fused, plain = cuda_bf16_outputs_with_and_without(off, num_layers=3, compiled=compiled)
    for f, p in zip(fused, plain, strict=True):
        assert torch.isfinite(f).all()
        assert _rel(f, p) < 2e-2  # bf16 rounding only


def test_the_block_uses_the_kernel_only_without_grad(monkeypatch):
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).cuda().to(torch.bfloat16)
    calls = []
    real = residual_norm.fused_residual_layer_norm
    monkeypatch.setattr(residual_norm, "fused_residual_layer_norm", lambda *a: calls.append(1) or real(*a))
    inputs = cuda_bf16_dit_inputs(model.config, b=2)
    with torch.no_grad():
        model(*inputs)
    assert len(calls) == 3 * 2  # three add + norm places per block
    v, va = model(*inputs)
    (v.float().square().mean() + va.float().square().mean()).backward()
    assert len(calls) == 6 and all(p.grad is not None for p in model.blocks.parameters())
