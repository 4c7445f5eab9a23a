"""Pure helpers of the driver: splitting a step's rollout plan over ranks and cutting the step's rollouts into
the update's mini-batches of whole prompt groups and each rank's micro-batches. No Ray, no model. (Merging the
ranks' ``RolloutResults`` is :meth:`RolloutResults.concat`.)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
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


def micro_batches(
    results, contexts, adv: torch.Tensor, old_logp: torch.Tensor, idx: list[int], micro_batch_rollouts: int, mask=None
) -> list[dict]:
    """Rollouts ``idx`` (one rank's share of a mini-batch) cut into micro-batches with their context rows.

    Each micro-batch is the dict ``UpdateMicroBatch.from_dict`` reads; ``weight`` is its share of ``idx``, so
    that ``loss * weight`` summed over the micro-batches is the share's mean loss.
    """
    out = []
    for start in range(0, len(idx), micro_batch_rollouts):
        sel = torch.tensor(idx[start : start + micro_batch_rollouts], dtype=torch.long)
        uniq, inverse = torch.unique(results.context_rows[sel], return_inverse=True)
        out.append(
            {
                "window_states": results.window_states[sel],
                "window_steps": results.window_steps[sel],
                "noise_coefs": results.noise_coefs[sel],
                "sigmas": results.sigmas,
                "old_logprobs": old_logp[sel],
                "advantages": adv[sel].float(),
                "loss_mask": None if mask is None else mask[sel],
                "context": contexts.select(uniq),
                "context_rows": inverse,
                "request_ids": [results.request_ids[i] for i in sel.tolist()],
                "weight": len(sel) / len(idx),
            }
        )
    return out


def plan_updates(
    results,
    contexts,
    adv_result,
    old_logp: torch.Tensor,
    *,
    world_size: int,
    mini_batch_prompts: int,
    micro_batch_rollouts: int,
    run_seed: int,
    step: int,
    epochs: int,
    skip_zero_signal: bool = True,
) -> tuple[list[list[list[dict]]], int]:
    """Per-rank payloads: for each PPO epoch and mini-batch of whole prompt groups, equal rank shares.

    Args:
        results: The step's merged ``RolloutResults``.
        contexts: Their prompt contexts (``results.context_rows`` index them).
        adv_result: ``AdvantageResult`` of the step.
        old_logp: ``[N, W, 9]`` old log-probs.
        world_size: Actor ranks.
        mini_batch_prompts: Prompts per mini-batch.
        micro_batch_rollouts: Rollouts per micro-batch on one rank.
        run_seed, step: Key the per-epoch shuffle of the prompt groups.
        epochs: PPO epochs (recomputing old log-probs plans one epoch without skipping, so that every
            transition is evaluated exactly once).
        skip_zero_signal: Leave out mini-batches whose every prompt group has all advantages 0 (a no-op update).

    Returns:
        ``(per_rank, skipped)``: ``per_rank[r]`` lists rank ``r``'s mini-batches, each a list of micro-batch
        dicts (:func:`micro_batches`); ``skipped`` counts the mini-batches left out.
    """
    keys = results.sample_ids
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        rows_of[k].append(i)
    zero = {k for k, z in zip(adv_result.prompt_keys, adv_result.zero_signal_prompts.tolist(), strict=True) if z}
    per_rank: list[list] = [[] for _ in range(world_size)]
    skipped = 0
    for epoch in range(epochs):
        for group in minibatch_prompt_groups(keys, mini_batch_prompts, run_seed, step, epoch):
            if skip_zero_signal and all(k in zero for k in group):
                # Constant rewards on every layer of every prompt group here: all advantages are 0, so the update
                # would be a no-op. Skipped on all ranks alike.
                skipped += 1
                continue
            idx = [i for k in group for i in rows_of[k]]
            for rank, sl in enumerate(split_even(len(idx), world_size)):
                per_rank[rank].append(
                    micro_batches(
                        results,
                        contexts,
                        adv_result.advantages,
                        old_logp,
                        idx[sl],
                        micro_batch_rollouts,
                        adv_result.loss_mask,
                    )
                )
    return per_rank, skipped


def rows_of_requests(results, request_ids: Sequence[str]) -> list[int]:
    """Row of each request id in ``results`` (where a micro-batch's rollouts sit in the step's tensors)."""
    pos = {rid: i for i, rid in enumerate(results.request_ids)}
    return [pos[r] for r in request_ids]
