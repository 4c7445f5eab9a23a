"""Where the block's inference-only fused products must not run: off CUDA, under autograd, in fp32.

PyTorch's CPU ``_addmm_activation`` computes the exact GELU, not Wan's tanh form, and neither fused op has an
autograd formula we may use in training, so these paths must be exactly the unfused modules (bit for bit). The
fused CUDA paths themselves are checked in ``test_wnm_fused_products_on_gpu.py``.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import FeedForward

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm import attention as wnm_attention
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


def test_qkv_off_cuda_is_the_three_products_bit_for_bit():
    torch.manual_seed(0)
    attn = WNMTransformer(WNMConfig.from_size("tiny", num_layers=1)).blocks[0].attn1
    x = torch.randn(2, 9, attn.to_q.in_features)
    with torch.no_grad():
        got = wnm_attention._qkv(attn, x)
    for g, layer in zip(got, (attn.to_q, attn.to_k, attn.to_v), strict=True):
        assert torch.equal(g, layer(x))
