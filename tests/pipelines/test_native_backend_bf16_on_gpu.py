"""bf16 consistency of the native backend on a CUDA device (skipped without one).

Stated tolerances (bounds; on an H200 with the tiny WNM, bf16 DiT and fp32 SDE math both measured 0.0):
- recomputation with the rollout's own batch shape: |logp_rollout - logp_recomputed| <= SAME_BATCH_TOL;
- recomputation one request at a time after a batched rollout: <= CROSS_BATCH_TOL (bf16 kernels differ by shape).
"""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, SamplerConfig, stratified_requests
from verl_omni.trainer.diffusion import logprob_consistency_metrics, recompute_results_logprobs

SAME_BATCH_TOL = 1e-3
CROSS_BATCH_TOL = 5e-2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bf16_recompute_matches_rollout_within_tolerance():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny")).to("cuda")
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    ctx = model.encode_context(frames, ["go to the kitchen", "stop at the door"])
    sampler = SamplerConfig(num_steps=10, window_strategy="fixed", window_start=1, window_size=3)
    backend = NativeRolloutBackend.from_model(model, sampler, NativeBackendConfig(device="cuda", dtype="bfloat16"))
    res = backend.generate(stratified_requests(["a", "b"], 0, 0), ctx)
    assert torch.isfinite(res.logprobs).all()
    same = recompute_results_logprobs(
        backend.transformer, backend.layout, res, ctx, dtype=torch.bfloat16, device="cuda", chunk_size=None
    )
    single = recompute_results_logprobs(
        backend.transformer, backend.layout, res, ctx, dtype=torch.bfloat16, device="cuda", chunk_size=1
    )
    m_same = logprob_consistency_metrics(res.logprobs, same)
    m_single = logprob_consistency_metrics(res.logprobs, single)
    print("same-batch", m_same)
    print("per-request", m_single)
    assert m_same["rollout/logp_abs_diff/max"] <= SAME_BATCH_TOL
    assert m_single["rollout/logp_abs_diff/max"] <= CROSS_BATCH_TOL
