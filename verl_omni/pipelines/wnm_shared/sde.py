"""One denoising step of the rectified-flow SDE and its per-layer log-probability.

With velocity ``v = eps - x0`` at ``(x_i, s_i)`` and ``h_i = s_i - s_{i+1} > 0``, both supported forms share

    mu_i    = x_i - h_i v - h_i (g_i^2 / (2 s_i)) (x_i + (1 - s_i) v)
    x_{i+1} = mu_i + g_i sqrt(h_i) eps,     eps ~ N(0, I)

and differ only in the noise coefficient ``g_i``:

- ``dance`` (constant coefficient): ``g_i = eta``;
- ``flow_grpo``: ``g_i = eta * sqrt(s_i / (1 - s_i))``; at ``s_i = 1`` the ``1 - s_i`` in the denominator is
  replaced by ``1 - s_1`` (as in the Flow-GRPO reference sampler), so the first step stays finite.

``g_i = 0`` is the Euler step ``x_{i+1} = x_i - h_i v``. All arithmetic is fp32; the coefficients are
computed in float64 from the schedule and rounded once, so rollout and trainer see the same numbers.
"""

from __future__ import annotations

import math

import torch

from verl_omni.pipelines.wnm_shared.layers import LayerTable

SDE_TYPES = ("dance", "flow_grpo")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def noise_coefficient(sde_type: str, eta: float, sigmas: torch.Tensor, step: int) -> float:
    """``g_i`` of denoising step ``step`` (float64 Python float).

    Args:
        sde_type: ``"dance"`` or ``"flow_grpo"``.
        eta: ``eta`` of the dance form, ``a`` of the Flow-GRPO form; >= 0.
        sigmas: ``[K + 1]`` schedule.
        step: ``i`` in ``[0, K)``.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    k = sigmas.numel() - 1
    if not 0 <= step < k:
        raise ValueError(f"step {step} outside [0, {k})")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if sde_type == "dance":
        return float(eta)
    s = float(sigmas[step])
    denom_sigma = float(sigmas[1]) if s == 1.0 else s
    if denom_sigma >= 1.0:
        raise ValueError("flow_grpo needs s_1 < 1 to bound the first step's noise")
    return float(eta) * math.sqrt(s / (1.0 - denom_sigma))


def step_coefficients(sigma: float, sigma_next: float, g: float) -> tuple[float, float, float]:
    """Scalars of one step, computed in float64: ``(h, drift_scale, std)``.

    ``drift_scale = h g^2 / (2 s)`` multiplies ``(x + (1 - s) v)``; ``std = g sqrt(h)``.
    """
    h = float(sigma) - float(sigma_next)
    if not h > 0:
        raise ValueError(f"sigmas must decrease: s_i={sigma}, s_(i+1)={sigma_next}")
    if not sigma > 0:
        raise ValueError(f"cannot step from sigma={sigma}")
    return h, h * g * g / (2.0 * float(sigma)), g * math.sqrt(h)


def sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, g: float) -> torch.Tensor:
    """``mu_i`` in fp32.

    Args:
        x: ``[B, D]`` current latents ``x_i``.
        v: ``[B, D]`` velocity at ``(x_i, s_i)``.
        sigma, sigma_next: ``s_i`` and ``s_{i+1}``.
        g: Noise coefficient ``g_i`` (0 gives the Euler step).

    Returns:
        ``[B, D]`` fp32.
    """
    x = x.float()
    v = v.float()
    h, drift_scale, _ = step_coefficients(sigma, sigma_next, g)
    mu = x - torch.tensor(h, dtype=torch.float32) * v
    if drift_scale == 0.0:
        return mu
    one_minus_s = torch.tensor(1.0 - float(sigma), dtype=torch.float32)
    return mu - torch.tensor(drift_scale, dtype=torch.float32) * (x + one_minus_s * v)


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """Deterministic step ``x_{i+1} = x_i - h_i v`` in fp32 (``[B, D]``)."""
    return sde_mean(x, v, sigma, sigma_next, 0.0)


def sde_step(
    x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor, sigma: float, sigma_next: float, g: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``x_{i+1}`` given standard-normal ``noise``.

    Args:
        x, v, noise: ``[B, D]``; ``noise`` is the standard normal draw (fp32).
        sigma, sigma_next, g: As in :func:`sde_mean`; ``g`` must be > 0.

    Returns:
        ``(x_next, mu)``, both ``[B, D]`` fp32.
    """
    if not g > 0:
        raise ValueError(f"sde_step needs g > 0 (got {g}); use euler_step outside the SDE window")
    mu = sde_mean(x, v, sigma, sigma_next, g)
    _, _, std = step_coefficients(sigma, sigma_next, g)
    return mu + torch.tensor(std, dtype=torch.float32) * noise.to(device=mu.device, dtype=torch.float32), mu


def gaussian_logdensity(x_next: torch.Tensor, mu: torch.Tensor, std: float) -> torch.Tensor:
    """Per-dimension log-density of ``N(mu, std^2)`` at ``x_next`` in fp32 (``[B, D]``), normalizer included."""
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    diff = x_next.float() - mu.float()
    inv_two_var = torch.tensor(1.0 / (2.0 * std * std), dtype=torch.float32)
    const = torch.tensor(-math.log(std) - _HALF_LOG_2PI, dtype=torch.float32)
    return const - diff * diff * inv_two_var


def transition_layer_logprob(
    x: torch.Tensor,
    v: torch.Tensor,
    x_next: torch.Tensor,
    sigma: float,
    sigma_next: float,
    g: float,
    table: LayerTable,
) -> torch.Tensor:
    """Per-layer log-probability of the transition ``x_i -> x_{i+1}`` under velocity ``v``.

    This one function serves the rollout (right after sampling ``x_{i+1}``) and the trainer (with ``v``
    recomputed under the current weights), so the two can only differ through ``v``.

    Args:
        x, v, x_next: ``[B, D]`` (any float dtype; cast to fp32).
        sigma, sigma_next, g: Step scalars (``g > 0``).
        table: Layer table of the joint latent.

    Returns:
        ``[B, 9]`` fp32: mean over each layer's dimensions of the Gaussian log-density.
    """
    mu = sde_mean(x, v, sigma, sigma_next, g)
    _, _, std = step_coefficients(sigma, sigma_next, g)
    return table.reduce_mean(gaussian_logdensity(x_next, mu, std))
