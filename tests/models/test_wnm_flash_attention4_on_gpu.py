"""FlashAttention-4's kernels behind ``attention_backend = "fa4"`` on a Hopper/Blackwell GPU (skipped elsewhere).

The reference is PyTorch's math attention in float32 on the same bf16 inputs (an independent implementation);
lengths that are not multiples of the kernel's tiles (our 4640 tokens, 545 context keys) are exercised at small
scale by 300 queries over 77 keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm.flash_attention4 import fa4_attention, fa4_available

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10) and fa4_available()),
    reason="needs FlashAttention-4 (flash-attn-4) on a Hopper or Blackwell GPU",
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("s,length", [(300, 300), (300, 77)])
def test_fa4_matches_fp32_math_attention_forward_and_backward(s, length):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 128, device="cuda", dtype=torch.bfloat16) for n in (s, length, length))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa4_attention(q, k, v)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_in = [t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*ref_in).transpose(1, 2)
    want = torch.autograd.grad(ref, ref_in, grad.float())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert _rel(out, ref) < 1e-2
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w.transpose(1, 2)) < 2e-2


def test_model_with_fa4_agrees_with_the_default_kernel_and_compiles():
    torch.manual_seed(0)
    cfg = WNMConfig.from_size("tiny")
    model = WNMTransformer(cfg).cuda().to(torch.bfloat16).eval()
    fa4_model = copy.deepcopy(model)
    fa4_model.attention_backend = "fa4"
    x, a, s, ctx = random_dit_inputs(cfg, b=2, seed=1)
    args = (x.cuda().bfloat16(), a.cuda().bfloat16(), s.cuda(), ctx.to(device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        ref = model(*args)
        got = fa4_model(*args)
        fa4_model.compile_blocks()
        compiled = fa4_model(*args)
    for g, c, r in zip(got, compiled, ref, strict=True):
        assert _rel(g, r) < 2e-2
        assert _rel(c, g) < 2e-2
