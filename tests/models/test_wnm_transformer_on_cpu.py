"""WNMTransformer: shapes, sequence layout, RoPE, per-token timesteps, Wan weight compatibility."""

import math

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformer3DModel, WanTransformerBlock
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
from verl_omni.models.wnm.rope import action_positions, rope_from_positions
from verl_omni.models.wnm.transformer import WNMTransformerBlock

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cfg():
    return WNMConfig.from_size("tiny", num_layers=2)


def test_output_shapes_and_grad_reach_action_and_video_parts(cfg):
    torch.manual_seed(0)
    model = WNMTransformer(cfg)
    x, a, s, ctx = random_dit_inputs(cfg, b=3)
    v_video, v_action = model(x, a, s, ctx)
    assert v_video.shape == (3, 16, 9, 8, 8)
    assert v_action.shape == (3, 32, 4)
    (v_video.square().mean() + v_action.square().mean()).backward()
    assert model.action_embedder[0].weight.grad.abs().sum() > 0
    assert model.patch_embedding.weight.grad.abs().sum() > 0
    assert model.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0


def test_sequence_layout_fixed_by_config(cfg):
    model = WNMTransformer(cfg)
    layout = model.sequence_layout()
    # tiny: 64x64 frames -> 8x8 latents -> 4x4 patches = 16 tokens per latent frame, 9 latent frames per clip.
    assert layout == {"history": slice(0, 144), "target": slice(144, 288), "action": slice(288, 320)}
    assert cfg.sequence_length == 320


def test_history_content_changes_prediction_but_not_target_layout(cfg):
    torch.manual_seed(0)
    model = WNMTransformer(cfg).eval()
    x, a, s, ctx = random_dit_inputs(cfg)
    with torch.no_grad():
        v1, a1 = model(x, a, s, ctx)
        ctx2 = WNMContext(ctx.history_latents + 1.0, ctx.encoder_tokens, ctx.encoder_mask)
        v2, a2 = model(x, a, s, ctx2)
    assert v1.shape == v2.shape and a1.shape == a2.shape
    assert not torch.allclose(v1, v2) and not torch.allclose(a1, a2)  # history is attended to
    assert model.sequence_layout()["target"] == slice(144, 288)


def test_video_rope_equals_wan_rope_on_concatenated_clip(cfg):
    model = WNMTransformer(cfg)
    cos, sin = model.rotary_embedding(torch.device("cpu"))
    th, tt = cfg.history_latent_shape[1], cfg.target_latent_shape[1]
    wan_rope = WanRotaryPosEmbed(cfg.head_dim, cfg.patch_size, 1024)
    video = torch.zeros(1, cfg.latent_channels, th + tt, *cfg.latent_hw)
    wcos, wsin = wan_rope(video)
    n_video = model.sequence_layout()["action"].start
    torch.testing.assert_close(cos[:, :n_video], wcos, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, :n_video], wsin, rtol=0, atol=0)


def test_action_positions_are_time_aligned():
    pos = action_positions(t0=9, steps=32, temporal_compression=4)
    # step 0 ends at target raw frame 1 -> latent time 9 + 1/4; step 31 ends at raw frame 32 -> latent 9 + 8.
    assert pos[0].tolist() == [9.25, 0.0, 0.0]
    assert pos[31].tolist() == [17.0, 0.0, 0.0]
    cos, sin = rope_from_positions(pos[:1], head_dim=12)
    # head_dim 12 -> (t, h, w) dims (4, 4, 4); t frequencies 1 and 1/sqrt(10000) = 0.01.
    expected_t = [math.cos(9.25), math.cos(9.25), math.cos(0.0925), math.cos(0.0925)]
    torch.testing.assert_close(cos[0, 0, 0, :4], torch.tensor(expected_t), rtol=1e-6, atol=1e-6)
    assert torch.all(cos[0, 0, 0, 4:] == 1) and torch.all(sin[0, 0, 0, 4:] == 0)


def _block_pair(cfg, seed=0):
    torch.manual_seed(seed)
    ref = WanTransformerBlock(cfg.dim, cfg.ffn_dim, cfg.num_heads, "rms_norm_across_heads", True, cfg.eps)
    ours = WNMTransformerBlock(cfg.dim, cfg.ffn_dim, cfg.num_heads, "rms_norm_across_heads", True, cfg.eps)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref.eval(), ours.eval()


def test_block_matches_diffusers_block_uniform_and_per_token(cfg):
    ref, ours = _block_pair(cfg)
    g = torch.Generator().manual_seed(1)
    b, s, n_ctx = 2, 40, 7
    x = torch.randn(b, s, cfg.dim, generator=g)
    ctx = torch.randn(b, n_ctx, cfg.dim, generator=g)
    rope = rope_from_positions(torch.rand(s, 3, generator=g) * 5, cfg.head_dim)
    temb = torch.randn(b, 6, cfg.dim, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ctx, temb, rope), ref(x, ctx, temb, rope), rtol=1e-6, atol=1e-6)
        # Two groups (clean 15 tokens, noisy 25) vs diffusers' per-token [B, S, 6, D] path (Wan2.2 TI2V).
        grouped = torch.randn(b, 2, 6, cfg.dim, generator=g)
        per_token = torch.cat([grouped[:, :1].expand(b, 15, 6, cfg.dim), grouped[:, 1:].expand(b, 25, 6, cfg.dim)], 1)
        out = ours(x, ctx, grouped, rope, None, [15, 25])
        torch.testing.assert_close(out, ref(x, ctx, per_token, rope), rtol=1e-5, atol=1e-5)


def test_context_mask_equals_dropping_masked_tokens(cfg):
    _, ours = _block_pair(cfg)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 10, cfg.dim, generator=g)
    ctx = torch.randn(1, 6, cfg.dim, generator=g)
    rope = rope_from_positions(torch.zeros(10, 3), cfg.head_dim)
    temb = torch.randn(1, 6, cfg.dim, generator=g)
    mask = torch.tensor([[True, True, False, True, False, True]])
    with torch.no_grad():
        masked = ours(x, ctx, temb, rope, mask)
        dropped = ours(x, ctx[:, mask[0]], temb, rope)
        all_true = ours(x, ctx, temb, rope, torch.ones(1, 6, dtype=torch.bool))
        unmasked = ours(x, ctx, temb, rope)
    torch.testing.assert_close(masked, dropped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(all_true, unmasked, rtol=1e-6, atol=1e-6)


def _tiny_wan(cfg):
    torch.manual_seed(3)
    return WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        eps=cfg.eps,
    ).eval()


def test_wan_state_dict_initializes_video_part_and_blocks_match(cfg):
    wan = _tiny_wan(cfg)
    torch.manual_seed(4)
    model = WNMTransformer(cfg).eval()
    missing, unexpected = model.load_wan_video_weights(wan.state_dict())
    assert missing == [] and unexpected == []
    for k, v in wan.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k

    # Same input through Wan's and our blocks (Wan's rope/time/text embedders produce the inputs).
    g = torch.Generator().manual_seed(5)
    video = torch.randn(1, cfg.latent_channels, 4, *cfg.latent_hw, generator=g)
    rope = wan.rope(video)
    hidden = wan.patch_embedding(video).flatten(2).transpose(1, 2)
    text = wan.condition_embedder.text_embedder(torch.randn(1, 5, cfg.text_dim, generator=g))
    t = torch.tensor([700.0])
    _, tproj, _, _ = wan.condition_embedder(t, torch.zeros(1, 1, cfg.text_dim))
    tproj = tproj.unflatten(1, (6, -1))
    with torch.no_grad():
        h_wan, h_ours = hidden, model._patchify(video)
        torch.testing.assert_close(h_ours, h_wan, rtol=0, atol=0)
        for wb, ob in zip(wan.blocks, model.blocks):
            h_wan, h_ours = wb(h_wan, text, tproj, rope), ob(h_ours, text, tproj, rope)
            torch.testing.assert_close(h_ours, h_wan, rtol=1e-6, atol=1e-6)
        # Our time embedding of (0, sigma) equals Wan's embedding of timesteps (0, 1000 sigma).
        temb, proj = model._time_embeddings(torch.tensor([0.7]), torch.float32)
        w_temb, w_proj, _, _ = wan.condition_embedder(torch.tensor([0.0, 700.0]), torch.zeros(2, 1, cfg.text_dim))
        torch.testing.assert_close(temb[0], w_temb, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(proj[0].flatten(1), w_proj, rtol=1e-6, atol=1e-6)


def test_wan_weights_report_missing_unexpected_and_shape_errors(cfg):
    wan_sd = _tiny_wan(cfg).state_dict()
    model = WNMTransformer(cfg)
    partial = {k: v for k, v in wan_sd.items() if not k.startswith("proj_out.")}
    partial["condition_embedder.image_embedder.norm1.weight"] = torch.ones(3)
    missing, unexpected = model.load_wan_video_weights(partial)
    assert missing == ["proj_out.weight", "proj_out.bias"]
    assert unexpected == ["condition_embedder.image_embedder.norm1.weight"]
    bad = dict(wan_sd)
    bad["blocks.0.attn1.to_q.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn1\.to_q\.weight"):
        model.load_wan_video_weights(bad)


def test_history_tokens_get_timestep_zero(cfg):
    model = WNMTransformer(cfg)
    temb_a, _ = model._time_embeddings(torch.tensor([0.2, 0.9]), torch.float32)
    temb_0, _ = model._time_embeddings(torch.tensor([0.0]), torch.float32)
    torch.testing.assert_close(temb_a[:, 0], temb_0[:, 0].expand(2, -1))
    assert not torch.allclose(temb_a[0, 1], temb_a[1, 1])


def test_context_select_and_to(cfg):
    _, _, _, ctx = random_dit_inputs(cfg, b=2)
    ctx = WNMContext(ctx.history_latents, ctx.encoder_tokens, torch.tensor([[True] * 63 + [False]] * 2))
    sel = ctx.select(torch.tensor([1, 1, 0]))
    assert sel.batch_size == 3
    assert torch.equal(sel.history_latents[0], ctx.history_latents[1])
    assert torch.equal(sel.encoder_tokens[2], ctx.encoder_tokens[0])
    half = sel.to(dtype=torch.float16)
    assert half.encoder_tokens.dtype == torch.float16 and half.encoder_mask.dtype == torch.bool
    with pytest.raises(ValueError, match="encoder_mask"):
        WNMContext(ctx.history_latents, ctx.encoder_tokens, torch.ones(2, 3, dtype=torch.bool))


def test_rejects_wrong_shapes(cfg):
    model = WNMTransformer(cfg)
    x, a, s, ctx = random_dit_inputs(cfg)
    with pytest.raises(ValueError, match="actions"):
        model(x, a[:, :8], s, ctx)
    with pytest.raises(ValueError, match="target_latents"):
        model(x[:, :, :3], a, s, ctx)


def test_activation_checkpointing_keeps_gradients():
    """Checkpointing inside each block recomputes the same math: gradients equal those of a plain backward."""
    from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer

    cfg = WNMConfig.from_size("tiny")
    torch.manual_seed(0)
    model = WNMTransformer(cfg)
    g = torch.Generator().manual_seed(1)
    ctx = WNMContext(
        torch.randn(2, *cfg.history_latent_shape, generator=g), torch.randn(2, cfg.context_tokens, cfg.dim, generator=g)
    )
    x = torch.randn(2, *cfg.target_latent_shape, generator=g)
    a = torch.randn(2, cfg.action_steps, cfg.action_channels, generator=g)
    grads = []
    for on in (False, True):
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing = on
        assert model.gradient_checkpointing is on and all(b.activation_checkpointing is on for b in model.blocks)
        v, va = model(x, a, torch.tensor([0.7, 0.2]), ctx)
        (v.square().mean() + va.square().mean()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert torch.equal(grads[0], grads[1])


def test_partial_activation_checkpointing_runs_the_first_blocks_twice_with_the_same_gradients():
    """``set_activation_checkpointing(n)`` checkpoints exactly the first n blocks: their forward runs again in the
    backward (non-reentrant checkpoint recomputes it), the others' once; the gradients are those of a plain
    backward, since the recomputation repeats the same fp32 ops on the same inputs."""
    cfg = WNMConfig.from_size("tiny")  # 4 blocks
    torch.manual_seed(0)
    model = WNMTransformer(cfg)
    assert len(model.blocks) == 4
    x, a, s, ctx = random_dit_inputs(cfg, seed=3)
    calls = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        # An instance attribute, as compile_blocks binds it: the block's forward calls it (twice when recomputed).
        def counted(*args, _i=i, _fn=block.block_forward, **kwargs):
            calls[_i] += 1
            return _fn(*args, **kwargs)

        block.block_forward = counted
    grads = {}
    for n, flags, runs in (
        (0, [False] * 4, [1] * 4),
        (2, [True, True, False, False], [2, 2, 1, 1]),
        (None, [True] * 4, [2] * 4),
    ):
        model.zero_grad(set_to_none=True)
        calls[:] = [0] * len(calls)
        model.set_activation_checkpointing(n)
        assert [b.activation_checkpointing for b in model.blocks] == flags
        v, va = model(x, a, s, ctx)
        (v.square().mean() + va.square().mean()).backward()
        assert calls == runs, (n, calls)
        grads[n] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert grads[0].abs().max() > 0
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[0], grads[None])


def test_activation_checkpointing_switches_and_refuses_bad_counts():
    model = WNMTransformer(WNMConfig.from_size("tiny"))  # 4 blocks
    model.set_activation_checkpointing(3)
    # The boolean view: True only when every block is checkpointed.
    assert model.gradient_checkpointing is False
    model.gradient_checkpointing = True
    assert [b.activation_checkpointing for b in model.blocks] == [True] * 4 and model.gradient_checkpointing is True
    model.set_activation_checkpointing(4)  # the model's depth: the same as all
    assert model.gradient_checkpointing is True
    model.gradient_checkpointing = False
    assert [b.activation_checkpointing for b in model.blocks] == [False] * 4
    for bad in (5, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"num_blocks .*this model has 4 blocks"):
            model.set_activation_checkpointing(bad)
        assert [b.activation_checkpointing for b in model.blocks] == [False] * 4  # left unchanged


def test_action_sigma_equal_to_sigma_is_the_shared_forward(cfg):
    torch.manual_seed(0)
    model = WNMTransformer(cfg)
    x, a, s, ctx = random_dit_inputs(cfg)
    for grad in (False, True):  # the no-grad and the autograd paths of the grouped modulation
        with torch.set_grad_enabled(grad):
            shared = model(x, a, s, ctx)
            split = model(x, a, s, ctx, action_sigma=s.clone())
        # Equal up to float rounding, not bit for bit: the time embedder runs on B*G rows (G = 2 shared, 3 split),
        # and CPU BLAS kernels may block a 4-row and a 6-row matmul differently (1-ulp differences on some CPUs).
        torch.testing.assert_close(shared[0], split[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(shared[1], split[1], rtol=1e-5, atol=1e-6)


def test_action_sigma_reaches_only_the_action_tokens_modulation(cfg):
    # Without blocks, every output token depends only on its own embedding and its group's noise level, so the
    # split forward must give the video of a shared forward at sigma and the actions of one at action_sigma.
    torch.manual_seed(0)
    model = WNMTransformer(cfg).eval()
    model.blocks = torch.nn.ModuleList()
    x, a, _, ctx = random_dit_inputs(cfg)
    s_video, s_action = torch.tensor([0.9, 0.2]), torch.tensor([0.1, 0.7])
    with torch.no_grad():
        v_split, a_split = model(x, a, s_video, ctx, action_sigma=s_action)
        v_video_level, _ = model(x, a, s_video, ctx)
        _, a_action_level = model(x, a, s_action, ctx)
        _, a_video_level = model(x, a, s_video, ctx)
    # Up to float rounding (see the test above: the time embedder's row count differs between the two forwards).
    torch.testing.assert_close(v_split, v_video_level, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_split, a_action_level, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a_split, a_video_level)


def test_action_sigma_is_checked(cfg):
    model = WNMTransformer(cfg)
    x, a, s, ctx = random_dit_inputs(cfg)
    with pytest.raises(ValueError, match="action_sigma must be"):
        model(x, a, s, ctx, action_sigma=torch.rand(3))
    model.set_history_attention("isolated")
    with pytest.raises(ValueError, match="Stage-II training input"):
        model(x, a, s, ctx, action_sigma=s)


class _NoAll(torch.Tensor):
    """A mask whose ``all()`` fails: stands for a device tensor whose check would wait for the device."""

    def all(self, *args, **kwargs):
        raise AssertionError("the mask was checked on the device although the context says what it holds")


def test_a_known_all_true_flag_skips_the_device_check_and_keeps_the_outputs(cfg):
    torch.manual_seed(0)
    model = WNMTransformer(cfg).eval()
    x, a, s, ctx = random_dit_inputs(cfg, b=2)
    partial = torch.ones_like(ctx.encoder_mask)
    partial[:, -5:] = False
    with torch.no_grad():
        for mask in (ctx.encoder_mask, partial):  # all True, then masking the last 5 context tokens
            unknown = model(x, a, s, WNMContext(ctx.history_latents, ctx.encoder_tokens, mask))
            flag = bool(mask.all())
            known = WNMContext(ctx.history_latents, ctx.encoder_tokens, mask.as_subclass(_NoAll),
                               encoder_mask_all_true=flag)  # fmt: skip
            for got, want in zip(model(x, a, s, known), unknown, strict=True):
                assert torch.equal(got, want)
    # Without the flag the check runs (and here fails), as before.
    with pytest.raises(AssertionError, match="checked on the device"):
        model(x, a, s, WNMContext(ctx.history_latents, ctx.encoder_tokens, partial.as_subclass(_NoAll)))
    # The flag follows the context: kept by to() and with_history_kv(); after select() an all-True mask stays all
    # True, any other becomes unknown (the chosen rows may be all True).
    known_true = WNMContext(ctx.history_latents, ctx.encoder_tokens, ctx.encoder_mask, encoder_mask_all_true=True)
    known_false = WNMContext(ctx.history_latents, ctx.encoder_tokens, partial, encoder_mask_all_true=False)
    assert known_true.select(torch.tensor([1])).encoder_mask_all_true is True
    assert known_false.select(torch.tensor([1])).encoder_mask_all_true is None
    assert known_false.to(dtype=torch.float16).encoder_mask_all_true is False
    assert known_false.with_history_kv(()).encoder_mask_all_true is False
