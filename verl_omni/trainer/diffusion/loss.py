"""The layer-credited clipped surrogate, its KL term and its metrics (docs/design.md, "One Stage-III step").

For every stored window step and layer ``g``, with ``r = exp(logp_g - logp_old_g)``::

    l[i, j, g] = max(-A[i, g] r, -A[i, g] clip(r, 1 - eps, 1 + eps))
    L = sum_g w_g mean_{i, j} l[i, j, g] / sum_g w_g  +  beta * KL

``KL`` is the weighted per-layer mean of the k3 estimator ``exp(d) - d - 1`` with ``d = logp_ref - logp``
(non-negative, unbiased for KL(pi || pi_ref) on samples from pi).

**Loss mask.** With ``loss_mask [N, 9]`` (``AdvantageResult.loss_mask``: False for the chunks after a rollout's
STOP or first hard collision), a dead entry contributes nothing to the surrogate, the KL or the ratio/clip
metrics: ``mean_{i, j}`` becomes ``sum over live (i, j) / (N W)``. The denominator stays the number of
rollouts times window steps rather than the number of live entries: each live rollout's gradient is then the
same whatever its siblings did (a layer that is live in few rollouts is not up-weighted per rollout, it just
carries fewer decisions), and the sum over micro-batches weighted by their share of the mini-batch (how the
actor accumulates) equals the loss of the whole mini-batch, which a per-micro-batch live-count mean would not.
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
    loss_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped per-layer surrogate over the stored SDE-window steps.

    Args:
        logp: ``[N, W, 9]`` log-probs under the current weights (with grad).
        logp_old: ``[N, W, 9]`` log-probs stored by the rollout.
        advantages: ``[N, 9]`` per-layer advantages.
        config: Loss options.
        logp_ref: ``[N, W, 9]`` log-probs under the reference policy; needed when ``kl_beta > 0``.
        loss_mask: Optional ``[N, 9]`` bool (or 0/1), False for dead layers (module docstring); None: all live.

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
    if loss_mask is None:
        live = torch.ones(n, 1, NUM_LAYERS, dtype=torch.bool, device=logp.device)
    else:
        _check("loss_mask", loss_mask.to(torch.float32), (n, NUM_LAYERS))
        live = (loss_mask.to(device=logp.device) != 0).unsqueeze(1)  # [N, 1, 9]
    live_full = live.expand(n, w, NUM_LAYERS)
    denom = float(n * w)

    weights = config.weight_vector().to(device=logp.device, dtype=logp.dtype)
    adv = advantages.to(device=logp.device, dtype=logp.dtype).unsqueeze(1)  # [N, 1, 9]
    log_ratio = logp - logp_old.to(logp.dtype).detach()
    ratio = torch.exp(log_ratio)
    eps = config.clip_eps
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps, 1.0 + eps)
    # torch.where (not a product with the mask) so that a dead entry's inf/NaN ratio cannot leak into the sum.
    per_elem = torch.where(live, torch.maximum(unclipped, clipped), 0.0)  # [N, W, 9]
    layer_loss = per_elem.sum(dim=(0, 1)) / denom  # [9]
    policy_loss = (weights * layer_loss).sum() / weights.sum()
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if config.kl_beta > 0:
        d = logp_ref.to(logp.dtype).detach() - logp
        layer_kl = torch.where(live, torch.exp(d) - d - 1.0, 0.0).sum(dim=(0, 1)) / denom
        kl = (weights * layer_kl).sum() / weights.sum()
    loss = policy_loss + config.kl_beta * kl

    with torch.no_grad():
        r = ratio.detach()
        is_clipped = (clipped > unclipped).detach() & live_full
        n_live = max(int(live_full.sum()), 1)
        lr2 = torch.where(live_full, 0.5 * log_ratio.detach().double() ** 2, 0.0)
        metrics: dict[str, float] = {
            "actor/policy_loss": float(policy_loss),
            "actor/kl_ref": float(kl),
            "actor/clip_fraction": float(is_clipped.sum()) / n_live,
            "actor/approx_kl": float(lr2.sum()) / n_live,
            "actor/live_fraction": float(live_full.sum()) / live_full.numel(),
        }
        for g, name in enumerate(LAYER_NAMES):
            lg = live_full[..., g]
            rg = r[..., g].double()
            count = int(lg.sum())
            # A layer dead in every rollout of the micro-batch has no ratio to report: 1.0 (no change).
            metrics[f"actor/ratio_mean/{name}"] = float(torch.where(lg, rg, 0.0).sum()) / count if count else 1.0
            metrics[f"actor/ratio_min/{name}"] = float(torch.where(lg, rg, torch.inf).min()) if count else 1.0
            metrics[f"actor/ratio_max/{name}"] = float(torch.where(lg, rg, -torch.inf).max()) if count else 1.0
            metrics[f"actor/clip_fraction/{name}"] = float(is_clipped[..., g].sum()) / max(count, 1)
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
