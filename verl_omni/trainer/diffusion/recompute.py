"""Per-layer log-probs of stored SDE-window transitions under the current weights.

This is what the actor computes in training. It reuses the rollout's own pieces
(:func:`~verl_omni.pipelines.wnm_shared.velocity.joint_velocity` and
:func:`~verl_omni.pipelines.wnm_shared.sde.transition_layer_logprob`), so with unchanged weights, the same
dtype and the same chunking the ratio ``exp(logp - logp_old)`` is exactly 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_omni.pipelines.wnm_shared.backend import RolloutResults
from verl_omni.pipelines.wnm_shared.layers import JointLayout, LayerTable, check_layer_names
from verl_omni.pipelines.wnm_shared.sde import transition_layer_logprob
from verl_omni.pipelines.wnm_shared.velocity import (
    FiniteChecks,
    VelocityFn,
    chunk_slices,
    counted_context,
    joint_velocity,
)


def recompute_layer_logprobs(
    velocity_fn: VelocityFn,
    layout: JointLayout,
    window_states: torch.Tensor,
    window_steps: torch.Tensor,
    noise_coefs: torch.Tensor,
    sigmas: torch.Tensor,
    contexts,
    context_rows: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    chunk_size: int | None = 1,
    request_ids: Sequence[str] | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Recomputes the per-layer log-probs of window transitions (differentiable w.r.t. the DiT).

    Args:
        velocity_fn: The DiT with current weights.
        layout: Joint-latent layout the transitions were sampled with.
        window_states: ``[N, W + 1, D]`` stored latents (``x_i`` of each window step, then the last ``x_{i+1}``).
        window_steps: ``[N, W]`` int64 denoising steps (consecutive per row).
        noise_coefs: ``[N, W]`` ``g_i`` used by the rollout.
        sigmas: ``[K + 1]`` schedule used by the rollout.
        contexts: ``WNMContext``-like with the prompts' rows.
        context_rows: ``[N]`` row of each transition's prompt in ``contexts``.
        dtype: DiT compute dtype (must match the rollout's for exact ratios).
        device: Where to compute.
        chunk_size: Rows per DiT call; 1 reproduces the deterministic rollout bit for bit on CPU.
        request_ids: Names for error messages (default ``row <n>``).
        check_values: Check velocities and log-probs for NaN/inf.

    Returns:
        ``[N, W, 9]`` fp32 per-layer log-probs, on ``device``.
    """
    n, w_plus_1, d = window_states.shape
    w = w_plus_1 - 1
    if d != layout.numel:
        raise ValueError(f"window_states last dim {d} != joint-latent size {layout.numel} of this layout")
    if tuple(window_steps.shape) != (n, w) or tuple(noise_coefs.shape) != (n, w) or tuple(context_rows.shape) != (n,):
        raise ValueError(
            f"shape mismatch: window_states {list(window_states.shape)}, window_steps {list(window_steps.shape)}, "
            f"noise_coefs {list(noise_coefs.shape)}, context_rows {list(context_rows.shape)}"
        )
    num_steps = sigmas.numel() - 1
    if w < 1 or int(window_steps.min()) < 0 or int(window_steps.max()) >= num_steps:
        raise ValueError(f"window_steps must lie in [0, {num_steps}) with W >= 1")
    if w > 1 and not bool((window_steps[:, 1:] - window_steps[:, :-1] == 1).all()):
        raise ValueError("window_steps must be consecutive in every row (the stored states chain)")
    ids = list(request_ids) if request_ids is not None else [f"row {i}" for i in range(n)]
    table = LayerTable(layout)
    device = torch.device(device)
    ctx = contexts.to(device, dtype)
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault((tuple(window_steps[i].tolist()), tuple(noise_coefs[i].tolist())), []).append(i)
    out: list[torch.Tensor | None] = [None] * n
    for (steps, coefs), idx in groups.items():
        for sl in chunk_slices(len(idx), chunk_size):
            rows = idx[sl]
            sel = torch.tensor(rows, dtype=torch.int64)
            # Counted once for the chunk's W forwards (no host read inside each).
            chunk_ctx = counted_context(ctx.select(context_rows[sel].to(device)))
            states = window_states[sel].to(device=device, dtype=torch.float32)
            chunk_ids = [ids[i] for i in rows]
            per_step = []
            checks = FiniteChecks(chunk_ids)  # read once per chunk, not once per step (no sync between forwards)
            for j, (step, g) in enumerate(zip(steps, coefs, strict=True)):
                s, s_next = float(sigmas[step]), float(sigmas[step + 1])
                x, x_next = states[:, j], states[:, j + 1]
                v = joint_velocity(velocity_fn, layout, x, s, chunk_ctx, dtype)
                if check_values:
                    checks.add(v, "velocity", step)
                per_step.append(transition_layer_logprob(x, v, x_next, s, s_next, g, table))
            logp = torch.stack(per_step, 1)
            if check_values:
                checks.add(logp, "log-probs", None)
            checks.raise_first()
            for k, i in enumerate(rows):
                out[i] = logp[k]
    return torch.stack(out)


def recompute_results_logprobs(
    velocity_fn: VelocityFn,
    layout: JointLayout,
    results: RolloutResults,
    contexts,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    chunk_size: int | None = 1,
) -> torch.Tensor:
    """:func:`recompute_layer_logprobs` for a :class:`RolloutResults` (``[R, W, 9]``)."""
    check_layer_names(results.layer_names, "rollout results")
    return recompute_layer_logprobs(
        velocity_fn,
        layout,
        results.window_states,
        results.window_steps,
        results.noise_coefs,
        results.sigmas,
        contexts,
        results.context_rows,
        dtype=dtype,
        device=device,
        chunk_size=chunk_size,
        request_ids=results.request_ids,
    )
