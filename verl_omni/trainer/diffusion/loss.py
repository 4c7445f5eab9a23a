"""The layer-credited clipped surrogate, its KL term and its metrics (DESIGN 6).

For every stored window step and layer ``g``, with ``r = exp(logp_g - logp_old_g)``::

    l[i, j, g] = max(-A[i, g] r, -A[i, g] clip(r, 1 - eps, 1 + eps))
    L = sum_g w_g mean_{i, j} l[i, j, g] / sum_g w_g  +  beta * KL

``KL`` is the weighted per-layer mean of the k3 estimator ``exp(d) - d - 1`` with ``d = logp_ref - logp``
(non-negative, unbiased for KL(pi || pi_ref) on samples from pi).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, NUM_LAYERS, LayerLayoutError
from verl_omni.trainer.diffusion.config import LossConfig


@dataclass
class LossOutput:
    """Result of :func:`clipped_layer_loss`.

    Attributes:
        loss: Scalar to back-propagate.
        policy_loss: Scalar, surrogate part.
        kl: Scalar, weighted KL estimate against the reference (0 when disabled).
        layer_loss: ``[9]`` surrogate per layer (detached).
        metrics: Floats for logging.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    layer_loss: torch.Tensor
    metrics: dict[str, float]


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.shape[-1] != NUM_LAYERS:
        raise LayerLayoutError(f"{name} last dim must be {NUM_LAYERS} layers {list(LAYER_NAMES)}, got {t.shape[-1]}")
    finite = torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
    if not bool(finite.all()):
        rows = torch.nonzero(~finite).squeeze(1).tolist()
        raise ValueError(f"{name} holds NaN/inf in rows {rows[:10]}; refusing to build a loss from it")


def clipped_layer_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
    logp_ref: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped per-layer surrogate over the stored SDE-window steps.

    Args:
        logp: ``[N, W, 9]`` log-probs under the current weights (with grad).
        logp_old: ``[N, W, 9]`` log-probs stored by the rollout.
        advantages: ``[N, 9]`` per-layer advantages.
        config: Loss options.
        logp_ref: ``[N, W, 9]`` log-probs under the reference policy; needed when ``kl_beta > 0``.

    Returns:
        :class:`LossOutput`.
    """
    if logp.ndim != 3:
        raise ValueError(f"logp must be [N, W, {NUM_LAYERS}], got {list(logp.shape)}")
    n, w, _ = logp.shape
    _check("logp", logp, (n, w, NUM_LAYERS))
    _check("logp_old", logp_old, (n, w, NUM_LAYERS))
    _check("advantages", advantages, (n, NUM_LAYERS))
    if config.kl_beta > 0:
        if logp_ref is None:
            raise ValueError("LossConfig.kl_beta > 0 needs logp_ref (reference-policy log-probs)")
        _check("logp_ref", logp_ref, (n, w, NUM_LAYERS))

    weights = config.weight_vector().to(device=logp.device, dtype=logp.dtype)
    adv = advantages.to(device=logp.device, dtype=logp.dtype).unsqueeze(1)  # [N, 1, 9]
    log_ratio = logp - logp_old.to(logp.dtype).detach()
    ratio = torch.exp(log_ratio)
    eps = config.clip_eps
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps, 1.0 + eps)
    per_elem = torch.maximum(unclipped, clipped)  # [N, W, 9]
    layer_loss = per_elem.mean(dim=(0, 1))  # [9]
    policy_loss = (weights * layer_loss).sum() / weights.sum()
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if config.kl_beta > 0:
        d = logp_ref.to(logp.dtype).detach() - logp
        layer_kl = (torch.exp(d) - d - 1.0).mean(dim=(0, 1))
        kl = (weights * layer_kl).sum() / weights.sum()
    loss = policy_loss + config.kl_beta * kl

    with torch.no_grad():
        r = ratio.detach()
        is_clipped = (clipped > unclipped).detach()
        metrics: dict[str, float] = {
            "actor/policy_loss": float(policy_loss),
            "actor/kl_ref": float(kl),
            "actor/clip_fraction": float(is_clipped.to(torch.float64).mean()),
            "actor/approx_kl": float((0.5 * log_ratio.detach().double() ** 2).mean()),
        }
        for g, name in enumerate(LAYER_NAMES):
            metrics[f"actor/ratio_mean/{name}"] = float(r[..., g].double().mean())
            metrics[f"actor/ratio_min/{name}"] = float(r[..., g].min())
            metrics[f"actor/ratio_max/{name}"] = float(r[..., g].max())
            metrics[f"actor/clip_fraction/{name}"] = float(is_clipped[..., g].to(torch.float64).mean())
            metrics[f"actor/layer_loss/{name}"] = float(layer_loss[g])
    return LossOutput(loss=loss, policy_loss=policy_loss, kl=kl, layer_loss=layer_loss.detach(), metrics=metrics)


def logprob_consistency_metrics(logp_rollout: torch.Tensor, logp_recomputed: torch.Tensor) -> dict[str, float]:
    """``|logp_rollout - logp_recomputed|`` per window position (mean and max over rollouts and layers).

    Args:
        logp_rollout, logp_recomputed: ``[N, W, 9]``.

    Returns:
        ``{"rollout/logp_abs_diff/step_<j>/mean", ".../max", "rollout/logp_abs_diff/max"}``.
    """
    if logp_rollout.shape != logp_recomputed.shape or logp_rollout.ndim != 3:
        raise ValueError(
            f"log-prob tensors must both be [N, W, 9], got {list(logp_rollout.shape)} and {list(logp_recomputed.shape)}"
        )
    diff = (logp_rollout.detach().double().cpu() - logp_recomputed.detach().double().cpu()).abs()
    out = {}
    for j in range(diff.shape[1]):
        out[f"rollout/logp_abs_diff/step_{j}/mean"] = float(diff[:, j].mean())
        out[f"rollout/logp_abs_diff/step_{j}/max"] = float(diff[:, j].max())
    out["rollout/logp_abs_diff/max"] = float(diff.max())
    return out
