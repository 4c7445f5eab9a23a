"""The fused q/k RMS norm + RoPE Triton kernel (``rms_norm_rope.py``) on CUDA (skipped elsewhere).

Expected values come from float64 arithmetic written out here (the norm over the whole width, then each pair's
rotation), not from the code under test; the whole model with the kernel is compared with the model without it,
eager and compiled (the kernel inside inductor's graph), and training must keep the differentiable composite form.
"""

from __future__ import annotations

import pytest
import torch
from triton_checks import UNIT_ROUNDOFF
from wnm_inputs import cuda_bf16_outputs_with_and_without
from wnm_inputs import relative_difference as _rel

from verl_omni.models.wnm import WNMConfig, WNMTransformer, rms_norm_rope
from verl_omni.models.wnm.attention import _self_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_kernel_is_within_two_roundings_of_the_exact_norm_and_rotation_at_wan_widths(dtype):
    # Wan-1.3B's attention: 12 heads of 128 (768 pairs, a padded block of 1024 lanes).
    torch.manual_seed(0)
    b, s, heads, head_dim = 2, 96, 12, 128
    x = (torch.randn(b, s, heads * head_dim, device="cuda") * 4).to(dtype)
    weight = (torch.rand(heads * head_dim, device="cuda") + 0.5).to(dtype)
    angles = torch.rand(s, head_dim // 2, device="cuda", dtype=torch.float64) * 6
    cos = angles.cos().repeat_interleave(2, 1).float()
    sin = angles.sin().repeat_interleave(2, 1).float()
    got = rms_norm_rope.rms_norm_rope(x, weight, cos, sin, head_dim, 1e-6)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()).unflatten(-1, (heads, -1, 2))
    even, odd = normed[..., 0], normed[..., 1]
    c, sn = angles.cos()[None, :, None], angles.sin()[None, :, None]
    want = torch.stack([even * c - odd * sn, even * sn + odd * c], -1).flatten(-2)
    size = (even.abs() + odd.abs()).repeat_interleave(2, -1)
    err = (got.double().unflatten(-1, (heads, head_dim)) - want).abs()
    assert bool((err <= 2 * UNIT_ROUNDOFF[dtype] * size + 1e-6).all()), float((err / size).max())


@pytest.mark.parametrize("compiled", [False, True])
def test_model_with_the_kernel_stays_near_the_model_without(compiled):
    fused, plain = cuda_bf16_outputs_with_and_without(
        lambda m: setattr(m, "norm_rope_kernel", False), compiled=compiled
    )
    for f, p in zip(fused, plain, strict=True):
        assert torch.isfinite(f).all()
        assert _rel(f, p) < 2e-2  # bf16 rounding only


def test_self_attention_uses_the_kernel_only_without_grad(monkeypatch):
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=1)).cuda().to(torch.bfloat16)
    calls = []
    real = rms_norm_rope.fused_rms_norm_rope
    monkeypatch.setattr(rms_norm_rope, "fused_rms_norm_rope", lambda *a: calls.append(1) or real(*a))
    block = model.blocks[0]
    x = torch.randn(2, 10, model.config.dim, device="cuda", dtype=torch.bfloat16)
    head_dim = model.config.dim // block.attn1.heads
    angles = torch.rand(1, 10, 1, head_dim // 2, device="cuda")
    rope = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    with torch.no_grad():
        _self_attention(block.attn1, x, rope, None, "default", 0, True)
    assert len(calls) == 2  # q and k
    out, _ = _self_attention(block.attn1, x.requires_grad_(), rope, None, "default", 0, True)
    out.float().square().mean().backward()  # the composite form, differentiable
    assert len(calls) == 2 and x.grad is not None and torch.isfinite(x.grad).all()
