"""The driver/actor boundary types of a step: generate shards and outputs, and the update's micro-batches.

Expected values are written out by hand from small plans (5 rollouts over 3 prompts on 2 ranks).
"""

from __future__ import annotations

import pytest
import torch

from verl_omni.models.wnm.context import WNMContext
from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch
from verl_omni.pipelines.wnm_shared.backend import RolloutResults
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest
from verl_omni.trainer.rollout_batch import GenerateOutput, GenerateShard, micro_batches

W, D = 2, 3  # window steps, joint latent width


def _results(sample_ids: list[str], context_rows: list[int], first: float, version: int = 0) -> RolloutResults:
    """``len(sample_ids)`` rollouts whose window states are filled with ``first, first + 1, ...`` (one per row)."""
    r = len(sample_ids)
    reqs = [
        RolloutRequest(s, stratum=0, branch=i, step=1, seed=0, context_row=c)
        for i, (s, c) in enumerate(zip(sample_ids, context_rows, strict=True))
    ]
    fill = torch.arange(first, first + r, dtype=torch.float32)
    return RolloutResults(
        request_ids=[q.request_id for q in reqs],
        requests=reqs,
        actions=torch.zeros(r, 32, 4),
        actions_normalized=torch.zeros(r, 32, 4),
        video_latents=fill.view(r, 1, 1, 1, 1).expand(r, 1, 1, 1, 2).clone(),
        window_steps=torch.tensor([[0, 1]] * r),
        window_states=fill.view(r, 1, 1).expand(r, W + 1, D).clone(),
        noise_coefs=torch.ones(r, W, dtype=torch.float64),
        sigmas=torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64),
        timesteps=torch.tensor([1000.0, 500.0], dtype=torch.float64),
        logprobs=fill.view(r, 1, 1).expand(r, W, 9).clone(),
        context_rows=torch.tensor(context_rows),
        weight_version=version,
    )


def _context(values: list[float]) -> WNMContext:
    v = torch.tensor(values)
    return WNMContext(history_latents=v.view(-1, 1, 1, 1, 1), encoder_tokens=v.view(-1, 1, 1))


def _output(results: RolloutResults, rows: list[float], encode_s: float, generate_s: float, mem: float):
    targets = torch.tensor(rows).view(-1, 1, 1, 1, 1)
    return GenerateOutput(results, _context(rows), targets, encode_s, generate_s, mem)


def test_generate_output_concat_shifts_context_rows_past_the_earlier_ranks_and_keeps_the_slowest_timing():
    # Rank 0: prompts a, b (rows 10, 11), rollouts a, a, b; rank 1: prompt c (row 12), rollouts c, c.
    rank0 = _output(_results(["a", "a", "b"], [0, 0, 1], first=0.0), [10.0, 11.0], 1.0, 5.0, 0.5)
    rank1 = _output(_results(["c", "c"], [0, 0], first=3.0), [12.0], 2.0, 4.0, 0.25)
    out = GenerateOutput.concat([rank0, rank1])
    assert out.results.context_rows.tolist() == [0, 0, 1, 2, 2]  # rank 1's row 0 is row 2 of the merge
    assert out.results.sample_ids == ["a", "a", "b", "c", "c"]
    assert out.results.window_states[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out.context.history_latents.flatten().tolist() == [10.0, 11.0, 12.0]
    assert out.target_latents.flatten().tolist() == [10.0, 11.0, 12.0] and out.num_rows == 3
    # Each rollout's context row holds its own prompt: a -> 10, b -> 11, c -> 12.
    assert out.target_latents[out.results.context_rows].flatten().tolist() == [10.0, 10.0, 11.0, 12.0, 12.0]
    assert (out.encode_s, out.generate_s, out.peak_memory_gb) == (2.0, 5.0, 0.5)
    stale = _output(_results(["c"], [0], first=0.0, version=1), [12.0], 0.0, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="different weight versions"):
        GenerateOutput.concat([rank0, stale])


def test_generate_shard_refuses_an_unknown_mode_and_requests_outside_its_rows():
    req = RolloutRequest("a", 0, 0, 1, 0, context_row=1)
    with pytest.raises(ValueError, match=r"GenerateShard.mode must be one of \['sde', 'ode'\], got 'euler'"):
        GenerateShard(["row-a", "row-b"], [req], [0, 1], mode="euler")
    with pytest.raises(ValueError, match="point outside the shard's 1 rows"):
        GenerateShard(["row-a"], [req], [0])


def test_micro_batches_are_update_micro_batches_with_their_shares_and_only_the_context_rows_they_use():
    results = _results(["a", "a", "b", "c", "c"], [0, 0, 1, 2, 2], first=0.0)
    contexts = _context([10.0, 11.0, 12.0])
    adv = torch.arange(5 * 9, dtype=torch.float64).view(5, 9)
    old = results.logprobs + 100.0
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[3] = True
    # One rank's share: rollouts 3, 0, 4 in micro-batches of 2 -> [3, 0] (weight 2/3) and [4] (weight 1/3).
    mbs = micro_batches(results, contexts, adv, old, [3, 0, 4], 2, mask)
    assert all(isinstance(mb, UpdateMicroBatch) for mb in mbs)
    first, second = mbs
    assert first.weight == pytest.approx(2 / 3) and second.weight == pytest.approx(1 / 3)
    # Rollout 3 uses prompt c (row 2), rollout 0 prompt a (row 0): the context keeps rows 0 and 2, in that order.
    assert first.context.history_latents.flatten().tolist() == [10.0, 12.0]
    assert first.context_rows.tolist() == [1, 0]
    assert first.window_states[:, 0, 0].tolist() == [3.0, 0.0]
    assert first.old_logprobs[:, 0, 0].tolist() == [103.0, 100.0]
    assert first.advantages.dtype == torch.float32 and first.advantages[:, 0].tolist() == [27.0, 0.0]
    assert first.loss_mask[:, 0].tolist() == [True, False]
    assert first.request_ids == [results.request_ids[3], results.request_ids[0]]
    assert second.context.history_latents.flatten().tolist() == [12.0] and second.context_rows.tolist() == [0]
