"""Which denoising steps form the SDE window of a training step.

Steps inside the window are sampled with the SDE and carry log-probs; the others are Euler steps. The
window is ``window_size`` consecutive steps inside ``[lo, hi)`` and is the same for every rollout of a
training step, so the trainer can batch them:

- ``fixed``: starts at ``window_start``;
- ``random``: start drawn uniformly among the valid starts from the ``("window", run_seed, step)`` generator;
- ``progressive``: a sliding window that starts at ``lo`` and moves one step later every
  ``progressive_interval`` training steps, wrapping back to ``lo`` after the last valid start.
"""

from __future__ import annotations

import torch

from verl_omni.pipelines.wnm_shared.rng import generator_for

WINDOW_STRATEGIES = ("fixed", "random", "progressive")


def window_steps(
    strategy: str,
    window_size: int,
    window_range: tuple[int, int],
    run_seed: int,
    step: int,
    window_start: int = 0,
    progressive_interval: int = 1,
) -> tuple[int, ...]:
    """Denoising-step indices of the SDE window.

    Args:
        strategy: ``fixed``, ``random`` or ``progressive``.
        window_size: Number of consecutive SDE steps ``W`` >= 1.
        window_range: ``(lo, hi)``: the window lies in ``[lo, hi)``.
        run_seed, step: Identify the training step (for ``random`` and ``progressive``).
        window_start: First step for ``fixed``.
        progressive_interval: Training steps per one-step shift for ``progressive``.

    Returns:
        ``W`` increasing step indices.
    """
    lo, hi = window_range
    n_starts = hi - lo - window_size + 1
    if n_starts < 1:
        raise ValueError(f"window_size {window_size} does not fit in window_range {window_range}")
    if strategy == "fixed":
        start = window_start
    elif strategy == "random":
        gen = generator_for("window", run_seed, step)
        start = lo + int(torch.randint(n_starts, (1,), generator=gen).item())
    elif strategy == "progressive":
        start = lo + (step // progressive_interval) % n_starts
    else:
        raise ValueError(f"window strategy must be one of {WINDOW_STRATEGIES}, got {strategy!r}")
    if not lo <= start <= hi - window_size:
        raise ValueError(f"window start {start} outside [{lo}, {hi - window_size}]")
    return tuple(range(start, start + window_size))
