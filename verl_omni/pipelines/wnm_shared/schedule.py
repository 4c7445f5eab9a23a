"""Shifted rectified-flow sigma schedule.

``s_0 = 1 > s_1 > ... > s_K = 0``: uniform points ``u_i = 1 - i / K`` warped by the usual time shift
``s = shift * u / (1 + (shift - 1) * u)`` (shift > 1 spends more steps at high noise). Timesteps follow
the Wan/SD3 convention ``t = 1000 * s``.
"""

from __future__ import annotations

import torch

TIMESTEP_SCALE = 1000.0


def shifted_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """Sigma schedule of ``num_steps`` denoising steps.

    Args:
        num_steps: ``K`` >= 1.
        shift: Time shift > 0 (1.0 = uniform).

    Returns:
        ``[K + 1]`` float64, strictly decreasing from exactly 1.0 to exactly 0.0.
    """
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    u = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float64)
    s = shift * u / (1.0 + (shift - 1.0) * u)
    # Pin the ends: the formula gives them up to rounding, the SDE needs them exact.
    s[0], s[-1] = 1.0, 0.0
    return s


def sigmas_to_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """``t = 1000 * s`` for the ``K`` steps that are evaluated (the final 0 is not): ``[K]`` float64."""
    return sigmas[:-1].to(torch.float64) * TIMESTEP_SCALE
