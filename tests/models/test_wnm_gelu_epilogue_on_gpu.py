"""The feed-forward's GELU in cuBLASLt's GEMM epilogue (``block._feed_forward``) on CUDA (skipped elsewhere).

Expected values come from float64 arithmetic written out here (``gelu_tanh`` by its formula), not from the code
under test; the whole model with the epilogue is compared with the model without it.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.attention import FeedForward
from wnm_inputs import cuda_bf16_outputs_with_and_without
from wnm_inputs import relative_difference as _rel

from verl_omni.models.wnm import block as wnm_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


@torch.no_grad()
def test_gelu_epilogue_is_the_tanh_gelu_of_the_product_in_bf16():
    torch.manual_seed(0)
    ffn = FeedForward(256, inner_dim=1024, activation_fn="gelu-approximate").cuda().to(torch.bfloat16)
    x = torch.randn(3, 50, 256, device="cuda", dtype=torch.bfloat16)
    proj, out = ffn.net[0].proj, ffn.net[2]
    hidden = _gelu_tanh(x.double() @ proj.weight.double().t() + proj.bias.double())
    want = hidden.to(torch.bfloat16).double() @ out.weight.double().t() + out.bias.double()
    got = wnm_block._feed_forward(ffn, x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 50, 256)
    assert _rel(got, want) < 1e-2
    assert _rel(got, ffn(x)) < 1e-2  # the two-kernel form rounds the product to bf16 once more


@torch.no_grad()
def test_fp32_on_cuda_keeps_the_module_bit_for_bit():
    torch.manual_seed(0)
    ffn = FeedForward(256, inner_dim=1024, activation_fn="gelu-approximate").cuda()
    x = torch.randn(3, 50, 256, device="cuda")
    assert torch.equal(wnm_block._feed_forward(ffn, x), ffn(x))


@pytest.mark.parametrize("compiled", [False, True])
def test_model_with_the_epilogue_stays_near_the_model_without(compiled):
    fused, plain = cuda_bf16_outputs_with_and_without(lambda m: setattr(m, "gelu_epilogue", False), compiled=compiled)
    for f, p in zip(fused, plain, strict=True):
        assert torch.isfinite(f).all()
        assert _rel(f, p) < 2e-2  # bf16 rounding only
