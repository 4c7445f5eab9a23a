"""Random DiT inputs shared by the model tests: one forward's ``(x, actions, sigma, context)`` at a config's dims."""

from __future__ import annotations

import torch

from verl_omni.models.wnm import WNMContext


def random_dit_inputs(cfg, b: int = 2, seed: int = 0):
    """``(x [B, *target], a [B, steps, channels], s [B], WNMContext)`` from a seeded generator, fp32, all attended."""
    g = torch.Generator().manual_seed(seed)
    ctx = WNMContext(
        history_latents=torch.randn(b, *cfg.history_latent_shape, generator=g),
        encoder_tokens=torch.randn(b, cfg.context_tokens, cfg.dim, generator=g),
        encoder_mask=torch.ones(b, cfg.context_tokens, dtype=torch.bool),
    )
    x = torch.randn(b, *cfg.target_latent_shape, generator=g)
    a = torch.randn(b, cfg.action_steps, cfg.action_channels, generator=g)
    return x, a, torch.rand(b, generator=g), ctx


def cuda_bf16_dit_inputs(cfg, b: int = 3, seed: int = 0):
    """:func:`random_dit_inputs` on CUDA with bf16 latents, actions and context tokens (the GPU tests' rollout)."""
    x, a, s, ctx = random_dit_inputs(cfg, b=b, seed=seed)
    ctx = WNMContext(
        ctx.history_latents.cuda().bfloat16(), ctx.encoder_tokens.cuda().bfloat16(), ctx.encoder_mask.cuda()
    )
    return x.cuda().bfloat16(), a.cuda().bfloat16(), s.cuda(), ctx
