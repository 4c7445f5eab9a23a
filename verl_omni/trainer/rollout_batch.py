"""What crosses the driver/actor boundary in a step, and the pure helpers that make it. No Ray, no model.

- :class:`GenerateShard` (driver -> each actor rank): the rank's share of the rollout plan and its prompts, made
  by :func:`shard_requests`; :class:`GenerateOutput` (rank -> driver): its rollouts, the encoded contexts and the
  ground-truth target latents, merged over the ranks by :meth:`GenerateOutput.concat`.
- :func:`plan_updates` cuts the step's rollouts into the update's mini-batches of whole prompt groups and each
  rank's micro-batches (:class:`~verl_omni.pipelines.wnm_3d.actor.UpdateMicroBatch`).

The reward workers' side is :class:`~verl_omni.utils.reward_score.RewardBatch` (a shard, cut by
:meth:`RewardBatch.select`) and :class:`~verl_omni.utils.reward_score.RewardScores`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch
from verl_omni.pipelines.wnm_shared.backend import RolloutResults
from verl_omni.pipelines.wnm_shared.rng import generator_for

GENERATE_MODES = ("sde", "ode")


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


@dataclass
class GenerateShard:
    """One actor rank's share of a rollout plan (what ``ActorRolloutWorker.generate`` receives).

    Attributes:
        rows: The prompts (``Stage3Row``) the shard's requests use, each once.
        requests: ``RolloutRequest`` list; each ``context_row`` indexes ``rows``.
        global_rows: For each of ``rows``, its index in the driver's prompt list.
        source_root: Root of the GN0 collection the rows' frames are read from.
        mode: ``sde`` (training rollouts with window log-probs) or ``ode`` (deterministic, validation).
    """

    rows: list
    requests: list
    global_rows: list[int]
    source_root: str = ""
    mode: str = "sde"

    def __post_init__(self) -> None:
        if self.mode not in GENERATE_MODES:
            raise ValueError(f"GenerateShard.mode must be one of {list(GENERATE_MODES)}, got {self.mode!r}")
        if len(self.global_rows) != len(self.rows):
            raise ValueError(f"GenerateShard: {len(self.global_rows)} global_rows for {len(self.rows)} rows")
        bad = [r.request_id for r in self.requests if not 0 <= r.context_row < len(self.rows)]
        if bad:
            raise ValueError(f"GenerateShard: requests {bad[:3]} point outside the shard's {len(self.rows)} rows")


@dataclass
class GenerateOutput:
    """What one actor rank's ``generate`` returns (CPU tensors).

    Attributes:
        results: ``RolloutResults`` of the shard's requests, in request order.
        context: The ``WNMContext`` of the shard's rows (fp32), one row per prompt.
        target_latents: ``[C, ...]`` VAE latents of each prompt's ground-truth target frames (fp32).
        encode_s: Seconds spent decoding and encoding the prompts.
        generate_s: Seconds spent sampling.
        peak_memory_gb: Peak accelerator memory of the call (0 on CPU).
    """

    results: RolloutResults
    context: object
    target_latents: torch.Tensor
    encode_s: float = 0.0
    generate_s: float = 0.0
    peak_memory_gb: float = 0.0

    @property
    def num_rows(self) -> int:
        """Prompts (context rows) of this output."""
        return int(self.target_latents.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[GenerateOutput]) -> GenerateOutput:
        """Merges the ranks' outputs in rank order.

        Each part's ``context_rows`` are shifted past the rows of the ranks before it, so that they index the
        concatenated contexts and target latents; the timings and the memory are the slowest rank's.
        """
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + p.num_rows)
        return cls(
            results=RolloutResults.concat([p.results for p in parts], offsets),
            context=cat_dataclass_tensors([p.context for p in parts]),
            target_latents=torch.cat([p.target_latents for p in parts]),
            encode_s=max(p.encode_s for p in parts),
            generate_s=max(p.generate_s for p in parts),
            peak_memory_gb=max(p.peak_memory_gb for p in parts),
        )


def shard_requests(
    requests: Sequence, rows: Sequence, world_size: int, source_root: str = "", mode: str = "sde"
) -> list[GenerateShard]:
    """Splits a prompt-major request plan into ``world_size`` equal shards.

    Each shard lists only the prompts its requests use (so each prompt's context is encoded once per
    rank that needs it), with the requests' ``context_row`` re-pointed at the shard's own row list.

    Args:
        requests: ``RolloutRequest`` list; ``context_row`` indexes ``rows``.
        rows: Prompt rows.
        world_size: Number of actor ranks.
        source_root: Root of the collection the rows' frames are read from.
        mode: ``sde`` or ``ode``.

    Returns:
        One :class:`GenerateShard` per rank.
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
        shards.append(GenerateShard([rows[i] for i in global_rows], remapped, global_rows, source_root, mode))
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
) -> list[UpdateMicroBatch]:
    """Rollouts ``idx`` (one rank's share of a mini-batch) cut into micro-batches with their context rows.

    ``weight`` is each micro-batch's share of ``idx``, so that ``loss * weight`` summed over the micro-batches is
    the share's mean loss.
    """
    out = []
    for start in range(0, len(idx), micro_batch_rollouts):
        sel = idx[start : start + micro_batch_rollouts]
        out.append(
            UpdateMicroBatch.from_results(
                results,
                contexts,
                sel,
                old_logprobs=old_logp,
                advantages=adv,
                loss_mask=mask,
                weight=len(sel) / len(idx),
            )
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
) -> tuple[list[list[list[UpdateMicroBatch]]], int]:
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
        ``(per_rank, skipped)``: ``per_rank[r]`` lists rank ``r``'s mini-batches, each a list of
        ``UpdateMicroBatch`` (:func:`micro_batches`); ``skipped`` counts the mini-batches left out.
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
