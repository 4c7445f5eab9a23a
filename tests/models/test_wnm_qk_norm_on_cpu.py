"""The q/k RMS norm under autocast keeps PyTorch's fused kernel and computes the norm of the same numbers."""

import torch
from torch.profiler import ProfilerActivity, profile

from verl_omni.models.wnm.attention import _qk_norm

torch.set_num_threads(1)


def _norm(dim: int = 16) -> torch.nn.RMSNorm:
    norm = torch.nn.RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, dim))
    return norm


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_outside_autocast_it_is_the_norm_bit_for_bit():
    norm, x = _norm(), torch.randn(2, 5, 16)
    assert torch.equal(_qk_norm(norm, x), norm(x))
    xb = x.bfloat16()  # no autocast: the module's own behaviour, whatever the dtypes
    assert torch.equal(_qk_norm(norm, xb), norm(xb))


def test_under_autocast_bf16_activations_take_the_fused_kernel_and_stay_bf16():
    norm = _norm()
    x = torch.randn(2, 5, 16).bfloat16()  # what a projection returns under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _qk_norm(norm, x)
        assert "aten::_fused_rms_norm" in _ops(lambda: _qk_norm(norm, x))
        assert "aten::_fused_rms_norm" not in _ops(lambda: norm(x))  # the mixed-dtype call composes the norm
    assert out.dtype == torch.bfloat16
    # By hand, in float64: x / sqrt(mean(x^2) + eps) * w, rounded once to bfloat16.
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    torch.testing.assert_close(out, ref.bfloat16(), atol=0, rtol=2**-8)
