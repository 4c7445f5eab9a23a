"""The FP8 rollout copy on a CUDA device with FP8 tensor cores (skipped elsewhere).

The CPU suite runs ``torch._scaled_mm``'s CPU kernel; this checks the CUDA one (row-wise scales, bf16 output) the
rollout actually uses. Expected values: the dequantized product computed in float64 by hand, and the bf16 model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from fp8_reference import dequantized_linear
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm.fp8 import Float8Linear, float8_rollout_copy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device with FP8 tensor cores (compute capability 8.9+)",
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _to_cuda(inputs, dtype):
    x, a, s, ctx = inputs
    ctx = type(ctx)(ctx.history_latents.cuda().to(dtype), ctx.encoder_tokens.cuda().to(dtype), ctx.encoder_mask.cuda())
    return x.cuda().to(dtype), a.cuda().to(dtype), s.cuda(), ctx


def test_cuda_float8_linear_is_the_dequantized_product_in_bf16():
    torch.manual_seed(0)
    lin = nn.Linear(256, 512).cuda().to(torch.bfloat16)
    x = torch.randn(3, 40, 256, device="cuda", dtype=torch.bfloat16)
    got = Float8Linear.from_linear(lin)(x)
    want = dequantized_linear(lin, x)  # float64, both operands dequantized by hand
    assert got.dtype == torch.bfloat16 and got.shape == (3, 40, 512)
    assert _rel(got, want) < 1e-2  # only the bf16 store and fp32 accumulation order differ


def test_cuda_rollout_copy_eager_and_compiled_stay_near_the_bf16_model():
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=2)).cuda().to(torch.bfloat16).eval()
    eager, compiled = float8_rollout_copy(model), float8_rollout_copy(model)
    compiled.compile_blocks()
    inputs = _to_cuda(random_dit_inputs(model.config, b=4), torch.bfloat16)
    with torch.no_grad():
        ref, fe, fc = model(*inputs), eager(*inputs), compiled(*inputs)
    for r, e, c in zip(ref, fe, fc, strict=True):
        assert torch.isfinite(e).all() and torch.isfinite(c).all()
        assert 0 < _rel(e, r) < 0.1  # e4m3 has 3 mantissa bits
        assert _rel(c, e) < 2e-2  # inductor may round a row's scale to a neighbouring e4m3 step
