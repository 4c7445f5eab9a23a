"""Native backend on the real tiny WNMModel (randomly initialized through the model API, no checkpoint)."""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_shared import (
    NativeBackendConfig,
    NativeRolloutBackend,
    RolloutRequest,
    SamplerConfig,
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    h, w = model.config.image_size
    gen = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (3, 33, h, w, 3), dtype=torch.uint8, generator=gen)
    ctx = model.encode_context(frames, ["go to the door", "turn left and stop", "follow the hallway"])
    return model, ctx


def test_request_bit_identical_alone_and_among_other_prompts(tiny):
    model, ctx = tiny
    sampler = SamplerConfig(num_steps=3, window_strategy="fixed", window_start=0, window_size=2)
    backend = NativeRolloutBackend.from_model(model, sampler, NativeBackendConfig())
    target = RolloutRequest("p1", stratum=2, branch=1, step=5, seed=7, context_row=1)
    others = [
        RolloutRequest(f"p{r}", stratum=0, branch=b, step=5, seed=7, context_row=r) for r in (0, 2) for b in (0, 1)
    ]
    mixed = backend.generate([others[0], others[2], target, others[1]], ctx)
    alone = backend.generate([target], ctx)
    i = mixed.request_ids.index(target.request_id)
    for name in ("actions", "video_latents", "window_states", "logprobs"):
        assert torch.equal(getattr(alone, name)[0], getattr(mixed, name)[i]), name
    assert alone.video_latents.shape[1:] == model.config.target_latent_shape
    assert alone.logprobs.shape == (1, 2, 9) and torch.isfinite(alone.logprobs).all()
    assert set(alone.actions[0, :, 3].tolist()) <= {0.0, 1.0}


def test_from_model_uses_checkpoint_normalization(tiny):
    model, _ = tiny
    backend = NativeRolloutBackend.from_model(model, SamplerConfig(num_steps=3))
    assert backend.normalization == model.action_normalization
    assert backend.layout.video_shape == model.config.target_latent_shape


def test_variant_packages_pick_their_variant(tiny):
    from verl_omni.pipelines import wnm_2d, wnm_3d

    model, _ = tiny
    assert isinstance(wnm_3d.build_backend(model, sampler=SamplerConfig(num_steps=3)), NativeRolloutBackend)
    with pytest.raises(ValueError, match="wnm_2d pipeline got a model of variant 'wnm_3d'"):
        wnm_2d.build_backend(model)
    with pytest.raises(ValueError, match="rollout backend 'vllm'"):
        wnm_3d.build_backend(model, backend="vllm")
