"""Pure helpers of the driver: splitting a step's rollout plan over ranks, merging what comes back, and
cutting the replay buffer into mini-batches of whole prompt groups. No Ray, no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from verl_omni.pipelines.wnm_shared.rng import generator_for


def split_even(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(n)``; requires ``n % parts == 0`` (equal collective work)."""
    if parts < 1 or n % parts:
        raise ValueError(f"cannot split {n} items into {parts} equal parts")
    k = n // parts
    return [slice(i * k, (i + 1) * k) for i in range(parts)]


def split_balanced(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices whose sizes differ by at most one (for CPU reward workers)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def shard_requests(requests: Sequence, rows: Sequence, world_size: int) -> list[dict]:
    """Splits a prompt-major request plan into ``world_size`` equal shards.

    Each shard lists only the prompts its requests use (so each prompt's context is encoded once per
    rank that needs it), with the requests' ``context_row`` re-pointed at the shard's own row list.

    Args:
        requests: ``RolloutRequest`` list; ``context_row`` indexes ``rows``.
        rows: Prompt rows.
        world_size: Number of actor ranks.

    Returns:
        ``[{"rows": [...], "requests": [...], "global_rows": [int]}]`` per rank.
    """
    shards = []
    for sl in split_even(len(requests), world_size):
        part = list(requests[sl])
        global_rows: list[int] = []
        local: dict[int, int] = {}
        remapped = []
        for r in part:
            if r.context_row not in local:
                local[r.context_row] = len(global_rows)
                global_rows.append(r.context_row)
            remapped.append(dataclasses.replace(r, context_row=local[r.context_row]))
        shards.append({"rows": [rows[i] for i in global_rows], "requests": remapped, "global_rows": global_rows})
    return shards


def cat_dataclass_tensors(items: Sequence, dim: int = 0):
    """Concatenates dataclass instances field by field (tensors concatenated, ``None`` kept if all None)."""
    first = items[0]
    values = {}
    for f in dataclasses.fields(first):
        vals = [getattr(x, f.name) for x in items]
        if all(v is None for v in vals):
            values[f.name] = None
        elif all(isinstance(v, torch.Tensor) for v in vals):
            values[f.name] = torch.cat(vals, dim=dim)
        else:
            raise TypeError(f"cannot concatenate field {f.name} of {type(first).__name__}")
    return type(first)(**values)


def merge_results_with_offsets(parts: Sequence, row_offsets: Sequence[int]):
    """Concatenates per-rank ``RolloutResults`` in rank order; ``context_rows`` become global rollout-context
    indices into the concatenation of the ranks' contexts (``row_offsets[r]``: rows of the ranks before ``r``)."""
    first = parts[0]
    versions = {p.weight_version for p in parts}
    if len(versions) != 1:
        raise RuntimeError(f"ranks returned rollouts from different weight versions {sorted(versions)}")
    out = {}
    for f in dataclasses.fields(first):
        vals = [getattr(p, f.name) for p in parts]
        if f.name in ("sigmas", "timesteps"):
            out[f.name] = vals[0]
        elif f.name == "context_rows":
            out[f.name] = torch.cat([v + off for v, off in zip(vals, row_offsets, strict=True)])
        elif f.name in ("request_ids", "requests"):
            out[f.name] = [x for v in vals for x in v]
        elif f.name in ("weight_version", "layer_names"):
            out[f.name] = vals[0]
        else:
            out[f.name] = torch.cat(vals, dim=0)
    return type(first)(**out)


def minibatch_prompt_groups(
    prompt_keys: Sequence[str], prompts_per_minibatch: int, run_seed: int, step: int, epoch: int
) -> list[list[str]]:
    """Deterministically shuffled prompt groups for one PPO epoch.

    Returns:
        Lists of prompt keys, ``prompts_per_minibatch`` each (the number of prompts must divide).
    """
    keys = list(dict.fromkeys(prompt_keys))
    if len(keys) % prompts_per_minibatch:
        raise ValueError(f"{len(keys)} prompts do not split into mini-batches of {prompts_per_minibatch}")
    perm = torch.randperm(len(keys), generator=generator_for("minibatch", run_seed, step, epoch)).tolist()
    shuffled = [keys[i] for i in perm]
    return [shuffled[i : i + prompts_per_minibatch] for i in range(0, len(shuffled), prompts_per_minibatch)]
