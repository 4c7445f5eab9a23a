"""The ``isolated`` history-attention option: history tokens attend only among themselves, so their per-block
keys/values are computed once per prompt and reused. Reference: the ``full`` model run with diffusers' own
attention processor under a block mask that hides target/action keys from history queries."""

import pytest
import torch

from verl_omni.data.actions import ActionLayout, ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, SamplerConfig
from verl_omni.pipelines.wnm_shared.requests import stratified_requests
from verl_omni.trainer.diffusion.recompute import recompute_results_logprobs


def _inputs(cfg, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = WNMContext(
        torch.randn(b, *cfg.history_latent_shape, generator=g),
        torch.randn(b, cfg.context_tokens, cfg.dim, generator=g),
        torch.ones(b, cfg.context_tokens, dtype=torch.bool),
    )
    x = torch.randn(b, *cfg.target_latent_shape, generator=g)
    a = torch.randn(b, cfg.action_steps, cfg.action_channels, generator=g)
    return x, a, torch.tensor([0.8, 0.3][:b]), ctx


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WNMTransformer(WNMConfig.from_size("tiny")).eval()


def _copy(model, mode):
    m = WNMTransformer(model.config)
    m.load_state_dict(model.state_dict())
    m.set_history_attention(mode)
    return m


def _masked_reference(model, x, a, s, ctx):
    """Full-sequence forward where diffusers' attn1 processor gets a mask: history rows see history columns only."""
    # The block resolves _self_attention in its own module's namespace, so that is where it is swapped.
    from verl_omni.models.wnm import block

    nh = model.sequence_layout()["history"].stop
    seq = model.config.sequence_length
    mask = torch.ones(seq, seq, dtype=torch.bool)
    mask[:nh, nh:] = False
    saved = block._self_attention
    try:
        # The last block asks queries of the target and action tokens only (queries_from): the reference attends
        # over the whole sequence and keeps those rows.
        block._self_attention = lambda attn, h, rope, prefix, backend, queries_from=0, fused_norm_rope=False: (
            attn(h, None, mask, rope)[:, queries_from:], None)  # fmt: skip
        return model(x, a, s, ctx)
    finally:
        block._self_attention = saved


def test_isolated_equals_block_masked_full_attention(model):
    x, a, s, ctx = _inputs(model.config, 2)
    iso_model = _copy(model, "isolated")
    with torch.no_grad():
        full = model(x, a, s, ctx)
        ref = _masked_reference(model, x, a, s, ctx)
        iso = iso_model(x, a, s, ctx)
        cached = iso_model(x, a, s, ctx.with_history_kv(iso_model.history_kv(ctx)))
    for got, want in zip(iso, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(cached, iso, strict=True):
        assert torch.equal(got, want)
    # The option really changes the model: target tokens no longer shape the history representation.
    assert max(float((p - q).abs().max()) for p, q in zip(iso, full, strict=True)) > 1e-5


def test_isolated_gradients_reach_every_block(model):
    m = _copy(model, "isolated")
    x, a, s, ctx = _inputs(m.config, 2, seed=3)
    v, va = m(x, a, s, ctx)
    (v.square().mean() + va.square().mean()).backward()
    for i, blk in enumerate(m.blocks):
        grad = blk.attn1.to_k.weight.grad
        assert grad is not None and float(grad.abs().sum()) > 0, f"block {i}: no gradient through history keys"


def test_refuses_unknown_mode(model):
    with pytest.raises(ValueError, match="history_attention"):
        _copy(model, "causal")


def test_rollout_with_cached_history_matches_uncached_recompute(model):
    cfg = model.config
    m = _copy(model, "isolated")
    sampler = SamplerConfig(num_steps=4, window_strategy="fixed", window_start=1, window_size=2)
    reqs = stratified_requests(["A", "B"], 0, 0, 2, 2)
    _, _, _, ctx = _inputs(cfg, 2, seed=5)
    backend = NativeRolloutBackend(
        m,
        tuple(cfg.target_latent_shape),
        ActionNormalization.identity(),
        sampler,
        NativeBackendConfig(),
        ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks),
    )
    res = backend.generate(reqs, ctx)
    # The trainer recomputes the stored transitions without a cache; the log-probs agree.
    with torch.no_grad():
        logp = recompute_results_logprobs(m, backend.layout, res, ctx)
    torch.testing.assert_close(logp, res.logprobs, rtol=1e-5, atol=1e-4)
