"""WNMConfig: presets, derived shapes (hand-computed), validation errors, serialisation."""

import pytest

from verl_omni.models.wnm import WNMConfig


def test_tiny_shapes_by_hand():
    cfg = WNMConfig.from_size("tiny")
    assert cfg.history_frames == 33 and cfg.target_frames == 33
    assert cfg.image_size == (64, 64)
    # (33 - 1) // 4 + 1 = 9 latent frames; 64 / 8 = 8 latent pixels.
    assert cfg.history_latent_shape == (16, 9, 8, 8)
    assert cfg.target_latent_shape == (16, 9, 8, 8)
    assert (cfg.action_steps, cfg.action_channels, cfg.action_chunks) == (32, 4, 4)
    assert cfg.dim == 128
    # text 32 + image 16 + geometry 16
    assert cfg.context_tokens == 64
    assert WNMConfig.from_size("tiny", variant="wnm_2d").context_tokens == 48


def test_real_sizes_take_wan_dims():
    w21 = WNMConfig.from_size("wan2.1-1.3b")
    assert (w21.dim, w21.num_layers, w21.ffn_dim, w21.text_dim, w21.latent_channels) == (1536, 30, 8960, 4096, 16)
    # 256 / 8 = 32 latent pixels, patch 2 -> 16 x 16 = 256 tokens per latent frame, 9 frames per clip.
    assert w21.sequence_length == 2 * 9 * 256 + 32
    w22 = WNMConfig.from_size("wan2.2-5b")
    assert (w22.dim, w22.ffn_dim, w22.latent_channels, w22.vae_spatial_compression) == (3072, 14336, 48, 16)
    assert w22.target_latent_shape == (48, 9, 22, 22)


def test_unknown_size_and_bad_fields_name_the_field():
    with pytest.raises(ValueError, match=r"WNMConfig\.size: unknown size 'huge'"):
        WNMConfig.from_size("huge")
    with pytest.raises(ValueError, match=r"WNMConfig\.history_frames"):
        WNMConfig.from_size("tiny", history_frames=32)
    with pytest.raises(ValueError, match=r"WNMConfig\.image_size"):
        WNMConfig.from_size("tiny", image_size=(60, 64))
    with pytest.raises(ValueError, match=r"WNMConfig\.variant"):
        WNMConfig.from_size("tiny", variant="wnm_4d")
    with pytest.raises(ValueError, match=r"WNMConfig\.target_frames"):
        WNMConfig.from_size("tiny", target_frames=29)


def test_dict_roundtrip_and_unknown_field():
    cfg = WNMConfig.from_size("small", variant="wnm_2d")
    assert WNMConfig.from_dict(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    d["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        WNMConfig.from_dict(d, source="x/config.json")


def test_transform_metadata():
    meta = WNMConfig.from_size("tiny").transform_metadata()
    assert meta["history_frames"] == 33 and meta["target_frames"] == 33
    assert meta["image_size"] == [64, 64] and meta["fps"] == 4
    assert meta["action_layout"]["channels"] == ["dx", "dy", "dyaw", "stop"]
    assert meta["action_layout"]["steps"] == 32 and meta["action_layout"]["chunks"] == 4
