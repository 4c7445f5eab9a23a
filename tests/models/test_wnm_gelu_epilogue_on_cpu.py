"""Where the feed-forward's GELU epilogue must not run: off CUDA (fp32 and bf16) and under autograd.

PyTorch's CPU ``_addmm_activation`` computes the exact GELU, not Wan's tanh form, and the op has no autograd
formula, so these paths must be exactly the diffusers module (bit for bit). The CUDA path itself is checked in
``test_wnm_gelu_epilogue_on_gpu.py``, with the CUDA fp32 path that must stay unchanged.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention import FeedForward

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm import block as wnm_block


def test_feed_forward_off_cuda_is_the_module_bit_for_bit():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ffn = FeedForward(32, inner_dim=96, activation_fn="gelu-approximate").to(dtype)
        x = torch.randn(2, 7, 32, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(wnm_block._feed_forward(ffn, x), ffn(x))
        got = wnm_block._feed_forward(ffn, x.requires_grad_())
        assert got.grad_fn is not None and torch.equal(got, ffn(x))


@pytest.mark.parametrize("name", ["gelu_epilogue", "norm_rope_kernel"])
def test_model_switch_reaches_every_block_and_refuses_non_bools(name):
    # The model's two on/off inference fast paths (the GELU epilogue; the q/k norm + RoPE kernel, rms_norm_rope.py).
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=3))
    assert getattr(model, name) is True and all(getattr(b, name) for b in model.blocks)
    setattr(model, name, False)
    assert getattr(model, name) is False and not any(getattr(b, name) for b in model.blocks)
    with pytest.raises(ValueError, match=f"{name} must be True or False, got 'yes'"):
        setattr(model, name, "yes")
