"""Layer-conditioned counterfactual advantages (DESIGN 6).

For rollout ``i`` of prompt ``p`` (stratum ``s``) and layer ``g``::

    A[i, g] = clip((R[i, g] - baseline[i, g]) / (std[p, g] + eps), -a_max, a_max)

``baseline`` is the mean of layer ``g`` over the rollout's stratum (its counterfactual siblings sharing
the initial noise) or over the prompt; ``std`` is the population standard deviation (ddof = 0) of layer
``g`` over the prompt's rollouts or over the whole batch. Computed in float64.
"""

from __future__ import annotations

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
        constant_layers: ``[P, 9]`` bool: the prompt's rewards on that layer are all equal.
        zero_signal_prompts: ``[P]`` bool: every layer constant, the prompt group carries no signal.
        clipped_fraction: Fraction of advantage entries that hit ``+-a_max``.
    """

    advantages: torch.Tensor
    baseline: torch.Tensor
    std: torch.Tensor
    prompt_keys: list[Hashable]
    constant_layers: torch.Tensor
    zero_signal_prompts: torch.Tensor
    clipped_fraction: float

    def metrics(self) -> dict[str, float]:
        """Counts for logging: constant (prompt, layer) groups per layer and zero-signal prompts."""
        out = {
            "advantages/zero_signal_prompts": float(self.zero_signal_prompts.sum()),
            "advantages/clipped_fraction": self.clipped_fraction,
        }
        for g, name in enumerate(LAYER_NAMES):
            out[f"advantages/constant_groups/{name}"] = float(self.constant_layers[:, g].sum())
            out[f"advantages/abs_mean/{name}"] = float(self.advantages[:, g].abs().mean())
        return out


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
) -> AdvantageResult:
    """Per-layer advantages of a batch of rollouts.

    Args:
        rewards: ``[N, 9]`` (layer order :data:`LAYER_NAMES`) or mapping layer name -> ``[N]``.
        prompt_keys: ``N`` prompt keys (e.g. ``sample_id``); rollouts with the same key form a group.
        strata: ``N`` stratum indices.
        config: Advantage options.

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

    per_prompt = config.num_strata * config.num_branches
    baseline = torch.empty_like(r)
    std = torch.empty_like(r)
    constant = torch.zeros(len(keys), NUM_LAYERS, dtype=torch.bool)
    global_std = r.std(dim=0, unbiased=False)
    for p, k in enumerate(keys):
        idx = torch.tensor(members[k])
        if idx.numel() != per_prompt:
            raise ValueError(f"prompt {k!r} has {idx.numel()} rollouts, the plan needs {per_prompt}")
        group = r[idx]
        constant[p] = group.max(dim=0).values == group.min(dim=0).values
        std[idx] = group.std(dim=0, unbiased=False) if config.std == "prompt" else global_std
        if config.baseline == "prompt":
            baseline[idx] = group.mean(dim=0)
            continue
        group_strata = strata_t[idx]
        for s in torch.unique(group_strata).tolist():
            sidx = idx[group_strata == s]
            if sidx.numel() != config.num_branches:
                raise ValueError(
                    f"prompt {k!r} stratum {s} has {sidx.numel()} rollouts, the plan needs {config.num_branches}"
                )
            baseline[sidx] = r[sidx].mean(dim=0)
        if torch.unique(group_strata).numel() != config.num_strata:
            raise ValueError(f"prompt {k!r} has strata {sorted(set(group_strata.tolist()))}, needs {config.num_strata}")

    raw = (r - baseline) / (std + config.eps)
    adv = raw.clamp(-config.a_max, config.a_max)
    return AdvantageResult(
        advantages=adv.to(torch.float32),
        baseline=baseline,
        std=std,
        prompt_keys=keys,
        constant_layers=constant,
        zero_signal_prompts=constant.all(dim=1),
        clipped_fraction=float((raw.abs() > config.a_max).to(torch.float64).mean()),
    )
