"""Clipped per-layer surrogate, KL term and metrics against hand arithmetic."""

import math

import pytest
import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.trainer.diffusion import LossConfig, clipped_layer_loss, logprob_consistency_metrics


def test_clipped_loss_by_hand():
    # two rollouts, one window step; visual: A = +1 with ratio 1.2, A = -1 with ratio 0.8; other layers ratio 1
    logp_old = torch.zeros(2, 1, 9)
    logp = torch.zeros(2, 1, 9)
    logp[0, 0, 0] = math.log(1.2)
    logp[1, 0, 0] = math.log(0.8)
    adv = torch.zeros(2, 9)
    adv[:, 0] = torch.tensor([1.0, -1.0])
    adv[:, 1] = torch.tensor([0.5, 2.0])  # nav_1 at ratio 1: loss = -mean(A) = -1.25
    cfg = LossConfig(clip_eps=0.1, layer_weights={"visual": 2.0})
    out = clipped_layer_loss(logp.requires_grad_(), logp_old, adv, cfg)
    # visual: max(-1.2, -1.1) = -1.1 and max(0.8, 0.9) = 0.9 -> mean -0.1
    assert float(out.layer_loss[0]) == pytest.approx(-0.1, abs=1e-6)
    assert float(out.layer_loss[1]) == pytest.approx(-1.25, abs=1e-6)
    expected = (2.0 * -0.1 + 1.0 * -1.25) / (2.0 + 8.0)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6)
    m = out.metrics
    assert m["actor/clip_fraction/visual"] == 1.0 and m["actor/clip_fraction/nav_1"] == 0.0
    assert m["actor/ratio_max/visual"] == pytest.approx(1.2, rel=1e-6)
    assert m["actor/ratio_min/visual"] == pytest.approx(0.8, rel=1e-6)
    assert m["actor/ratio_mean/visual"] == pytest.approx(1.0, rel=1e-6)
    assert m["actor/clip_fraction"] == pytest.approx(2 / 18)
    assert m["actor/approx_kl"] == pytest.approx(0.5 * (math.log(1.2) ** 2 + math.log(0.8) ** 2) / 18, rel=1e-5)


def test_gradient_at_ratio_one_is_minus_weighted_advantage():
    n, w = 3, 2
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(n, w, 9, generator=gen)
    logp = old.clone().requires_grad_()
    adv = torch.randn(n, 9, generator=gen)
    weights = {name: float(i + 1) for i, name in enumerate(LAYER_NAMES)}
    out = clipped_layer_loss(logp, old, adv, LossConfig(layer_weights=weights))
    out.loss.backward()
    wv = torch.arange(1, 10, dtype=torch.float32)
    expected = (-adv[:, None, :] * wv / (wv.sum() * n * w)).expand(n, w, 9)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-7)
    assert out.metrics["actor/clip_fraction"] == 0.0


def test_kl_term_k3_by_hand():
    logp = torch.zeros(1, 1, 9)
    old = torch.zeros(1, 1, 9)
    ref = torch.full((1, 1, 9), 0.5)
    out = clipped_layer_loss(logp, old, torch.zeros(1, 9), LossConfig(kl_beta=0.2), logp_ref=ref)
    k3 = math.exp(0.5) - 0.5 - 1
    assert float(out.kl) == pytest.approx(k3, rel=1e-6)
    assert float(out.loss) == pytest.approx(0.2 * k3, rel=1e-6)
    with pytest.raises(ValueError, match="needs logp_ref"):
        clipped_layer_loss(logp, old, torch.zeros(1, 9), LossConfig(kl_beta=0.2))


def test_non_finite_inputs_and_bad_config_are_refused():
    logp = torch.zeros(2, 1, 9)
    logp[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"logp holds NaN/inf in rows \[1\]"):
        clipped_layer_loss(logp, torch.zeros(2, 1, 9), torch.zeros(2, 9), LossConfig())
    with pytest.raises(ValueError, match="LossConfig.layer_weights: unknown"):
        LossConfig(layer_weights={"nav_9": 1.0})
    with pytest.raises(ValueError, match="LossConfig.clip_eps"):
        LossConfig(clip_eps=0.0)


def test_logprob_consistency_by_hand():
    a = torch.zeros(2, 2, 9)
    b = torch.zeros(2, 2, 9)
    b[0, 1, 4] = 0.25
    b[1, 1, 0] = -0.75
    m = logprob_consistency_metrics(a, b)
    assert m["rollout/logp_abs_diff/step_0/max"] == 0.0
    assert m["rollout/logp_abs_diff/step_1/max"] == 0.75
    assert m["rollout/logp_abs_diff/step_1/mean"] == pytest.approx(1.0 / 18)
