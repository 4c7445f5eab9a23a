"""Layer-conditioned counterfactual advantages (docs/design.md, "One Stage-III step").

For rollout ``i`` of prompt ``p`` (stratum ``s``) and layer ``g``::

    A[i, g] = clip((R[i, g] - baseline[i, g]) / (std[p, g] + eps), -a_max, a_max)

``baseline`` is the mean of layer ``g`` over the rollout's stratum (its counterfactual siblings sharing
the initial noise) or over the prompt; ``std`` is the population standard deviation (ddof = 0) of layer
``g`` over the prompt's rollouts or over the whole batch. Computed in float64.

**Dead layers.** ``valid [N, 9]`` (the reward set's ``layer_valid``) marks the layers whose actions still
decided something: the chunks after a rollout's STOP or first hard collision did not. Those entries are left
out of every statistic (the baseline and std of layer ``g`` are taken over the *live* entries of the stratum or
prompt only) and get ``A = 0`` and ``loss_mask = False``. Counting them as rewards of 0 would rank a dead chunk
against live ones: when live rollouts are charged guard or deviation terms, a chunk that never happened
would look better than they do and its (irrelevant) actions would be reinforced. A stratum or prompt with no
live entry on a layer has no signal there; with a single live entry its stratum baseline is itself (A = 0).

Because each (prompt, layer) group is normalised by its own std, the *scale* of a term that moves a whole
group's rollouts alike cancels; what a layer's advantages see is the order of its live rollouts and their
relative gaps. That is why the value a rollout forfeits by ending early is put on a live layer of the
decision that ended it (``stop_k`` of the STOP's chunk, ``nav_k`` of the collision's chunk; see
``verl_omni.utils.reward_score.navigation``), not on the dead chunks, where it would be masked, nor spread over
the nav layers, where it would blame motion the STOP made irrelevant.

**Summed-reward ablation** (``AdvantageConfig.layer_conditioned = False``). Every layer gets the advantage of
the weighted mean reward ``T[i] = sum_g w_g R[i, g] / sum_g w_g``, computed by the same rule. Every rollout has
a ``T``, so all rollouts enter the statistics; the dead chunks still leave the loss. :func:`estimate_advantages`
is the one entry point for both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, NUM_LAYERS, LayerLayoutError
from verl_omni.trainer.diffusion.config import AdvantageConfig


@dataclass
class AdvantageResult:
    """Advantages and what went into them.

    Attributes:
        advantages: ``[N, 9]`` float32, clipped.
        baseline: ``[N, 9]`` float64.
        std: ``[N, 9]`` float64 std used for each rollout (before ``eps``).
        prompt_keys: The ``P`` distinct prompt keys, in first-seen order.
        constant_layers: ``[P, 9]`` bool: the prompt's live rewards on that layer are all equal (or none live).
        zero_signal_prompts: ``[P]`` bool: every layer constant, the prompt group carries no signal.
        clipped_fraction: Fraction of live advantage entries that hit ``+-a_max``.
        loss_mask: ``[N, 9]`` bool: live entries (all True when no ``valid`` mask was given).
    """

    advantages: torch.Tensor
    baseline: torch.Tensor
    std: torch.Tensor
    prompt_keys: list[Hashable]
    constant_layers: torch.Tensor
    zero_signal_prompts: torch.Tensor
    clipped_fraction: float
    loss_mask: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """Counts for logging: constant (prompt, layer) groups per layer and zero-signal prompts."""
        out = {
            "advantages/zero_signal_prompts": float(self.zero_signal_prompts.sum()),
            "advantages/clipped_fraction": self.clipped_fraction,
        }
        mask = self.mask()
        for g, name in enumerate(LAYER_NAMES):
            out[f"advantages/constant_groups/{name}"] = float(self.constant_layers[:, g].sum())
            out[f"advantages/abs_mean/{name}"] = float(self.advantages[:, g].abs().mean())
            out[f"advantages/live_fraction/{name}"] = float(mask[:, g].to(torch.float64).mean())
        return out

    def mask(self) -> torch.Tensor:
        """``[N, 9]`` bool loss mask (all True when none was given)."""
        if self.loss_mask is None:
            return torch.ones_like(self.advantages, dtype=torch.bool)
        return self.loss_mask


def validity_matrix(valid, n: int) -> torch.Tensor:
    """``[N, 9]`` bool from ``None`` (all live), a tensor/array ``[N, 9]`` (nonzero = live) or a layer mapping."""
    if valid is None:
        return torch.ones(n, NUM_LAYERS, dtype=torch.bool)
    if isinstance(valid, Mapping):
        v = rewards_matrix(valid) != 0
    else:
        v = torch.as_tensor(valid)
        if v.ndim != 2 or v.shape[1] != NUM_LAYERS:
            raise LayerLayoutError(f"valid must be [N, {NUM_LAYERS}] (layers {list(LAYER_NAMES)}), got {list(v.shape)}")
        v = v != 0
    if v.shape[0] != n:
        raise ValueError(f"valid has {v.shape[0]} rows, rewards {n}")
    return v.to(torch.bool).cpu()


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Column means of ``x [K, 9]`` over rows where ``m [K, 9]`` is True (0 for a column with none)."""
    count = m.sum(dim=0)
    return torch.where(m, x, 0.0).sum(dim=0) / count.clamp(min=1)


def _masked_std(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Population std (ddof = 0) per column over the live rows (0 for a column with none)."""
    mean = _masked_mean(x, m)
    return _masked_mean((x - mean) ** 2, m).sqrt()


def with_loss_mask(result: AdvantageResult, valid) -> AdvantageResult:
    """Masks already computed advantages for the loss without changing their statistics.

    Used by the summed-reward ablation: its single advantage comes from the summed reward, which every rollout
    has, so all rollouts enter the statistics; the dead chunks' log-probs are still left out of the loss.
    """
    mask = validity_matrix(valid, result.advantages.shape[0])
    return dataclasses.replace(
        result, advantages=torch.where(mask, result.advantages, 0.0), loss_mask=mask & result.mask()
    )


def rewards_matrix(rewards: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[N, 9]`` float64 from a tensor or a mapping ``layer name -> [N]`` with exactly :data:`LAYER_NAMES`."""
    if isinstance(rewards, Mapping):
        if set(rewards) != set(LAYER_NAMES):
            raise LayerLayoutError(f"rewards have layers {sorted(rewards)}, expected {list(LAYER_NAMES)}")
        cols = [torch.as_tensor(rewards[n], dtype=torch.float64).reshape(-1) for n in LAYER_NAMES]
        if len({c.numel() for c in cols}) != 1:
            raise ValueError(f"rewards: layers have different lengths {[c.numel() for c in cols]}")
        return torch.stack(cols, dim=1)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 2 or r.shape[1] != NUM_LAYERS:
        raise LayerLayoutError(f"rewards must be [N, {NUM_LAYERS}] (layers {list(LAYER_NAMES)}), got {list(r.shape)}")
    return r


def compute_layer_advantages(
    rewards: torch.Tensor | Mapping[str, torch.Tensor],
    prompt_keys: Sequence[Hashable],
    strata: Sequence[int] | torch.Tensor,
    config: AdvantageConfig,
    valid=None,
) -> AdvantageResult:
    """Per-layer advantages of a batch of rollouts.

    Args:
        rewards: ``[N, 9]`` (layer order :data:`LAYER_NAMES`) or mapping layer name -> ``[N]``.
        prompt_keys: ``N`` prompt keys (e.g. ``sample_id``); rollouts with the same key form a group.
        strata: ``N`` stratum indices.
        config: Advantage options.
        valid: Optional ``[N, 9]`` live-layer mask (bool or 0/1; the reward set's ``layer_valid``); dead entries
            are left out of the statistics and get advantage 0 (module docstring). None: every entry is live.

    Returns:
        :class:`AdvantageResult`.

    Raises:
        ValueError: non-finite rewards (naming the rollout indices) or groups that do not match the
            ``num_strata x num_branches`` plan.
    """
    r = rewards_matrix(rewards)
    n = r.shape[0]
    strata_t = torch.as_tensor(strata, dtype=torch.int64).reshape(-1)
    if len(prompt_keys) != n or strata_t.numel() != n:
        raise ValueError(f"rewards have {n} rows but {len(prompt_keys)} prompt keys and {strata_t.numel()} strata")
    bad = torch.nonzero(~torch.isfinite(r).all(dim=1)).squeeze(1).tolist()
    if bad:
        raise ValueError(
            f"non-finite rewards in rollout rows {bad[:10]} (prompts {[prompt_keys[i] for i in bad[:10]]})"
        )

    keys: list[Hashable] = []
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(prompt_keys):
        if k not in members:
            keys.append(k)
            members[k] = []
        members[k].append(i)

    live = validity_matrix(valid, n)
    per_prompt = config.num_strata * config.num_branches
    baseline = torch.empty_like(r)
    std = torch.empty_like(r)
    constant = torch.zeros(len(keys), NUM_LAYERS, dtype=torch.bool)
    global_std = _masked_std(r, live)
    for p, k in enumerate(keys):
        idx = torch.tensor(members[k])
        if idx.numel() != per_prompt:
            raise ValueError(f"prompt {k!r} has {idx.numel()} rollouts, the plan needs {per_prompt}")
        group, gl = r[idx], live[idx]
        hi = torch.where(gl, group, -torch.inf).max(dim=0).values
        lo = torch.where(gl, group, torch.inf).min(dim=0).values
        constant[p] = (hi == lo) | ~gl.any(dim=0)
        std[idx] = _masked_std(group, gl) if config.std == "prompt" else global_std
        if config.baseline == "prompt":
            baseline[idx] = _masked_mean(group, gl)
            continue
        group_strata = strata_t[idx]
        for s in torch.unique(group_strata).tolist():
            sidx = idx[group_strata == s]
            if sidx.numel() != config.num_branches:
                raise ValueError(
                    f"prompt {k!r} stratum {s} has {sidx.numel()} rollouts, the plan needs {config.num_branches}"
                )
            baseline[sidx] = _masked_mean(r[sidx], live[sidx])
        if torch.unique(group_strata).numel() != config.num_strata:
            raise ValueError(f"prompt {k!r} has strata {sorted(set(group_strata.tolist()))}, needs {config.num_strata}")

    raw = torch.where(live, (r - baseline) / (std + config.eps), 0.0)
    adv = raw.clamp(-config.a_max, config.a_max)
    clipped = (raw.abs() > config.a_max) & live
    return AdvantageResult(
        advantages=adv.to(torch.float32),
        baseline=baseline,
        std=std,
        prompt_keys=keys,
        constant_layers=constant,
        zero_signal_prompts=constant.all(dim=1),
        clipped_fraction=float(clipped.sum()) / max(int(live.sum()), 1),
        loss_mask=live if valid is not None else None,
    )


def summed_layer_rewards(
    rewards: torch.Tensor | Mapping[str, torch.Tensor], layer_weights: Mapping[str, float] | None = None
) -> torch.Tensor:
    """The ablation's reward table: every column is ``sum_g w_g R[:, g] / sum_g w_g``.

    Args:
        rewards: ``[N, 9]`` or mapping layer name -> ``[N]``.
        layer_weights: Weight per layer name (the loss weights); None weighs every layer 1.

    Returns:
        ``[N, 9]`` float64, all columns equal.
    """
    r = rewards_matrix(rewards)
    weights = layer_weights or {}
    w = torch.tensor([float(weights.get(n, 1.0)) for n in LAYER_NAMES], dtype=torch.float64)
    if not (torch.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise ValueError(f"layer_weights must be finite, >= 0 and not all 0, got {dict(zip(LAYER_NAMES, w.tolist()))}")
    total = (r * w).sum(dim=1, keepdim=True) / w.sum()
    return total.expand(-1, NUM_LAYERS).contiguous()


def estimate_advantages(
    rewards: torch.Tensor | Mapping[str, torch.Tensor],
    prompt_keys: Sequence[Hashable],
    strata: Sequence[int] | torch.Tensor,
    config: AdvantageConfig,
    valid=None,
    layer_weights: Mapping[str, float] | None = None,
) -> AdvantageResult:
    """Advantages of a step's rollouts: layer-conditioned, or the summed-reward ablation (module docstring).

    Args:
        rewards: ``[N, 9]`` or mapping layer name -> ``[N]``.
        prompt_keys: ``N`` prompt keys.
        strata: ``N`` stratum indices.
        config: Advantage options; ``config.layer_conditioned`` picks the estimator.
        valid: Optional ``[N, 9]`` live-layer mask (the reward set's ``layer_valid``).
        layer_weights: Weight per layer for the ablation's weighted mean (ignored when layer-conditioned).
    """
    if config.layer_conditioned:
        return compute_layer_advantages(rewards, prompt_keys, strata, config, valid=valid)
    summed = summed_layer_rewards(rewards, layer_weights)
    return with_loss_mask(compute_layer_advantages(summed, prompt_keys, strata, config), valid)
