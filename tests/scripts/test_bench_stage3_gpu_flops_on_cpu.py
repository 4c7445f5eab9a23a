"""The FLOP model of scripts/bench_stage3_gpu.py counts the work our forward does when the last block skips the
history tokens' outputs: checked by hand and against PyTorch's own matmul FLOP counter."""

import runpy
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
from verl_omni.models.wnm import transformer as wnm_transformer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(REPO / "scripts/bench_stage3_gpu.py"), run_name="bench_stage3_gpu")


def test_forward_flops_by_hand(bench):
    # One layer, dim 2, 20 block weights, batch 1, 3 tokens, context 5: linear 2*20*3 = 120, attention
    # 4*3*3*2 + 4*3*5*2 = 72 + 120 = 192.
    assert bench["forward_flops"](20, 1, 3, 5, 2, 1) == 120 + 192
    # One unread token: its queries (4*1*3*2 = 24 and 4*1*5*2 = 40) and its 20 - 4*2*2 = 4 weights without the
    # key/value projections (2*4 = 8) are not done.
    assert bench["forward_flops"](20, 1, 3, 5, 2, 1, unread=1) == 120 + 192 - 24 - 40 - 8


def test_the_skipped_matmul_work_matches_pytorchs_flop_counter(bench, monkeypatch):
    torch.manual_seed(0)
    cfg = WNMConfig.from_size("tiny", num_layers=2)
    model = WNMTransformer(cfg).eval()
    b = 2
    ctx = WNMContext(history_latents=torch.randn(b, *cfg.history_latent_shape),
                     encoder_tokens=torch.randn(b, cfg.context_tokens, cfg.dim), encoder_mask=None)  # fmt: skip
    inputs = (torch.randn(b, *cfg.target_latent_shape), torch.randn(b, cfg.action_steps, cfg.action_channels),
              torch.rand(b), ctx)  # fmt: skip
    counted = {}
    for skip in (True, False):
        monkeypatch.setattr(wnm_transformer, "SKIP_UNREAD_OUTPUTS", skip)
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(*inputs)
        counted[skip] = counter.get_total_flops()  # matmuls and convolutions (SDPA is not counted on CPU)
    saved_by_counter = counted[False] - counted[True]
    assert saved_by_counter > 0

    n_block = sum(p.numel() for p in model.blocks.parameters())
    seq = cfg.history_tokens + cfg.target_tokens + cfg.action_steps
    u = cfg.history_tokens
    args = (n_block, b, seq, cfg.context_tokens, cfg.dim, cfg.num_layers)
    saved = bench["forward_flops"](*args) - bench["forward_flops"](*args, unread=u)
    saved_attention = b * (4 * u * seq * cfg.dim + 4 * u * cfg.context_tokens * cfg.dim)
    # The model counts biases, norm weights and the modulation table as matmul weights: about 2% at these tiny dims
    # (dim 128), about 0.1% at Wan-1.3B dims.
    assert saved - saved_attention == pytest.approx(saved_by_counter, rel=0.03)
    monkeypatch.setattr(wnm_transformer, "SKIP_UNREAD_OUTPUTS", False)
    assert bench["unread_tokens"](cfg) == 0
    monkeypatch.setattr(wnm_transformer, "SKIP_UNREAD_OUTPUTS", True)
    assert bench["unread_tokens"](cfg) == u


def test_isolated_forward_flops_by_hand(bench):
    class Cfg:  # 2 target + 1 action tokens over 4 cached history tokens, context 5, dim 2, one layer
        target_tokens, action_steps, history_tokens, context_tokens, dim, num_layers = 2, 1, 4, 5, 2, 1

    # linear 2*20*3 = 120; self-attention 4*3*(4+3)*2 = 168; cross-attention 4*3*5*2 = 120.
    assert bench["isolated_forward_flops"](20, 1, Cfg) == 120 + 168 + 120


def test_text_valid_context_masks_the_padded_text_and_flops_count_the_attended_tokens(bench):
    cfg = WNMConfig.from_size("tiny")  # 32 text positions first in the context
    args = bench["parse_args"](["--device", "cpu", "--size", "tiny", "--text-valid", "5"])
    ctx = bench["group_context"](cfg, args, torch.device("cpu"), torch.float32)
    assert ctx.encoder_mask[0, :5].all() and not ctx.encoder_mask[0, 5:32].any() and ctx.encoder_mask[0, 32:].all()
    assert bench["attended_tokens"](ctx) == cfg.context_tokens - 27


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group-variants", "fp8", "--fp8-groups", "nope"], "--fp8-groups must be comma-separated names"),
        (["--group-variants", "eager", "--fp8-groups", "attention"], "--fp8-groups needs fp8"),
        (["--text-valid", "0"], "--text-valid must be >= 1"),
    ],
)
def test_bad_fp8_groups_and_text_valid_are_refused_by_name(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench["parse_args"](["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_padded_instruction_masks_only_the_text_positions_past_the_valid_ones(bench):
    cfg = WNMConfig.from_size("tiny")
    b, n = 2, cfg.context_tokens
    mask = torch.ones(b, n, dtype=torch.bool)
    ctx = WNMContext(torch.zeros(b, *cfg.history_latent_shape), torch.zeros(b, n, cfg.dim), mask)
    args = (torch.zeros(1), torch.zeros(1), torch.zeros(1), ctx)
    assert bench["padded_instruction"](args, None, cfg) is args
    out = bench["padded_instruction"](args, 3, cfg)[3]
    # Text positions 3 .. text_max_length - 1 are padding; the first 3 and the image/geometry tokens after the
    # text stay attended, and the input's mask is left as it was.
    want = torch.ones(b, n, dtype=bool)
    want[:, 3 : cfg.text_max_length] = False
    assert torch.equal(out.encoder_mask, want) and ctx.encoder_mask.all()
    assert out.encoder_tokens is ctx.encoder_tokens and out.history_latents is ctx.history_latents
