"""vllm_omni path vs native on a CUDA device, bf16 DiT and fp32 SDE math (skipped without one).

Runs our side of the vLLM-Omni boundary (``WNMDiTPipeline`` through ``InProcessEngine``) on the GPU; vLLM's
own engine is not installed on the GPU host (docs/vllm_omni.md). Stated tolerances:

- the same batch composition on both sides (deterministic per-request evaluation, or one batch of all
  requests on both): bit-identical (atol = 0), the same kernels run on the same inputs;
- different batch splits (native batches all 16 rollouts, the pipeline gets them in vLLM-Omni batches of
  ``max_num_seqs`` = 5): bf16 kernels differ by shape, so |d logp| <= LOGP_TOL and |d latent| <= LATENT_TOL,
  the cross-batch bound already stated for native (tests/pipelines/test_native_backend_bf16_on_gpu.py).
"""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, SamplerConfig, stratified_requests
from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend

LOGP_TOL = 5e-2
LATENT_TOL = 5e-2
FIELDS = ("actions_normalized", "video_latents", "window_states", "logprobs")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny")).to("cuda")
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    ctx = model.encode_context(frames, ["go to the kitchen", "stop at the door"])
    sampler = SamplerConfig(num_steps=10, window_strategy="fixed", window_start=1, window_size=3)
    return model, ctx, sampler, stratified_requests(["a", "b"], 0, 0, num_strata=2, num_branches=4)


def max_diff(a, b, name):
    return (getattr(a, name).double() - getattr(b, name).double()).abs().max().item()


@pytest.mark.parametrize(
    ("deterministic", "max_num_seqs", "exact"), [(True, 5, True), (False, 16, True), (False, 5, False)]
)
def test_bf16_parity(setup, deterministic, max_num_seqs, exact):
    model, ctx, sampler, requests = setup
    cfg = NativeBackendConfig(device="cuda", dtype="bfloat16", deterministic=deterministic)
    native = NativeRolloutBackend.from_model(model, sampler, cfg)
    vo = VllmOmniRolloutBackend.in_process(model, sampler, cfg, max_num_seqs=max_num_seqs)
    a, b = native.generate(requests, ctx), vo.generate(requests, ctx)
    diffs = {name: max_diff(a, b, name) for name in FIELDS}
    print(f"deterministic={deterministic} max_num_seqs={max_num_seqs}: max |diff| {diffs}")
    assert torch.isfinite(b.logprobs).all()
    if exact:
        assert all(v == 0.0 for v in diffs.values()), diffs
    else:
        assert diffs["logprobs"] <= LOGP_TOL and diffs["video_latents"] <= LATENT_TOL, diffs
