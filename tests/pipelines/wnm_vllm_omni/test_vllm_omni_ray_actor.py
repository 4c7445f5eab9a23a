"""The rollout engine as a Ray actor (``start_rollout_actor``) against native, from a saved tiny checkpoint.

Not a CI test (Ray start-up costs tens of seconds on two cores): ``scripts/check_vllm_omni.sh`` runs it.
The actor runs ``engine="in_process"`` (the pipeline from the checkpoint, without vLLM's CUDA engine).
"""

import pytest
import torch

ray = pytest.importorskip("ray")

from verl_omni.models.wnm import WNMConfig, build_wnm_model, load_wnm_checkpoint, save_wnm_checkpoint  # noqa: E402
from verl_omni.pipelines.wnm_shared import (  # noqa: E402
    NativeBackendConfig,
    NativeRolloutBackend,
    SamplerConfig,
    stratified_requests,
)
from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngineConfig  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.ray_actor import start_rollout_actor  # noqa: E402


def test_ray_actor_backend_matches_native_and_syncs_weights(tmp_path):
    torch.manual_seed(0)
    ckpt = save_wnm_checkpoint(build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")), tmp_path / "ck", {})
    model = load_wnm_checkpoint(ckpt)
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (1, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ctx = model.encode_context(frames, ["go to the door"])
    sampler = SamplerConfig(num_steps=3, window_strategy="fixed", window_start=0, window_size=2)
    requests = stratified_requests(["p0"], run_seed=1, step=0, num_strata=1, num_branches=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        backend = start_rollout_actor(
            model.config,
            model.action_normalization,
            VllmOmniEngineConfig(checkpoint=str(ckpt), dtype="float32", max_num_seqs=2),
            sampler,
            engine="in_process",
            num_gpus=0,
            bucket_bytes=1 << 16,
        )
        native = NativeRolloutBackend.from_model(model, sampler, NativeBackendConfig())
        a, b = native.generate(requests, ctx), backend.generate(requests, ctx)
        for name in ("actions", "video_latents", "window_states", "logprobs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        new = {n: t * 1.01 for n, t in model.transformer.state_dict().items()}
        native.update_weights(new, 1)
        backend.sleep()
        backend.wake_up()
        backend.update_weights(new, 1)
        a, b = native.generate(requests, ctx), backend.generate(requests, ctx)
        assert b.weight_version == 1 and backend.last_sync["buckets"] > 1
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.actions, b.actions)
        backend.shutdown()
    finally:
        ray.shutdown()
