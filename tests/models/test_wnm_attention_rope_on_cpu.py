"""``attention._apply_rope``: Wan's interleaved rotary embedding, against complex multiplication in float64."""

from __future__ import annotations

import torch

from verl_omni.models.wnm.attention import _apply_rope


def test_rope_is_the_complex_rotation_of_each_pair_and_keeps_the_input_layout():
    torch.manual_seed(0)
    b, s, h, d = 2, 5, 3, 8
    angles = torch.rand(s, d // 2, dtype=torch.float64) * 6
    # Wan's layout: every frequency repeated twice along the head dim, cos and sin each [1, S, 1, Dh].
    cos = angles.cos().repeat_interleave(2, dim=1)[None, :, None, :].float()
    sin = angles.sin().repeat_interleave(2, dim=1)[None, :, None, :].float()
    # A transposed view, as an attention input can be: the result must be laid out like it.
    x = torch.randn(b, h, s, d).transpose(1, 2)
    got = _apply_rope(x, cos, sin)
    pairs = torch.view_as_complex(x.double().reshape(b, s, h, d // 2, 2).contiguous())
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # e^{i theta}
    want = torch.view_as_real(pairs * rotation).reshape(b, s, h, d)
    assert got.dtype == x.dtype and got.stride() == x.stride()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # bf16 in, bf16 out: the fp32 products rounded once.
    got_bf16 = _apply_rope(x.bfloat16(), cos, sin)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.double(), _apply_rope(x.bfloat16().float(), cos, sin).bfloat16().double())


def test_rope_has_the_bits_of_the_stacked_form_forward_and_backward():
    # The form before session 33: the same products, stacked and rounded once by type_as.
    def stacked(x, cos, sin):
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[..., 0::2], sin[..., 1::2]
        return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)

    torch.manual_seed(1)
    cos, sin = torch.randn(1, 6, 1, 12), torch.randn(1, 6, 1, 12)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 6, 3, 12, dtype=dtype)
        assert torch.equal(_apply_rope(x, cos, sin), stacked(x, cos, sin))
    x = torch.randn(2, 6, 3, 12, requires_grad=True)
    grad_out = torch.randn(2, 6, 3, 12)
    (g_new,) = torch.autograd.grad(_apply_rope(x, cos, sin), x, grad_out)
    (g_old,) = torch.autograd.grad(stacked(x, cos, sin), x, grad_out)
    assert torch.equal(g_new, g_old)
