"""``rms_norm_rope``: the fused q/k RMS norm + RoPE Triton kernel, run on the CPU by Triton's interpreter.

The kernel is meant for CUDA (``test_wnm_rms_norm_rope_on_gpu.py`` runs it there, eager and compiled). Triton's
interpreter (``TRITON_INTERPRET=1``) executes the same kernel source with NumPy, so its indexing, masking, strides
and arithmetic are checked here against an independent float64 computation of the formula: the mean of squares
over the whole width, times the weight, then each (even, odd) pair rotated by its angle.

Error bound (bf16/fp16 unit roundoff ``u``, rounding to nearest): the normalised pair is rounded once (``u``
each), the rotation with ``|cos|, |sin| <= 1`` carries at most ``u (|e| + |o|)`` of that, and the store rounds
once more, at most ``u (|e| + |o|)``; so ``|got - exact| <= 2 u (|e| + |o|)`` plus fp32 noise, per element.
"""

from __future__ import annotations

import pytest
import torch
from triton_checks import INTERPRETED_ROUNDINGS, UNIT_ROUNDOFF, run_interpreted

from verl_omni.models.wnm import rms_norm_rope

# The kernel runs in a child process under Triton's interpreter (tests/triton_checks.py says why).
_RUNNER = """
from verl_omni.models.wnm import rms_norm_rope
def run(case):
    if case["kind"] == "op":
        return rms_norm_rope.rms_norm_rope(*case["args"])
    norm = torch.nn.RMSNorm(case["weight"].shape[0], eps=case["eps"]).to(case["weight"].dtype)
    norm.weight.copy_(case["weight"])
    return rms_norm_rope.fused_rms_norm_rope(norm, case["x"], case["rope"], case["heads"])
"""


def _interpreted(cases: dict, tmp_path) -> dict:
    return run_interpreted(_RUNNER, cases, tmp_path)


def _tables(seq_len: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Angles ``[S, head_dim / 2]`` float64 and Wan's fp32 tables ``[1, S, 1, head_dim]`` (each angle twice)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(seq_len, head_dim // 2, generator=g, dtype=torch.float64) * 6.0
    cos = angles.cos().repeat_interleave(2, dim=1)[None, :, None, :].float()
    sin = angles.sin().repeat_interleave(2, dim=1)[None, :, None, :].float()
    return angles, cos, sin


def _exact(x: torch.Tensor, weight: torch.Tensor, angles: torch.Tensor, heads: int, eps: float):
    """float64 ``(rotated [B, S, H, Dh], even/odd magnitudes |e| + |o| per element [B, S, H, Dh])``."""
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    pairs = normed.unflatten(-1, (heads, -1, 2))  # [B, S, H, Dh/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    rotated = torch.stack([even * c - odd * s, even * s + odd * c], -1).flatten(-2)
    size = (even.abs() + odd.abs()).repeat_interleave(2, dim=-1)
    return rotated, size


def test_kernel_is_the_norm_then_the_rotation_within_two_roundings(tmp_path):
    cases, expected = {}, {}
    # 5 heads x 6: 15 pairs, a width that is not a power of two, so the kernel's padded lanes are exercised.
    for dtype in (torch.bfloat16, torch.float16):
        for heads, head_dim in ((3, 8), (12, 16), (5, 6)):
            torch.manual_seed(heads)
            b, s, width = 2, 7, heads * head_dim
            x = (torch.randn(b, s, width) * 3.0).to(dtype)
            weight = (torch.rand(width) + 0.5).to(dtype)
            angles, cos, sin = _tables(s, head_dim, seed=heads + 1)
            name = f"{dtype}-{heads}x{head_dim}"
            cases[name] = {"kind": "op", "args": (x, weight, cos[0, :, 0], sin[0, :, 0], head_dim, 1e-6)}
            expected[name] = (x, weight, angles, heads, 1e-6, dtype)
    # As the last block calls it: queries from the tokens after the history only, so the tables are a view that
    # starts mid-sequence; and a projection output that is a slice of a wider buffer (row and batch strides);
    # and an fp32 weight under bf16 activations (autocast's case).
    torch.manual_seed(2)
    b, s, heads, head_dim, skip = 3, 9, 4, 8, 4
    width = heads * head_dim
    x = torch.randn(b, s + 2, width + 5).bfloat16()[:, 2:, :width]
    assert not x.is_contiguous() and x.stride(1) == width + 5
    weight = (torch.rand(width) + 0.5).float()
    angles, cos, sin = _tables(s + skip, head_dim, seed=3)
    cases["strided"] = {"kind": "op", "args": (x, weight, cos[0, skip:, 0], sin[0, skip:, 0], head_dim, 1e-5)}
    expected["strided"] = (x, weight, angles[skip:], heads, 1e-5, torch.bfloat16)

    got = _interpreted(cases, tmp_path)
    for name, (x, weight, angles, heads, eps, dtype) in expected.items():
        out = got[name]
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous(), name
        want, size = _exact(x, weight, angles, heads, eps)
        err = (out.double().unflatten(-1, (heads, -1)) - want).abs()
        bound = 2 * INTERPRETED_ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype] * size + 1e-6
        assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max().item():.3e}"


def test_fused_rms_norm_rope_matches_the_blocks_composite_path(tmp_path):
    # Against the block's own eager path (norm module, then _apply_rope), in fp16 (rounded to nearest by the
    # interpreter too): each is within 2 u of the exact value (module docstring), so within 4 u of each other.
    from verl_omni.models.wnm.attention import _apply_rope, _qk_norm

    torch.manual_seed(4)
    b, s, heads, head_dim = 2, 6, 3, 8
    norm = torch.nn.RMSNorm(heads * head_dim, eps=1e-6).half()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(heads * head_dim) + 0.5)
    x = torch.randn(b, s, heads * head_dim).half()
    angles, cos, sin = _tables(s, head_dim, seed=5)
    case = {"kind": "module", "weight": norm.weight.detach(), "eps": 1e-6, "x": x, "rope": (cos, sin), "heads": heads}
    got = _interpreted({"q": case}, tmp_path)["q"]
    with torch.no_grad():
        composite = _apply_rope(_qk_norm(norm, x).unflatten(2, (heads, -1)), cos, sin)
    assert got.shape == composite.shape == (b, s, heads, head_dim)
    _, size = _exact(x, norm.weight.detach(), angles, heads, 1e-6)
    assert bool(((got.double() - composite.double()).abs() <= 4 * UNIT_ROUNDOFF[torch.float16] * size).all())


def test_fused_rms_norm_rope_names_what_does_not_fit():
    norm = torch.nn.RMSNorm(24)
    cos = sin = torch.ones(1, 5, 1, 8)
    with pytest.raises(ValueError, match="split into 5 heads"):
        rms_norm_rope.fused_rms_norm_rope(norm, torch.ones(1, 5, 24), (cos, sin), 5)
    with pytest.raises(ValueError, match="norm width 24 does not match the projection's 32"):
        rms_norm_rope.fused_rms_norm_rope(norm, torch.ones(1, 5, 32), (cos, sin), 4)
    with pytest.raises(ValueError, match=r"rotary tables \(5, 8\) do not match 6 tokens of 8"):
        rms_norm_rope.fused_rms_norm_rope(norm, torch.ones(1, 6, 24), (cos, sin), 3)


def test_kernel_applies_only_to_gradient_free_low_precision_cuda_calls():
    weight = torch.ones(8)
    x = torch.ones(1, 2, 8, dtype=torch.bfloat16)
    # On the CPU it never applies, so CPU and fp32 forwards keep their bits.
    assert not rms_norm_rope.applies(x, weight)
    assert not rms_norm_rope.applies(x.float(), weight)
    assert not rms_norm_rope.applies(x, None)
