"""bench_trainer's --light-encoders: the wan2.1-1.3b benchmark checkpoint from a flag instead of five --ckpt-set."""

from __future__ import annotations

from stage3_e2e_helpers import load_script


def test_light_encoders_come_first_so_ckpt_set_overrides_them():
    bench = load_script("bench_trainer")
    # The five settings docs/benchmarks.md used as --ckpt-set items for the wan2.1-1.3b runs, written out here.
    light = (
        "text_encoder_kind=builtin",
        "image_encoder_kind=builtin",
        "image_tokens=256",
        "vae_kind=tiny",
        "geometry_frames=4",
    )
    assert bench.checkpoint_overrides(False, []) == ()
    assert bench.checkpoint_overrides(False, ["num_layers=2"]) == ("num_layers=2",)
    assert bench.checkpoint_overrides(True, ["image_tokens=64"]) == (*light, "image_tokens=64")


def test_light_encoders_build_a_full_size_dit_config():
    """The set is valid WNMConfig input at wan2.1-1.3b and keeps the size's DiT (Wan2.1-1.3B: 30 blocks of 12 heads
    x 128, FFN 8960)."""
    from verl_omni.models.wnm import WNMConfig

    bench = load_script("bench_trainer")
    maker = load_script("tools/checkpoint/make_tiny_wnm_checkpoint.py")
    overrides = maker.parse_overrides(list(bench.checkpoint_overrides(True, [])))
    assert overrides == {
        "text_encoder_kind": "builtin",
        "image_encoder_kind": "builtin",
        "image_tokens": 256,
        "vae_kind": "tiny",
        "geometry_frames": 4,
    }
    cfg = WNMConfig.from_size("wan2.1-1.3b", **overrides)
    full = WNMConfig.from_size("wan2.1-1.3b")
    dit = ("num_layers", "num_heads", "head_dim", "ffn_dim")
    assert [getattr(cfg, f) for f in dit] == [getattr(full, f) for f in dit] == [30, 12, 128, 8960]
    assert (cfg.image_tokens, cfg.geometry_frames, cfg.vae_kind) == (256, 4, "tiny")
