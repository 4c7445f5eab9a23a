"""Recomputing stored window transitions under unchanged weights gives ratio exactly 1 (CPU, fp32)."""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_shared import NativeRolloutBackend, NonFiniteError, RolloutRequest, SamplerConfig
from verl_omni.trainer.diffusion import recompute_layer_logprobs, recompute_results_logprobs


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_2d"))
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    ctx = model.encode_context(frames, ["go forward", "stop near the sofa"])
    sampler = SamplerConfig(num_steps=3, window_strategy="random", window_size=2, window_range=(0, 2))
    backend = NativeRolloutBackend.from_model(model, sampler)
    reqs = [
        RolloutRequest(s, stratum=k, branch=1, step=3, seed=1, context_row=r)
        for r, s in enumerate("ab")
        for k in (0, 1)
    ]
    return model, ctx, backend, backend.generate(reqs, ctx)


def test_ratio_exactly_one_and_gradients_flow(rollout):
    model, ctx, backend, res = rollout
    model.transformer.zero_grad()
    logp = recompute_results_logprobs(model.transformer, backend.layout, res, ctx, chunk_size=1)
    assert torch.equal(logp, res.logprobs)
    assert torch.equal(torch.exp(logp - res.logprobs), torch.ones_like(logp))
    logp.sum().backward()
    grads = [p.grad for p in model.transformer.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_recompute_refuses_broken_inputs(rollout):
    model, ctx, backend, res = rollout
    states = res.window_states.clone()
    states[1, 0, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=res.request_ids[1]):
        recompute_layer_logprobs(
            model.transformer,
            backend.layout,
            states,
            res.window_steps,
            res.noise_coefs,
            res.sigmas,
            ctx,
            res.context_rows,
            request_ids=res.request_ids,
        )
    with pytest.raises(ValueError, match="consecutive"):
        recompute_layer_logprobs(
            model.transformer,
            backend.layout,
            res.window_states,
            res.window_steps.flip(1),
            res.noise_coefs,
            res.sigmas,
            ctx,
            res.context_rows,
        )


def test_each_chunk_counts_its_attended_tokens_once(rollout, monkeypatch):
    """The W forwards of a chunk get the chunk's attended-token range, counted once per chunk (one host read),
    not once per forward; the log-probs are unchanged."""
    from verl_omni.models.wnm.context import WNMContext

    model, ctx, backend, res = rollout
    assert ctx.encoder_mask is not None and not bool(ctx.encoder_mask.all())  # padded instructions: a real mask
    counts = []
    real = WNMContext.with_attended_range

    def counting(self):
        counts.append(self.batch_size)
        return real(self)

    monkeypatch.setattr(WNMContext, "with_attended_range", counting)
    seen = []

    def velocity_fn(video, actions, sigma, context):
        seen.append(context.encoder_attended_range)
        return model.transformer(video, actions, sigma, context)

    with torch.no_grad():
        logp = recompute_results_logprobs(velocity_fn, backend.layout, res, ctx, chunk_size=1)
    assert torch.equal(logp, res.logprobs)
    n, w = res.window_steps.shape
    assert counts == [1] * n  # chunk_size 1: one count per row's chunk
    assert len(seen) == n * w
    # By hand from the mask: each forward's range is its one row's count of attended tokens (lo == hi).
    per_row = ctx.encoder_mask.sum(dim=1)[res.context_rows].tolist()
    by_chunk = [r for r in per_row for _ in range(w)]
    assert sorted(seen) == sorted((c, c) for c in by_chunk)
