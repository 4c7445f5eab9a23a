"""Random DiT inputs shared by the model tests (one forward's ``(x, actions, sigma, context)`` at a config's dims),
and the GPU tests' comparison of a model with one of its inference fast paths and without it."""

from __future__ import annotations

import torch

from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer


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


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms) in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.no_grad()
def cuda_bf16_outputs_with_and_without(turn_off, num_layers: int = 2, compiled: bool = False, b: int = 3):
    """The outputs of a seeded tiny bf16 DiT on CUDA as built, then after ``turn_off(model)`` (a fast path off).

    Args:
        turn_off: Called with the model between the two forwards.
        num_layers: Blocks of the tiny model.
        compiled: ``compile_blocks()`` first (the fast path then runs inside inductor's graph).
        b: Batch size.

    Returns:
        ``(outputs with the fast path, outputs without)``, each ``(v_video, v_action)``.
    """
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=num_layers)).cuda().to(torch.bfloat16).eval()
    if compiled:
        model.compile_blocks()
    inputs = cuda_bf16_dit_inputs(model.config, b=b)
    fast = model(*inputs)
    turn_off(model)
    return fast, model(*inputs)
