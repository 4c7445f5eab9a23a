"""Pooled-text modulation (WNMConfig.pooled_text_modulation): a global path for the instruction."""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMModel
from verl_omni.models.wnm.context import WNMContext


def _inputs(model: WNMModel, b: int = 2, seed: int = 0):
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, *cfg.target_latent_shape, generator=g)
    actions = torch.randn(b, cfg.action_steps, cfg.action_channels, generator=g)
    sigma = torch.rand(b, generator=g)
    frames = torch.randint(0, 255, (b, cfg.history_frames, *cfg.image_size, 3), generator=g, dtype=torch.uint8)
    return target, actions, sigma, frames


def _pair():
    torch.manual_seed(0)
    plain = WNMModel(WNMConfig.from_size("tiny", num_layers=2)).eval()
    torch.manual_seed(0)
    pooled = WNMModel(WNMConfig.from_size("tiny", num_layers=2, pooled_text_modulation=True)).eval()
    missing, unexpected = pooled.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("transformer.text_pool_projector.") for k in missing)
    return plain, pooled


@torch.no_grad()
def test_fresh_pooled_path_is_the_plain_model():
    # The output layer starts at zero, so adding the path changes nothing until it trains.
    plain, pooled = _pair()
    target, actions, sigma, frames = _inputs(plain)
    texts = ["Go to the red chair.", "Walk over to the blue bed in the bedroom."]
    ctx = plain.encode_context(frames, texts)
    v_plain = plain.transformer(target, actions, sigma, ctx)
    v_pooled = pooled.transformer(target, actions, sigma, pooled.encode_context(frames, texts))
    for a, b in zip(v_plain, v_pooled, strict=True):
        assert torch.equal(a, b)


@torch.no_grad()
def test_pooled_vector_is_the_masked_mean_of_the_text_tokens():
    _, model = _pair()
    tr = model.transformer
    d, lt = model.config.dim, model.config.text_max_length
    # An identity projector exposes the pooled vector itself.
    tr.text_pool_projector = torch.nn.Identity()
    tokens = torch.zeros(1, lt + 3, d)
    tokens[0, 0], tokens[0, 1], tokens[0, 2] = 1.0, 3.0, 100.0  # token 2 is padding: masked out
    tokens[0, lt:] = 50.0  # image/geometry tokens are not text
    mask = torch.zeros(1, lt + 3, dtype=torch.bool)
    mask[0, :2] = True
    mask[0, lt:] = True
    ctx = WNMContext(torch.zeros(1, *model.config.history_latent_shape), tokens, mask)
    pooled = tr._pooled_text(ctx, torch.float32)
    assert torch.equal(pooled, torch.full((1, d), 2.0))  # (1 + 3) / 2


@torch.no_grad()
def test_trained_pooled_path_carries_the_instruction_into_every_block():
    plain, pooled = _pair()
    torch.nn.init.normal_(pooled.transformer.text_pool_projector[2].weight, std=0.5)
    target, actions, sigma, frames = _inputs(plain, b=1)
    ctx = plain.encode_context(frames, ["Go to the red chair."])
    # Same weights, same context: the only difference is the (now non-zero) pooled path.
    assert not torch.allclose(plain.transformer(target, actions, sigma, ctx)[1],
                              pooled.transformer(target, actions, sigma, ctx)[1])  # fmt: skip
    # It reads the text tokens only: other image/geometry tokens leave the pooled vector unchanged.
    lt = pooled.config.text_max_length
    other = ctx.encoder_tokens.clone()
    other[:, lt:] += 1.0
    swapped = WNMContext(ctx.history_latents, other, ctx.encoder_mask)
    assert torch.equal(pooled.transformer._pooled_text(ctx, torch.float32),
                       pooled.transformer._pooled_text(swapped, torch.float32))  # fmt: skip


def test_flag_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="pooled_text_modulation"):
        WNMConfig.from_size("tiny", pooled_text_modulation="yes")
    cfg = WNMConfig.from_size("tiny", pooled_text_modulation=True)
    assert WNMConfig.from_dict(cfg.to_dict()).pooled_text_modulation is True
    old = cfg.to_dict()
    del old["pooled_text_modulation"]  # a config written before the field existed
    assert WNMConfig.from_dict(old).pooled_text_modulation is False
