"""Pooled-text modulation (WNMConfig.pooled_text_modulation): a global path for the instruction; and the
gated-attention fusion of the instruction into the visual context tokens (WNMConfig.text_gated_context)."""

import pytest
import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMModel, load_wnm_checkpoint, save_wnm_checkpoint
from verl_omni.models.wnm.context import WNMContext
from verl_omni.models.wnm.transformer import masked_mean

GATE_KEYS = {f"transformer.text_gate_{kind}.{p}" for kind in ("image", "geometry") for p in ("weight", "bias")}


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


# ----- gated context (text_gated_context) -----------------------------------------------------------------
def _gated_pair(variant: str = "wnm_3d"):
    # Extra parameters shift the RNG stream of later initialisations, so the same seed alone would not give the
    # same weights: the gated model takes the plain model's state dict instead (its gates stay at zero).
    torch.manual_seed(0)
    plain = WNMModel(WNMConfig.from_size("tiny", variant=variant, num_layers=2)).eval()
    gated = WNMModel(WNMConfig.from_size("tiny", variant=variant, num_layers=2, text_gated_context=True)).eval()
    missing, unexpected = gated.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected
    return plain, gated, set(missing)


def _features(model: WNMModel, b: int = 2, seed: int = 1) -> dict:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, cfg.text_max_length, dtype=torch.bool)
    for i in range(b):
        mask[i, : 3 + 5 * i] = True  # different prompt lengths, the rest padding
    geo = None if cfg.variant == "wnm_2d" else torch.randn(b, cfg.geometry_tokens, cfg.geometry_dim, generator=g)
    return {
        "text": torch.randn(b, cfg.text_max_length, cfg.text_dim, generator=g),
        "text_mask": mask,
        "image": torch.randn(b, cfg.image_tokens, cfg.image_dim, generator=g),
        "geometry": geo,
    }


@torch.no_grad()
def test_fresh_gated_context_is_the_plain_model():
    plain, gated, missing = _gated_pair()
    assert missing == GATE_KEYS
    target, actions, sigma, frames = _inputs(plain)
    texts = ["Go to the yellow plant.", "Walk over to the blue bed in the bedroom."]
    ctx_plain, ctx_gated = plain.encode_context(frames, texts), gated.encode_context(frames, texts)
    assert torch.equal(ctx_plain.encoder_tokens, ctx_gated.encoder_tokens)
    for a, b in zip(plain.transformer(target, actions, sigma, ctx_plain),
                    gated.transformer(target, actions, sigma, ctx_gated), strict=True):  # fmt: skip
        assert torch.equal(a, b)
    # wnm_2d has no geometry tokens, hence no geometry gate.
    _, gated_2d, missing_2d = _gated_pair("wnm_2d")
    assert missing_2d == {k for k in GATE_KEYS if "image" in k} and gated_2d.transformer.text_gate_geometry is None
    assert plain.transformer.text_gate_image is None and plain.transformer.text_gate_geometry is None


@torch.no_grad()
def test_gate_multiplies_the_visual_tokens_channel_wise():
    plain, gated, _ = _gated_pair()
    cfg = plain.config
    d, lt, li = cfg.dim, cfg.text_max_length, cfg.image_tokens
    b_img = torch.linspace(-2.0, 2.0, d)
    b_geo = torch.linspace(1.0, -0.5, d)
    gated.transformer.text_gate_image.bias.copy_(b_img)  # weights stay zero: the gate is 1 + tanh(bias)
    gated.transformer.text_gate_geometry.bias.copy_(b_geo)
    f = _features(plain)
    args = (f["text"], f["text_mask"], f["image"], f["geometry"])
    want, want_mask = plain.transformer.project_context(*args)
    got, got_mask = gated.transformer.project_context(*args)
    assert torch.equal(got_mask, want_mask)
    assert torch.equal(got[:, :lt], want[:, :lt])  # text tokens are not gated
    assert torch.equal(got[:, lt : lt + li], want[:, lt : lt + li] * (1 + torch.tanh(b_img)))
    assert torch.equal(got[:, lt + li :], want[:, lt + li :] * (1 + torch.tanh(b_geo)))


@torch.no_grad()
def test_masked_mean_ignores_padded_positions():
    tokens = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [100.0, -100.0]],
                           [[4.0, 0.0], [50.0, 50.0], [60.0, 60.0]]])  # fmt: skip
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert torch.equal(masked_mean(tokens, mask), torch.tensor([[2.0, 4.0], [4.0, 0.0]]))
    assert torch.equal(masked_mean(tokens, None), tokens.mean(1))
    # No real position: zeros, not NaN.
    assert torch.equal(masked_mean(tokens, torch.zeros(2, 3, dtype=torch.bool)), torch.zeros(2, 2))
    # Inside project_context the padded text positions (which hold the projection's bias, not zeros) are skipped:
    # with an identity gate Linear the gate is 1 + tanh(pooled) of the real text tokens only.
    plain, gated, _ = _gated_pair()
    lt, li = plain.config.text_max_length, plain.config.image_tokens
    gated.transformer.text_gate_image.weight.copy_(torch.eye(plain.config.dim))
    f = _features(plain)
    args = (f["text"], f["text_mask"], f["image"], f["geometry"])
    want, _ = plain.transformer.project_context(*args)
    got, _ = gated.transformer.project_context(*args)
    for i in range(2):
        n = int(f["text_mask"][i].sum())
        pooled = want[i, :n].sum(0) / n
        assert torch.allclose(got[i, lt : lt + li], want[i, lt : lt + li] * (1 + torch.tanh(pooled)), atol=1e-6)


def test_gradient_reaches_the_gate_weights():
    _, gated, _ = _gated_pair()
    gated.train()
    target, actions, sigma, frames = _inputs(gated)
    feats = gated.encode_condition_features(frames, ["Go to the yellow plant.", "Find the red chair."])
    ctx = gated.context_from_features(gated.encode_video(frames), feats)
    v_video, v_action = gated.transformer(target, actions, sigma, ctx)
    (v_video.square().mean() + v_action.square().mean()).backward()
    for gate in (gated.transformer.text_gate_image, gated.transformer.text_gate_geometry):
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    trainable = {n for n, p in gated.transformer.named_parameters() if p.requires_grad}
    assert {k.removeprefix("transformer.") for k in GATE_KEYS} <= trainable


def test_gated_flag_is_validated_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match="text_gated_context"):
        WNMConfig.from_size("tiny", text_gated_context=1)
    cfg = WNMConfig.from_size("tiny", num_layers=1, text_gated_context=True)
    assert WNMConfig.from_dict(cfg.to_dict()).text_gated_context is True
    old = cfg.to_dict()
    del old["text_gated_context"]  # a config written before the field existed
    assert WNMConfig.from_dict(old).text_gated_context is False
    # Through a complete checkpoint: the flag and the (trained) gate weights come back.
    torch.manual_seed(0)
    model = WNMModel(cfg, ActionNormalization(mean=(0.0,) * 4, std=(1.0,) * 4))
    with torch.no_grad():
        torch.nn.init.normal_(model.transformer.text_gate_image.weight)
        torch.nn.init.normal_(model.transformer.text_gate_geometry.bias)
    loaded = load_wnm_checkpoint(save_wnm_checkpoint(model, tmp_path / "ck", {"run": "test"}))
    assert loaded.config.text_gated_context is True
    for k in ("text_gate_image.weight", "text_gate_geometry.bias"):
        assert torch.equal(loaded.transformer.state_dict()[k], model.transformer.state_dict()[k])
