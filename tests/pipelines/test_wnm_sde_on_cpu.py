"""SDE step and log-probs against independent float64 references (scipy, torch.distributions)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, JointLayout, LayerTable
from verl_omni.pipelines.wnm_shared.schedule import shifted_sigmas, sigmas_to_timesteps
from verl_omni.pipelines.wnm_shared.sde import (
    euler_step,
    noise_coefficient,
    sde_mean,
    sde_step,
    transition_layer_logprob,
)

LAYOUT = JointLayout((2, 2, 3, 3))  # 36 video dims + 128 action dims


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_shifted_sigmas_by_hand():
    # u = [1, 0.5, 0]; s(0.5) = 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert shifted_sigmas(2, 3.0).tolist() == [1.0, 0.75, 0.0]
    s = shifted_sigmas(4, 1.0)
    assert s.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sigmas_to_timesteps(s).tolist() == [1000.0, 750.0, 500.0, 250.0]
    s10 = shifted_sigmas(10, 5.0)
    assert s10[0] == 1.0 and s10[-1] == 0.0 and bool((s10[1:] < s10[:-1]).all())
    with pytest.raises(ValueError, match="shift"):
        shifted_sigmas(10, 0.0)


def test_dance_logprob_equals_scipy_gaussian_logpdf():
    table = LayerTable(LAYOUT)
    d = LAYOUT.numel
    x, v, eps = _rand(3, d, seed=1), _rand(3, d, seed=2), _rand(3, d, seed=3)
    s, s_next, eta = 0.8, 0.55, 0.3
    x_next, mu = sde_step(x, v, eps, s, s_next, eta)
    logp = transition_layer_logprob(x, v, x_next, s, s_next, eta, table)
    # float64 reference straight from the sde_step formula
    xd, vd = x.double().numpy(), v.double().numpy()
    h = s - s_next
    mu_ref = xd - h * vd - h * (eta**2 / (2 * s)) * (xd + (1 - s) * vd)
    std = eta * math.sqrt(h)
    np.testing.assert_allclose(mu.numpy(), mu_ref, rtol=1e-5, atol=1e-6)
    dens = norm.logpdf(x_next.double().numpy(), loc=mu_ref, scale=std)
    ref = np.stack([dens[:, table.indices(n).numpy()].mean(axis=1) for n in LAYER_NAMES], axis=1)
    np.testing.assert_allclose(logp.double().numpy(), ref, rtol=1e-5, atol=1e-4)
    # the sample really is mu + std * eps
    np.testing.assert_allclose((x_next - mu).numpy(), std * eps.numpy(), rtol=1e-5, atol=1e-6)


def test_eta_zero_is_exactly_euler():
    x, v = _rand(2, 50, seed=4), _rand(2, 50, seed=5)
    s, s_next = 0.6, 0.35
    hand = x - torch.tensor(s - s_next, dtype=torch.float32) * v
    assert torch.equal(sde_mean(x, v, s, s_next, 0.0), hand)
    assert torch.equal(euler_step(x, v, s, s_next), hand)
    g = noise_coefficient("dance", 0.0, torch.tensor([1.0, 0.6, 0.35, 0.0], dtype=torch.float64), 1)
    assert g == 0.0 and torch.equal(sde_mean(x, v, s, s_next, g), hand)
    with pytest.raises(ValueError, match="g > 0"):
        sde_step(x, v, x, s, s_next, 0.0)


def _flow_grpo_reference(x, v, sigma, sigma_next, sigma_1, a):
    """Flow-GRPO's published sampler, written in its own (dt < 0) arrangement, float64."""
    dt = sigma_next - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_flow_grpo_matches_published_formula(step):
    sigmas = torch.tensor([1.0, 0.75, 0.4, 0.1, 0.0], dtype=torch.float64)
    a = 0.7
    g = noise_coefficient("flow_grpo", a, sigmas, step)
    # hand values: step 0 uses s_1 = 0.75 in the denominator: 0.7 * sqrt(1 / 0.25) = 1.4
    hand_g = {0: 1.4, 1: 0.7 * math.sqrt(0.75 / 0.25), 2: 0.7 * math.sqrt(0.4 / 0.6)}[step]
    assert g == pytest.approx(hand_g, rel=1e-12)
    table = LayerTable(LAYOUT)
    x, v, eps = _rand(2, LAYOUT.numel, seed=6), _rand(2, LAYOUT.numel, seed=7), _rand(2, LAYOUT.numel, seed=8)
    s, s_next = float(sigmas[step]), float(sigmas[step + 1])
    x_next, mu = sde_step(x, v, eps, s, s_next, g)
    mean_ref, std_ref = _flow_grpo_reference(x.double(), v.double(), s, s_next, 0.75, a)
    torch.testing.assert_close(mu.double(), mean_ref, rtol=1e-5, atol=1e-5)
    dist = torch.distributions.Normal(mean_ref, torch.full_like(mean_ref, std_ref))
    dens = dist.log_prob(x_next.double())
    ref = torch.stack([dens[:, table.indices(n)].mean(1) for n in LAYER_NAMES], 1)
    got = transition_layer_logprob(x, v, x_next, s, s_next, g, table)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-4)


def test_noise_coefficient_refusals():
    sigmas = shifted_sigmas(4, 1.0)
    with pytest.raises(ValueError, match="sde_type"):
        noise_coefficient("ddim", 0.3, sigmas, 0)
    with pytest.raises(ValueError, match="outside"):
        noise_coefficient("dance", 0.3, sigmas, 4)
