"""Parity of the vllm_omni backend with ``native`` on the tiny WNM model (CPU, no vLLM needed).

The vllm_omni path here is everything on our side of vLLM's GPU engine: request payloads, the context
store, the registered ``WNMDiTPipeline`` class and its batch entry point, the worker-extension RPCs,
the result store and result assembly. vLLM's scheduler/worker processes are replaced by
``InProcessEngine`` because vLLM's engine needs CUDA (docs/vllm_omni.md).

Tolerance: on CPU in fp32 with deterministic (per-request) evaluation the two backends must agree bit
for bit (atol = rtol = 0): both run the same ``wnm_shared`` sampler over the same weights.
"""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_shared import (
    NativeBackendConfig,
    NativeRolloutBackend,
    RolloutRequest,
    SamplerConfig,
    stratified_requests,
)
from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend
from verl_omni.pipelines.wnm_vllm_omni.protocol import ProtocolError

FIELDS = ("actions", "actions_normalized", "video_latents", "window_states", "logprobs", "window_steps", "noise_coefs")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    h, w = model.config.image_size
    gen = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=gen)
    ctx = model.encode_context(frames, ["go to the door", "turn left and stop"])
    return model, ctx


SAMPLER = SamplerConfig(num_steps=3, window_strategy="random", window_size=2, num_strata=2, num_branches=2)


def assert_same(a, b):
    assert a.request_ids == b.request_ids
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), f"{name}: max |diff| {(x.double() - y.double()).abs().max().item()}"
    assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.timesteps, b.timesteps)
    assert torch.equal(a.context_rows, b.context_rows)
    assert a.weight_version == b.weight_version


def test_same_samples_and_logprobs_as_native(tiny):
    model, ctx = tiny
    native = NativeRolloutBackend.from_model(model, SAMPLER, NativeBackendConfig())
    vo = VllmOmniRolloutBackend.in_process(model, SAMPLER, NativeBackendConfig(), max_num_seqs=3)
    plan = stratified_requests(["p0", "p1"], run_seed=11, step=4, num_strata=2, num_branches=2)
    requests = [plan[0], plan[1], plan[6], plan[3]]  # two prompts, shared-x0 siblings, mixed order
    a, b = native.generate(requests, ctx), vo.generate(requests, ctx)
    assert_same(a, b)
    assert b.logprobs.shape == (4, 2, 9) and torch.isfinite(b.logprobs).all()
    assert vo.engine.calls == 2  # 4 requests in pipeline batches of at most 3 (vLLM-Omni's max_num_seqs)
    # Batch composition does not matter: one request alone gives the same bits.
    alone = vo.generate([requests[2]], ctx)
    for name in FIELDS:
        assert torch.equal(getattr(alone, name)[0], getattr(a, name)[2]), name
    # ODE evaluation (no window, no log-probs) agrees too.
    assert_same(native.generate(requests[2:3], ctx, ode=True), vo.generate(requests[2:3], ctx, ode=True))


def test_weight_update_keeps_parity_and_versions(tiny):
    model, ctx = tiny
    native = NativeRolloutBackend.from_model(
        build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")), SAMPLER, NativeBackendConfig()
    )
    # Both start from model's weights, then receive the same update.
    native.update_weights(model.transformer.state_dict(), version=0)
    vo = VllmOmniRolloutBackend.in_process(
        build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")),
        SAMPLER,
        NativeBackendConfig(),
        bucket_bytes=4096,
    )
    gen = torch.Generator().manual_seed(3)
    new = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in model.transformer.state_dict().items()}
    native.update_weights(new, version=7)
    vo.update_weights(new, version=7)
    assert vo.weight_version == 7 and vo.engine.weight_version() == 7
    assert vo.last_sync["buckets"] > 1  # the tiny DiT does not fit one 4 KiB bucket
    requests = [RolloutRequest("p1", stratum=1, branch=0, step=2, seed=5, context_row=1)]
    a, b = native.generate(requests, ctx), vo.generate(requests, ctx)
    assert_same(a, b)
    assert b.weight_version == 7


def test_sleep_wake_and_refusals(tiny):
    model, ctx = tiny
    vo = VllmOmniRolloutBackend.in_process(model, SAMPLER, NativeBackendConfig())
    req = RolloutRequest("p0", stratum=0, branch=0, step=0, seed=0)
    vo.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        vo.generate([req], ctx)
    vo.wake_up()
    assert len(vo.generate([req], ctx)) == 1
    with pytest.raises(ValueError, match="duplicate request_id"):
        vo.generate([req, req], ctx)
    with pytest.raises(IndexError, match="context_row 5"):
        vo.generate([RolloutRequest("p0", 0, 0, 0, 0, context_row=5)], ctx)
    # A request that expects another weight version than the worker holds is refused by the worker.
    vo._version = 3
    with pytest.raises(ProtocolError, match="expects weight version 3, the worker holds 0"):
        vo.generate([req], ctx)
