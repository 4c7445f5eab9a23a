"""RolloutResults: the first n rollouts and the rank-order concatenation with shifted context rows."""

import pytest
import torch

from verl_omni.pipelines.wnm_shared.backend import RolloutResults
from verl_omni.pipelines.wnm_shared.requests import stratified_requests


def _results(sample_ids, n_ctx, version=3, first=0.0):
    reqs = stratified_requests(sample_ids, run_seed=1, step=2, num_strata=1, num_branches=2)
    r = len(reqs)
    vals = torch.arange(r, dtype=torch.float32) + first
    return RolloutResults(
        request_ids=[q.request_id for q in reqs],
        requests=reqs,
        actions=vals.view(r, 1, 1).expand(r, 32, 4).clone(),
        actions_normalized=torch.zeros(r, 32, 4),
        video_latents=torch.zeros(r, 1, 1, 1, 1),
        window_steps=torch.zeros(r, 2, dtype=torch.int64),
        window_states=torch.zeros(r, 3, 5),
        noise_coefs=torch.zeros(r, 2, dtype=torch.float64),
        sigmas=torch.linspace(1, 0, 5, dtype=torch.float64),
        timesteps=torch.linspace(1000, 250, 4, dtype=torch.float64),
        logprobs=vals.view(r, 1, 1).expand(r, 2, 9).clone(),
        context_rows=torch.tensor([q.context_row for q in reqs]) % n_ctx,
        weight_version=version,
    )


def test_concat_shifts_context_rows_by_the_ranks_before():
    a = _results(["a"], n_ctx=1)  # 2 rollouts of context row 0
    b = _results(["b", "c"], n_ctx=2, first=10.0)  # 4 rollouts of rows 0, 0, 1, 1
    out = RolloutResults.concat([a, b], row_offsets=[0, 1])
    assert len(out) == 6 and out.request_ids == a.request_ids + b.request_ids
    assert out.context_rows.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.logprobs[:, 0, 0].tolist() == [0.0, 1.0, 10.0, 11.0, 12.0, 13.0]
    assert out.sigmas is a.sigmas and out.weight_version == 3 and out.sample_ids == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(RuntimeError, match="different weight versions"):
        RolloutResults.concat([a, _results(["b"], 1, version=4)], [0, 1])


def test_head_keeps_shared_fields():
    out = _results(["a", "b"], n_ctx=2).head(3)
    assert len(out) == 3 and len(out.requests) == 3 and out.actions.shape == (3, 32, 4)
    assert out.sigmas.shape == (5,) and out.timesteps.shape == (4,) and out.layer_names[0] == "visual"
