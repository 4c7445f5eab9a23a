"""WNMModel: frozen parts, context encoding once per prompt, VAE round trip shapes."""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMModel

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WNMModel(WNMConfig.from_size("tiny", num_layers=2))


def _frames(b, t=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t, 64, 64, 3), generator=g, dtype=torch.uint8)


def test_frozen_parts_have_no_grad_and_stay_eval(model):
    for name in ("vae", "text_encoder", "image_encoder", "geometry_encoder"):
        part = getattr(model, name)
        assert not any(p.requires_grad for p in part.parameters()), name
    model.train()
    assert model.transformer.training
    for name in ("vae", "text_encoder", "image_encoder", "geometry_encoder"):
        assert not getattr(model, name).training, name
        assert not any(m.training for m in getattr(model, name).modules()), name
    assert all(p.requires_grad for p in model.transformer.parameters())


def test_encode_context_shapes_and_reuse(model):
    frames = _frames(2)
    ctx = model.encode_context(frames, ["go to the kitchen", "stop at the door"])
    assert ctx.history_latents.shape == (2, 16, 9, 8, 8)
    assert ctx.encoder_tokens.shape == (2, 64, 128)
    # "go to the kitchen" is 17 bytes + end marker; image 16 + geometry 16 tokens always attended.
    assert ctx.encoder_mask[0].sum().item() == 18 + 32
    assert not ctx.encoder_tokens.requires_grad
    # One encoded prompt shared by its rollouts gives the same result as encoding the repeated prompt.
    shared = ctx.select(torch.tensor([0, 0, 1]))
    direct = model.encode_context(frames[[0, 0, 1]], ["go to the kitchen", "go to the kitchen", "stop at the door"])
    torch.testing.assert_close(shared.encoder_tokens, direct.encoder_tokens, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.history_latents, direct.history_latents, rtol=1e-5, atol=1e-5)


def test_video_encode_decode_shapes(model):
    lat = model.encode_video(_frames(1, t=9))
    assert lat.shape == (1, 16, 3, 8, 8)
    out = model.decode_video(lat)
    assert out.shape == (1, 9, 64, 64, 3) and out.dtype == torch.uint8


def test_wnm_2d_has_no_geometry():
    torch.manual_seed(0)
    m = WNMModel(WNMConfig.from_size("tiny", variant="wnm_2d", num_layers=1))
    assert m.geometry_encoder is None and m.transformer.geometry_projector is None
    ctx = m.encode_context(_frames(1), ["go"])
    assert ctx.encoder_tokens.shape == (1, 48, 128)


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="history_frames must have 33 frames"):
        model.encode_context(_frames(1, t=9), ["go"])
    with pytest.raises(ValueError, match="instructions"):
        model.encode_context(_frames(1), ["a", "b"])
    with pytest.raises(ValueError, match="uint8"):
        model.encode_video(_frames(1).float())
