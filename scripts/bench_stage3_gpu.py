#!/usr/bin/env python
"""Stage-III GPU benchmark in one run: rollout DiT forward, one counterfactual group, one FSDP2 training step.

Measures, in one process and against references measured in the same run:

  peak   bf16 matrix-product peak (8192^3 GEMM): the denominator of every "fraction of peak" below.
  (a)    DiT forward at each batch: plain diffusers ``WanTransformer3DModel`` eager and with
         ``compile_repeated_blocks(fullgraph=True)`` (the two anchors) vs our ``WNMTransformer`` eager and with
         ``compile_blocks()``, for each attention backend asked for; model TFLOP/s and the speed-up over both
         anchors (diffusers eager, diffusers compiled).
  check  numerics of the fast path on fresh random inputs: bf16 (eager and compiled) velocities and ODE-sampled
         actions against an fp32 eager copy of the same weights.
  (b)    one counterfactual group end to end through ``NativeRolloutBackend.generate``: 16 rollouts
         (4 strata x 4 branches), K denoising steps, an SDE window of W steps; with and without the shared
         Euler prefix, eager and compiled.
  (c)    one training step over the group's window transitions on a single-rank FSDP2 model (bf16 params,
         fp32 master weights and AdamW, fp32 SDE math), run by the product's actor
         (``WNMDiffusionActor.update_policy``, the class the Ray worker uses): recompute log-probs with grad,
         clipped layer loss, backward, clip, optimizer step; plus the largest |logp_rollout - logp_recomputed|.
         ``--ckpt-blocks`` sweeps how many blocks (from the first) run under activation checkpointing; a variant
         that runs out of device memory is reported as OOM and the sweep goes on.
  (d)    peak memory of every phase.

Model FLOPs are counted as 2 x (block parameters) x tokens for the matmuls, plus 4 x S^2 x D (self-attention)
and 4 x S x L x D (cross-attention) per layer; a training step counts 3 x the forward. Weights are random:
nothing is downloaded. The last thing printed is the summary table.

    python scripts/bench_stage3_gpu.py --device cuda --size wan2.1-1.3b --compile --out docs/bench/run.txt
    # only (c), compiled, checkpointing all / 20 / 10 / no blocks at micro-batch 16:
    python scripts/bench_stage3_gpu.py --device cuda --size wan2.1-1.3b --compile --skip a,check,b \
        --train-variants compiled --checkpointing on --ckpt-micro-batch 16 --ckpt-blocks all,20,10,0
    python scripts/bench_stage3_cpu.py        # the CPU-safe sibling: tiny size, fp32, small batches
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time, peak_gib, reset_peak, sm_clock_mhz, timed_once, wan_anchor  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="wan2.1-1.3b", help="WNMConfig size preset (default: wan2.1-1.3b)")
    p.add_argument("--device", default="cuda", help="cuda[:N] or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="DiT compute dtype")
    p.add_argument("--batches", default="1,4,16", help="forward batch sizes for (a)")
    p.add_argument("--text-tokens", type=int, default=512, help="text context tokens of the diffusers anchor")
    p.add_argument("--compile", action="store_true", help="also measure torch.compile'd blocks")
    p.add_argument(
        "--isolated-history",
        action="store_true",
        help="also measure the opt-in history_attention='isolated' model (history keys/values cached per prompt)",
    )
    p.add_argument(
        "--attention",
        default="default",
        help="our DiT's attention backend(s) in (a), comma-separated from default, cudnn, fa4 (FlashAttention-4), or "
        "both (= cudnn,default, and also times diffusers with cuDNN); the first one listed runs check, (b) and (c)",
    )
    p.add_argument(
        "--group-variants",
        default="eager-unshared,eager,compiled,isolated",
        help="(b) variants to time: eager-unshared, eager, compiled, compiled-no-epilogue (the feed-forward's GELU "
        "as a kernel of its own, not in the GEMM's epilogue), compiled-inductor-rope (self-attention's q/k norm "
        "and RoPE fused by inductor instead of the Triton kernel of rms_norm_rope.py), compiled-residual-in-block "
        "(each block adds its own feed-forward residual instead of leaving it to the next), "
        "compiled-session38 (the residual in its block and the add + norm by inductor: session 38's rollout), "
        "isolated, "
        "fp8 (the opt-in FP8 rollout copy, compiled with --compile; its log-prob drift from the bf16 model is "
        "reported beside the bf16 control)",
    )
    p.add_argument(
        "--fp8-groups",
        default=None,
        help="(b) with the fp8 variant: also time a copy converting only these comma-separated layer groups "
        "(attention, feed_forward_in, feed_forward_out)",
    )
    p.add_argument("--train-variants", default="eager,compiled", help="(c): eager, compiled (compiled needs --compile)")
    p.add_argument(
        "--text-valid",
        type=int,
        default=None,
        help="(b) and (c): the group's context attends to only this many text positions, as a real padded "
        "instruction does (FLOPs then count the attended context); default: all attended",
    )
    p.add_argument("--num-steps", type=int, default=10, help="denoising steps K of the group")
    p.add_argument("--window-size", type=int, default=2, help="SDE window steps W")
    p.add_argument("--window-start", type=int, default=3, help="first SDE step of the (fixed) window")
    p.add_argument("--micro-batch", type=int, default=4, help="transitions per forward/backward in (c)")
    p.add_argument(
        "--checkpointing",
        default="off",
        help="activation checkpointing in (c): off, on or both; none runs only the --memory-budgets variants",
    )
    p.add_argument("--ckpt-micro-batch", type=int, default=16, help="transitions per forward/backward with it")
    p.add_argument(
        "--ckpt-blocks",
        default="all",
        help="(c) with checkpointing on: comma-separated counts of blocks, from the first, to checkpoint (all or "
        "ints in [0, layers]), e.g. all,20,10,0; one variant each, at --ckpt-micro-batch",
    )
    p.add_argument(
        "--memory-budgets",
        default="",
        help="(c), compiled: comma-separated torch._functorch activation memory budgets (0 < b < 1), one variant "
        "each without activation checkpointing at --ckpt-micro-batch: inductor's partitioner then chooses what to "
        "recompute in backward under that share of the default saved-activation memory",
    )
    p.add_argument(
        "--skip", default="", help="comma-separated parts to skip: a, check, ode (check's sampler part), b, c"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, help="also write the whole report to this text file (must not exist)")
    p.add_argument(
        "--train-steps",
        type=int,
        default=3,
        help="(c): timed optimizer steps per variant after the first (compiling) one; the report gives their median, "
        "min and max (default 3)",
    )
    p.add_argument(
        "--profile-train",
        type=int,
        default=0,
        metavar="TOP",
        help="(c): profile one more step of each variant and print its kernel table with TOP kernels (0 = off)",
    )
    p.add_argument("--json", type=Path, help="write the measurements as JSON (must not exist)")
    args = p.parse_args(argv)
    for path in (args.out, args.json):
        if path is not None and path.exists():
            p.error(f"{path} already exists; choose a new file")
    if args.checkpointing not in ("off", "on", "both", "none"):
        p.error(f"--checkpointing must be off, on, both or none, got {args.checkpointing!r}")
    if args.train_steps < 1:
        p.error(f"--train-steps must be >= 1, got {args.train_steps}")
    try:
        args.ckpt_block_counts = ckpt_block_counts(args.ckpt_blocks)
    except ValueError as e:
        p.error(f"--ckpt-blocks: {e}")
    try:
        args.memory_budget_values = [float(v) for v in _csv(args.memory_budgets)]
    except ValueError:
        p.error(f"--memory-budgets must be comma-separated numbers in (0, 1), got {args.memory_budgets!r}")
    if any(not 0 < b < 1 for b in args.memory_budget_values):
        p.error(f"--memory-budgets must be in (0, 1), got {args.memory_budgets!r}")
    if args.memory_budget_values and not args.compile:
        p.error("--memory-budgets applies to compiled variants: add --compile")
    if args.checkpointing == "none" and not args.memory_budget_values:
        p.error("--checkpointing none runs only the --memory-budgets variants: give --memory-budgets")
    if args.checkpointing in ("off", "none") and args.ckpt_block_counts != [None]:
        p.error("--ckpt-blocks sweeps the checkpointed variants: it needs --checkpointing on or both")
    try:
        batches = [int(v) for v in args.batches.split(",") if v.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        p.error(f"--batches must be comma-separated positive ints, got {args.batches!r}")
    unknown = {v.strip() for v in args.skip.split(",") if v.strip()} - {"a", "check", "ode", "b", "c"}
    if unknown:
        p.error(f"--skip: unknown part(s) {sorted(unknown)}; choose from a, check, ode, b, c")
    from verl_omni.models.wnm.attention import ATTENTION_BACKENDS

    chosen = attention_backends(args)
    if args.attention != "both" and (not chosen or set(chosen) - set(ATTENTION_BACKENDS)):
        p.error(f"--attention must be both or comma-separated names from {ATTENTION_BACKENDS}, got {args.attention!r}")
    group_variants = {
        "eager-unshared",
        "eager",
        "compiled",
        "compiled-no-epilogue",
        "compiled-inductor-rope",
        "compiled-residual-in-block",
        "compiled-session38",
        "isolated",
        "fp8",
    }
    bad = set(_csv(args.group_variants)) - group_variants
    bad |= set(_csv(args.train_variants)) - {"eager", "compiled"}
    if bad:
        p.error(f"--group-variants / --train-variants: unknown variant(s) {sorted(bad)}")
    for name in ("num_steps", "window_size", "micro_batch", "ckpt_micro_batch", "iters", "text_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.fp8_groups is not None:
        from verl_omni.models.wnm.fp8 import LAYER_GROUPS

        if "fp8" not in _csv(args.group_variants):
            p.error("--fp8-groups needs fp8 in --group-variants")
        if not _csv(args.fp8_groups) or set(_csv(args.fp8_groups)) - set(LAYER_GROUPS):
            p.error(f"--fp8-groups must be comma-separated names from {sorted(LAYER_GROUPS)}, got {args.fp8_groups!r}")
    if args.text_valid is not None and args.text_valid < 1:
        p.error(f"--text-valid must be >= 1, got {args.text_valid}")
    if args.warmup < 0 or not 0 <= args.window_start <= args.num_steps - 1 - args.window_size:
        p.error(
            f"--warmup must be >= 0 and --window-start in [0, {args.num_steps - 1 - args.window_size}] "
            f"(the last step is always Euler), got {args.warmup} and {args.window_start}"
        )
    return args


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def ckpt_block_counts(text: str) -> list[int | None]:
    """``--ckpt-blocks``: ``all`` -> None (every block), else an int >= 0; the model's depth is checked in main.

    Raises:
        ValueError: An entry is neither ``all`` nor an int >= 0, or the list is empty.
    """
    counts: list[int | None] = []
    for v in _csv(text):
        if v == "all":
            counts.append(None)
            continue
        try:
            n = int(v)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"entries must be all or ints >= 0, got {v!r} in {text!r}")
        counts.append(n)
    if not counts:
        raise ValueError(f"expected a comma-separated list of all / ints >= 0, got {text!r}")
    return counts


def attention_backends(args) -> list[str]:
    """Our DiT's attention backends to measure, the one used by check, (b) and (c) first."""
    if args.attention == "both":
        return ["cudnn", "default"]
    return [a.strip() for a in args.attention.split(",") if a.strip()]


# ----------------------------------------------------------------------------------------- timing helpers
def matmul_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved TFLOP/s of a square GEMM (8192 on GPU, 1024 on CPU): the ceiling this run can reach."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median_time(lambda: a @ b, device, 3, 10)
    return 2 * n**3 / t / 1e12


# ----------------------------------------------------------------------------------------- FLOP model
def block_params(blocks) -> int:
    return sum(p.numel() for p in blocks.parameters())


def forward_flops(n_block_params: int, batch: int, seq: int, ctx: int, dim: int, layers: int, unread: int = 0) -> float:
    """Model FLOPs of one DiT forward: block matmuls + self- and cross-attention score/value products.

    ``unread``: tokens whose outputs the last block does not compute (ours: the history tokens, see
    ``verl_omni.models.wnm.transformer.SKIP_UNREAD_OUTPUTS``). They still give self-attention keys and values,
    and the cross-attention keys and values come from the context, but they ask no query and skip the output
    projections and the feed-forward (a block's weights less its 4 x dim^2 key/value projections), so that work is
    not counted: a fraction of peak must count only the work done.
    """
    linear = 2.0 * n_block_params * batch * seq
    attn = layers * batch * (4.0 * seq * seq * dim + 4.0 * seq * ctx * dim)
    if unread:
        linear -= 2.0 * (n_block_params / layers - 4 * dim * dim) * batch * unread
        attn -= batch * (4.0 * unread * seq * dim + 4.0 * unread * ctx * dim)
    return linear + attn


def isolated_forward_flops(n_block_params: int, batch: int, cfg) -> float:
    """Model FLOPs of one forward of an ``isolated`` model (history keys/values cached per prompt): the target and
    action tokens run every block and attend over the history's cached keys and their own."""
    n, nh = cfg.target_tokens + cfg.action_steps, cfg.history_tokens
    linear = 2.0 * n_block_params * batch * n
    attn = cfg.num_layers * batch * (4.0 * n * (nh + n) * cfg.dim + 4.0 * n * cfg.context_tokens * cfg.dim)
    return linear + attn


def unread_tokens(cfg) -> int:
    """Tokens of our forward whose last-block outputs are skipped (0 when that is switched off)."""
    from verl_omni.models.wnm import transformer as wnm_transformer

    return cfg.history_tokens if wnm_transformer.SKIP_UNREAD_OUTPUTS else 0


# ----------------------------------------------------------------------------------------- models
def build_ours(cfg, device, dtype, seed: int = 0, attention: str = "default"):
    from verl_omni.models.wnm import WNMTransformer

    torch.manual_seed(seed)
    model = WNMTransformer(cfg).to(device=device, dtype=dtype).eval()
    model.attention_backend = attention
    return model


def random_context(cfg, batch: int, device, dtype, seed: int = 1):
    from verl_omni.models.wnm import WNMContext

    g = torch.Generator().manual_seed(seed)
    return WNMContext(
        history_latents=torch.randn(batch, *cfg.history_latent_shape, generator=g).to(device, dtype),
        encoder_tokens=torch.randn(batch, cfg.context_tokens, cfg.dim, generator=g).to(device, dtype),
        encoder_mask=torch.ones(batch, cfg.context_tokens, dtype=torch.bool, device=device),
    )


def group_context(cfg, args, device, dtype):
    """The group's context (batch 1): all attended, or with ``--text-valid N`` a padded instruction of N tokens."""
    ctx = random_context(cfg, 1, device, dtype, seed=21)
    if args.text_valid is not None:
        ctx.encoder_mask[:, args.text_valid : cfg.text_max_length] = False  # [text, image, geometry] order
    return ctx


def attended_tokens(ctx) -> int:
    """Context tokens the longest row attends to (what a bf16 forward computes over, the context compacted)."""
    return int(ctx.encoder_mask.sum(dim=1).max())


def forward_inputs(cfg, batch: int, text_tokens: int, device, dtype) -> tuple[tuple, tuple]:
    """Random inputs of one forward of each model at ``cfg``'s dims.

    Returns:
        ``(anchor_args, ours_args)``: ``(video [B, C, T_h + T_t, h, w], timestep [B], text [B, text_tokens, D_text])``
        for diffusers' ``WanTransformer3DModel`` and ``(x [B, *target], actions [B, 32, 4], sigma [B], context)``
        for our ``WNMTransformer``.
    """
    c, th, h, w = cfg.history_latent_shape
    video = torch.randn(batch, c, th + cfg.target_latent_shape[1], h, w, device=device, dtype=dtype)
    text = torch.randn(batch, text_tokens, cfg.text_dim, device=device, dtype=dtype)
    t = torch.rand(batch, device=device) * 1000
    x = torch.randn(batch, *cfg.target_latent_shape, device=device, dtype=dtype)
    a = torch.randn(batch, cfg.action_steps, cfg.action_channels, device=device, dtype=dtype)
    s = torch.rand(batch, device=device)
    return (video, t, text), (x, a, s, random_context(cfg, batch, device, dtype))


def padded_instruction(ours_args: tuple, text_valid: int | None, cfg) -> tuple:
    """``ours_args`` whose context attends to only the first ``text_valid`` text positions, as a real padded
    instruction does (None: unchanged, all attended)."""
    if text_valid is None:
        return ours_args
    ctx = ours_args[3]
    mask = ctx.encoder_mask.clone()
    mask[:, text_valid : cfg.text_max_length] = False
    return (*ours_args[:3], type(ctx)(ctx.history_latents, ctx.encoder_tokens, mask))


# ----------------------------------------------------------------------------------------- (a) forward
ANCHOR_EAGER, ANCHOR_COMPILED = "diffusers eager", "diffusers compiled"


def build_anchors(cfg, args, device, dtype) -> list[tuple[str, object]]:
    """diffusers ``WanTransformer3DModel``: eager, and (with --compile) ``compile_repeated_blocks(fullgraph=True)``,
    the regional compilation diffusers recommends; with ``--attention both`` also compiled on cuDNN attention."""
    eager = wan_anchor(cfg, device, dtype, text_dim=cfg.text_dim)
    anchors = [(ANCHOR_EAGER, eager)]
    if args.compile:
        compiled = copy.deepcopy(eager)
        compiled.compile_repeated_blocks(fullgraph=True)
        anchors.append((ANCHOR_COMPILED, compiled))
        if args.attention == "both" and device.type == "cuda":
            cudnn = copy.deepcopy(eager)
            cudnn.set_attention_backend("_native_cudnn")
            cudnn.compile_repeated_blocks(fullgraph=True)
            anchors.append(("diffusers compiled, cuDNN attn", cudnn))
    return anchors


def bench_forward(cfg, args, device, dtype, ours: list[tuple[str, object]], ours_isolated, anchors, peak) -> list[dict]:
    """Times every model at every batch; ratios against both anchors (diffusers eager and diffusers compiled)."""
    rows = []
    nh, nt, na = cfg.history_tokens, cfg.target_tokens, cfg.action_steps
    for b in [int(v) for v in args.batches.split(",") if v.strip()]:
        entries = []
        c, th, h, w = cfg.history_latent_shape
        video = torch.randn(b, c, th + cfg.target_latent_shape[1], h, w, device=device, dtype=dtype)
        text = torch.randn(b, args.text_tokens, cfg.text_dim, device=device, dtype=dtype)
        t = torch.rand(b, device=device) * 1000
        for name, anchor in anchors:

            def run_anchor(anchor=anchor, video=video, t=t, text=text):
                with torch.no_grad():
                    anchor(video, t, text, return_dict=False)

            flops = forward_flops(block_params(anchor.blocks), b, nh + nt, args.text_tokens, cfg.dim, cfg.num_layers)
            entries.append((name, run_anchor, flops, nh + nt, "compiled" in name))
        ctx = random_context(cfg, b, device, dtype)
        x = torch.randn(b, *cfg.target_latent_shape, device=device, dtype=dtype)
        a = torch.randn(b, cfg.action_steps, cfg.action_channels, device=device, dtype=dtype)
        s = torch.rand(b, device=device)
        flops = forward_flops(
            block_params(ours[0][1].blocks), b, nh + nt + na, cfg.context_tokens, cfg.dim, cfg.num_layers,
            unread_tokens(cfg),
        )  # fmt: skip
        for name, model in ours:

            def run(model=model, x=x, a=a, s=s, ctx=ctx):
                with torch.no_grad():
                    model(x, a, s, ctx)

            entries.append((name, run, flops, nh + nt + na, model.compiled_blocks))
        if ours_isolated is not None:
            # The per-prompt history pass runs once per prompt and weight version, outside the per-step forward.
            def hist(ctx=ctx):
                with torch.no_grad():
                    return ours_isolated.history_kv(ctx)

            kv = hist()
            t_hist = median_time(hist, device, 1, 3)
            print(f"  (a) batch {b:>2} isolated history pass (once per prompt) {t_hist * 1e3:.1f} ms", flush=True)
            ctx_iso = ctx.with_history_kv(kv)

            def run_iso(x=x, a=a, s=s, ctx=ctx_iso):
                with torch.no_grad():
                    ours_isolated(x, a, s, ctx)

            # Model FLOPs of the work it replaces (the full forward), so TFLOP/s reads as an effective rate.
            entries.append(("WNM isolated history", run_iso, flops, nt + na, True))
        anchor_t: dict[str, float] = {}
        batch_rows = []
        for name, fn, fl, seq, compiled in entries:
            reset_peak(device)
            try:
                first = timed_once(fn, device)[0] if compiled else None  # includes compiling this shape
                t = median_time(fn, device, args.warmup, args.iters)
            except Exception as e:  # one failing row must not lose the others
                print(f"  (a) batch {b:>2} {name:<30} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if name in (ANCHOR_EAGER, ANCHOR_COMPILED):
                anchor_t[name] = t
            row = {
                "batch": b,
                "model": name,
                "tokens": seq,
                "seconds": t,
                "tflops": fl / t / 1e12,
                "frac_peak": fl / t / 1e12 / peak,
                "first_call_s": first,
                "peak_gib": peak_gib(device),
            }
            batch_rows.append(row)
            print(
                f"  (a) batch {b:>2} {name:<30} {t * 1e3:9.1f} ms  {fl / t / 1e12:7.1f} TFLOP/s"
                + (f"  first call {first:.1f} s" if first is not None else ""),
                flush=True,
            )
        for row in batch_rows:
            for key, anchor in (("x_diffusers_eager", ANCHOR_EAGER), ("x_diffusers_compiled", ANCHOR_COMPILED)):
                row[key] = anchor_t[anchor] / row["seconds"] if anchor in anchor_t else float("nan")
        rows += batch_rows
    return rows


# ----------------------------------------------------------------------------------------- numerics check
def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_numerics(cfg, args, device, dtype, ours, ours_compiled, ours_isolated=None) -> dict:
    """Fast paths vs an fp32 eager copy of the same weights, on fresh random inputs."""
    from verl_omni.data.actions import ActionLayout, ActionNormalization
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, SamplerConfig
    from verl_omni.pipelines.wnm_shared.requests import stratified_requests

    ref = copy.deepcopy(ours).float()  # same weights (bf16-rounded), evaluated in fp32
    b = 2
    ctx = random_context(cfg, b, device, torch.float32, seed=11)
    x = torch.randn(b, *cfg.target_latent_shape, device=device)
    a = torch.randn(b, cfg.action_steps, cfg.action_channels, device=device)
    s = torch.tensor([0.9, 0.35], device=device)
    out = {}
    with torch.no_grad():
        rv, ra = ref(x, a, s, ctx)
        for name, model in (("eager", ours), ("compiled", ours_compiled)):
            if model is None:
                continue
            v, va = model(x.to(dtype), a.to(dtype), s, ctx.to(device, dtype))
            out[f"velocity_rel_err_{name}"] = relative_error(v, rv)
            out[f"action_velocity_rel_err_{name}"] = relative_error(va, ra)
        if ours_isolated is not None:  # against its own fp32 eager reference (it is a different model)
            ref.set_history_attention("isolated")
            rv, ra = ref(x, a, s, ctx)
            v, va = ours_isolated(x.to(dtype), a.to(dtype), s, ctx.to(device, dtype))
            out["velocity_rel_err_isolated"] = relative_error(v, rv)
            out["action_velocity_rel_err_isolated"] = relative_error(va, ra)
            ref.set_history_attention("full")
    if "ode" in {v.strip() for v in args.skip.split(",")}:
        for k, v in out.items():
            print(f"  check {k:<32} {v:.3e}", flush=True)
        del ref
        return out
    # Whole ODE sampler: actions of 4 rollouts (one per stratum) through the backend.
    norm = ActionNormalization(mean=(0.0, 0.0, 0.0, 0.5), std=(1.0, 1.0, 1.0, 0.5))
    sampler = SamplerConfig(num_steps=args.num_steps)
    layout = ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks)
    reqs = stratified_requests(["check"], 7, 0, 4, 1)
    ctx1 = random_context(cfg, 1, device, torch.float32, seed=12)

    def sample(model, dt):
        backend = NativeRolloutBackend(
            model,
            tuple(cfg.target_latent_shape),
            norm,
            sampler,
            NativeBackendConfig(device=str(device), dtype=dt, deterministic=False),
            layout,
        )
        return backend.generate(reqs, ctx1, ode=True).actions_normalized

    ref_actions = sample(ref, "float32")
    for name, model in (("eager", ours), ("compiled", ours_compiled)):
        if model is None:
            continue
        got = sample(model, args.dtype)
        out[f"ode_action_max_abs_{name}"] = float((got - ref_actions).abs().max())
        out[f"ode_action_rel_err_{name}"] = relative_error(got, ref_actions)
    out["ode_action_rms_ref"] = float(ref_actions.double().pow(2).mean().sqrt())
    del ref
    for k, v in out.items():
        print(f"  check {k:<32} {v:.3e}", flush=True)
    return out


# ----------------------------------------------------------------------------------------- (b) group
def make_group(cfg, args):
    from verl_omni.pipelines.wnm_shared import SamplerConfig
    from verl_omni.pipelines.wnm_shared.requests import stratified_requests

    sampler = SamplerConfig(
        num_steps=args.num_steps,
        window_strategy="fixed",
        window_start=args.window_start,
        window_size=args.window_size,
    )
    return sampler, stratified_requests(["bench"], 1, 0, 4, 4)


def backend_for(cfg, model, sampler, device, dtype_name: str, share_prefix: bool, chunk: int = 16):
    from verl_omni.data.actions import ActionLayout, ActionNormalization
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend

    norm = ActionNormalization(mean=(0.0, 0.0, 0.0, 0.5), std=(1.0, 1.0, 1.0, 0.5))
    return NativeRolloutBackend(
        model,
        tuple(cfg.target_latent_shape),
        norm,
        sampler,
        NativeBackendConfig(
            device=str(device), dtype=dtype_name, deterministic=False, chunk_size=chunk, share_prefix=share_prefix
        ),
        ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks),
    )


def bench_group(cfg, args, device, dtype, ours, ours_compiled, ours_isolated, peak) -> tuple[list[dict], object]:
    sampler, reqs = make_group(cfg, args)
    ctx = group_context(cfg, args, device, dtype)
    k, w, s0 = args.num_steps, args.window_size, args.window_start
    # DiT rows evaluated: without sharing 16 x K; with it 4 strata x s0 prefix steps + 16 x (K - s0).
    n_block = block_params(ours.blocks)
    seq = cfg.history_tokens + cfg.target_tokens + cfg.action_steps
    per_row = forward_flops(n_block, 1, seq, attended_tokens(ctx), cfg.dim, cfg.num_layers, unread_tokens(cfg))
    rows = []
    wanted = set(_csv(args.group_variants))
    variants = [("eager, no prefix sharing", ours, False, "eager-unshared"), ("eager", ours, True, "eager")]
    if ours_compiled is not None:
        variants.append(("compiled", ours_compiled, True, "compiled"))
        variants.append(("compiled, separate GELU kernel", ours_compiled, True, "compiled-no-epilogue"))
        variants.append(("compiled, q/k norm+RoPE by inductor", ours_compiled, True, "compiled-inductor-rope"))
        variants.append(("compiled, residual in its block", ours_compiled, True, "compiled-residual-in-block"))
        variants.append(("compiled, session 38's forward", ours_compiled, True, "compiled-session38"))
    if ours_isolated is not None:
        variants.append(("isolated history", ours_isolated, True, "isolated"))
    if "fp8" in wanted:
        from verl_omni.models.wnm.fp8 import float8_rollout_copy

        suffix = ", compiled" if args.compile else ""
        for groups in [None] + ([_csv(args.fp8_groups)] if args.fp8_groups else []):
            fp8 = float8_rollout_copy(ours, groups=groups)
            if args.compile:
                fp8.compile_blocks()
            label = "FP8 linears" if groups is None else f"FP8 {'+'.join(groups)} only"
            variants.append((label + suffix, fp8, True, "fp8"))
    reference = ours_compiled if ours_compiled is not None else ours
    for name, model, share, key in variants:
        if key not in wanted:
            continue
        backend = backend_for(cfg, model, sampler, device, args.dtype, share)
        dit_rows = 16 * k if not share else 4 * s0 + 16 * (k - s0)
        reset_peak(device)
        with (
            with_fast_path_off(model, "gelu_epilogue", key == "compiled-no-epilogue"),
            with_fast_path_off(model, "norm_rope_kernel", key == "compiled-inductor-rope"),
            with_residual_in_block(key in ("compiled-residual-in-block", "compiled-session38")),
            with_fast_path_off(model, "residual_norm_kernel", key == "compiled-session38"),
        ):
            t = median_time(lambda backend=backend: backend.generate(reqs, ctx), device, 1, max(2, args.iters // 2))
        # The isolated model's per-step forward is smaller (its history runs once per prompt, not counted here).
        fl = (isolated_forward_flops(n_block, 1, cfg) if key == "isolated" else per_row) * dit_rows
        row = {
            "variant": name,
            "seconds": t,
            "rollouts_per_s": 16 / t,
            "dit_rows": dit_rows,
            "tflops": fl / t / 1e12,
            "frac_peak": fl / t / 1e12 / peak,
            "peak_gib": peak_gib(device),
        }
        drift = ""
        if key in ("fp8", "compiled"):  # the FP8 copy's log-prob drift, with the bf16 rollout as its control
            row |= logp_drift(backend.generate(reqs, ctx), ctx, reference, backend, dtype)
            drift = f"  |logp - logp_bf16| max {row['logp_drift_max']:.2e} mean {row['logp_drift_mean']:.2e}"
        rows.append(row)
        print(f"  (b) group {name:<26} {t:7.3f} s  {16 / t:6.2f} rollouts/s  DiT rows {dit_rows}{drift}", flush=True)
    return rows, (sampler, reqs, ctx, w)


@contextlib.contextmanager
def with_fast_path_off(model, name: str, on: bool):
    """With ``on``, ``model``'s inference fast path ``name`` is off for the block: ``gelu_epilogue`` (the GELU as a
    kernel of its own after the GEMM, the forward before session 33), ``norm_rope_kernel`` (q/k norm and RoPE as
    inductor fuses them, the forward before session 38) or ``residual_norm_kernel`` (the residual adds and the
    LayerNorms after them as inductor fuses them, before session 39), so that one process times the group both
    ways."""
    saved = getattr(model, name)
    setattr(model, name, saved and not on)
    try:
        yield
    finally:
        setattr(model, name, saved)


@contextlib.contextmanager
def with_residual_in_block(on: bool):
    """With ``on``, every block adds its own feed-forward residual (``transformer.DEFER_FFN_RESIDUAL`` off, the
    forward before session 39) for the block, so that one process times the group both ways."""
    from verl_omni.models.wnm import transformer as wnm_transformer

    saved = wnm_transformer.DEFER_FFN_RESIDUAL
    wnm_transformer.DEFER_FFN_RESIDUAL = saved and not on
    try:
        yield
    finally:
        wnm_transformer.DEFER_FFN_RESIDUAL = saved


def logp_drift(results, ctx, reference, backend, dtype) -> dict:
    """How far a rollout's own per-layer log-probs are from the bf16 ``reference`` model's on the same transitions.

    This is the gap ``algorithm.recompute_old_logp`` closes: the old log-probs the trainer would otherwise take from
    the rollout. Recomputed at the rollout's rows per DiT call, so the bf16 rollout (the control) shows only what
    differs between its graph and the reference's.
    """
    from verl_omni.trainer.diffusion.recompute import recompute_layer_logprobs

    with torch.no_grad():
        recomputed = recompute_layer_logprobs(
            reference,
            backend.layout,
            results.window_states.to(ctx.history_latents.device),
            results.window_steps,
            results.noise_coefs,
            results.sigmas,
            ctx,
            results.context_rows,
            dtype=dtype,
            device=ctx.history_latents.device,
            chunk_size=backend.config.effective_chunk_size,
        ).cpu()
    diff = (results.logprobs.float() - recomputed.float()).abs()
    return {"logp_drift_max": float(diff.max()), "logp_drift_mean": float(diff.mean())}


# ----------------------------------------------------------------------------------------- (c) training
@contextlib.contextmanager
def single_rank_group(device: torch.device):
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_oom(e: BaseException) -> bool:
    """True when ``e`` or an exception it was raised from is a device out-of-memory error (torch.compile wraps
    errors raised while compiling or autotuning)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@dataclasses.dataclass(frozen=True)
class TrainVariant:
    """One variant of (c): how the DiT is compiled and what its backward keeps.

    Attributes:
        compiled: ``compile_blocks()`` after sharding.
        checkpointing: Activation checkpointing of the blocks (at ``--ckpt-micro-batch``); False runs at
            ``--micro-batch`` unless a memory budget is set.
        ckpt_blocks: With ``checkpointing``: how many blocks, from the first, to checkpoint; None = all.
        memory_budget: Inductor's activation memory budget (compiled, no checkpointing, at ``--ckpt-micro-batch``);
            None = PyTorch's default.
    """

    compiled: bool
    checkpointing: bool = False
    ckpt_blocks: int | None = None
    memory_budget: float | None = None

    @property
    def name(self) -> str:
        if self.memory_budget is not None:
            return f"compiled, mem. budget {self.memory_budget:g}"
        return ("compiled" if self.compiled else "eager") + (" + act. ckpt" if self.checkpointing else "")

    def checkpointed_blocks(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks run under activation checkpointing."""
        if not self.checkpointing:
            return 0
        return num_layers if self.ckpt_blocks is None else self.ckpt_blocks

    @property
    def large_micro_batch(self) -> bool:
        """Whether the variant frees enough memory to run at ``--ckpt-micro-batch``."""
        return self.checkpointing or self.memory_budget is not None


def train_variants(args) -> list[TrainVariant]:
    """(c)'s variants in run order: per compile setting, no checkpointing (with ``--checkpointing off`` or
    ``both``), then one per ``--ckpt-blocks`` entry (``on`` or ``both``); then the compiled ``--memory-budgets``
    variants (the only ones with ``none``)."""
    wanted = set(_csv(args.train_variants))
    kinds = ([False] if "eager" in wanted else []) + ([True] if args.compile and "compiled" in wanted else [])
    counts = {"off": [], "on": args.ckpt_block_counts, "both": args.ckpt_block_counts, "none": []}[args.checkpointing]
    out = []
    for compiled in kinds:
        if args.checkpointing in ("off", "both"):
            out.append(TrainVariant(compiled))
        out += [TrainVariant(compiled, checkpointing=True, ckpt_blocks=n) for n in counts]
    if True in kinds:
        out += [TrainVariant(True, memory_budget=b) for b in args.memory_budget_values]
    return out


@contextlib.contextmanager
def memory_budget_of(variant: TrainVariant):
    """Inductor's activation memory budget of ``variant`` while the block inside compiles and runs (nothing for a
    variant without one).

    The budget is read when inductor partitions the joint graph, i.e. at the first backward, so dynamo is reset on
    the way in (recompile under it) and out; the old setting comes back for the variants after this one (the
    product's worker keeps it instead).
    """
    if variant.memory_budget is None:
        yield
        return
    from verl_omni.models.wnm.compilation import set_activation_memory_budget

    torch._dynamo.reset()
    old = set_activation_memory_budget(variant.memory_budget)
    try:
        yield
    finally:
        set_activation_memory_budget(old)
        torch._dynamo.reset()


def train_variant(
    cfg,
    device,
    dtype,
    mesh,
    group,
    peak: float,
    attention: str,
    variant: TrainVariant,
    mb: int,
    profile_top: int = 0,
    steps: int = 3,
) -> dict:
    """Builds, shards (and compiles) a fresh model and measures one variant of (c); see :func:`bench_train`. Run it
    inside :func:`memory_budget_of`.

    Everything it allocates is local, so an exception (an OOM) frees it all once the caller drops the exception.

    Args:
        variant: Compile, checkpointing and memory-budget settings.
        mb: Transitions per forward/backward, and the rollout's rows per DiT call.
        profile_top: If > 0, after the timed steps, profile one more step and print its kernel table (this many
            top kernels) and how much of the step the GPU was busy (``profile_dit.profile_step``).
        steps: Timed steps after the first; the row's ``seconds`` is their median.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch, WNMDiffusionActor
    from verl_omni.trainer.diffusion.config import LossConfig

    sampler, reqs, ctx_lp, w = group
    seq = cfg.history_tokens + cfg.target_tokens + cfg.action_steps
    model = build_ours(cfg, device, torch.float32, attention=attention)  # fp32 master weights
    model.set_activation_checkpointing(variant.checkpointed_blocks(cfg.num_layers))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if variant.compiled:
        model.compile_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    n = len(reqs)
    # The rollout runs the same FSDP module (fp32 storage, bf16 compute), as the colocated actor does, with
    # the update's micro-batch as its rows per DiT call (the recipe sets both equal on GPUs).
    backend = backend_for(cfg, model, sampler, device, "float32", True, chunk=mb)
    actor = WNMDiffusionActor(
        model,
        backend.layout,
        opt,
        loss_config=LossConfig(),
        grad_clip=1.0,
        device=device,
        chunk_size=backend.config.effective_chunk_size,
    )
    reset_peak(device)
    ctx32 = ctx_lp.to(device, torch.float32)
    t_roll, res = timed_once(functools.partial(backend.generate, reqs, ctx32), device)
    roll_peak = peak_gib(device)
    gen = torch.Generator().manual_seed(5)
    adv = torch.randn(n, res.logprobs.shape[-1], generator=gen).clamp(-2, 2)
    mini = [
        UpdateMicroBatch.from_results(
            res, ctx32, range(lo, min(lo + mb, n)), advantages=adv, weight=(min(lo + mb, n) - lo) / n
        )
        for lo in range(0, n, mb)
    ]
    reset_peak(device)
    # First step: compiles (if on) and records the rollout-vs-recomputed log-prob gap (unchanged weights).
    t_first, m_first = timed_once(functools.partial(actor.update_policy, [mini]), device)
    # Several timed steps, median and spread: on the H200 two steps of one variant differed by up to 15% (session 40).
    times, clocks = [], []
    for _ in range(steps):
        times.append(timed_once(functools.partial(actor.update_policy, [mini]), device)[0])
        clocks.append(sm_clock_mhz(device))
    t = statistics.median(times)
    if profile_top and device.type == "cuda":
        from profile_dit import profile_step

        step = functools.partial(actor.update_policy, [mini])
        print(profile_step(step, f"training step, {variant.name}, micro-batch {mb}", profile_top), flush=True)
    fl = 3 * forward_flops(
        block_params(model.blocks), n * w, seq, attended_tokens(ctx32), cfg.dim, cfg.num_layers, unread_tokens(cfg)
    )
    return {
        "seconds": t,
        "seconds_min": min(times),
        "seconds_max": max(times),
        "steps_timed": len(times),
        "step_seconds": times,
        "sm_clock_mhz_after_steps": clocks,
        "first_step_s": t_first,
        "tflops": fl / t / 1e12,
        "frac_peak": fl / t / 1e12 / peak,
        "peak_gib": peak_gib(device),
        "rollout_s": t_roll,
        "rollout_peak_gib": roll_peak,
        "logp_abs_diff_max": m_first["actor/logp_abs_diff_first_minibatch"],
        "grad_norm": m_first["actor/grad_norm"],
    }


def bench_train(cfg, args, device, dtype, group, peak: float, attention: str = "default") -> list[dict]:
    """One optimizer step over the group's 16 x W window transitions, FSDP2 on one rank, by the product's actor.

    The model is sharded and compiled the way ``ActorRolloutWorker.init_model`` does it; the step is
    ``WNMDiffusionActor.update_policy`` on one mini-batch whose micro-batches are ``UpdateMicroBatch``es of the
    rollout's results, with the rollout's rows per DiT call as the actor's ``chunk_size``. With checkpointing on,
    one variant per ``--ckpt-blocks`` entry (the first N blocks checkpointed). A variant that fails gets a row with
    its ``error`` (``OOM`` for a device out-of-memory error, whose ``peak_gib`` is the peak before the failing
    allocation) and the others still run.
    """
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    _, reqs, _, w = group
    layers = cfg.num_layers
    rows = []
    with single_rank_group(device):
        mesh = init_device_mesh(device.type, (1,))
        for variant in train_variants(args):
            name = variant.name
            n_ckpt = variant.checkpointed_blocks(layers)
            mb = max(1, min(args.ckpt_micro_batch if variant.large_micro_batch else args.micro_batch, len(reqs)))
            base = {
                "variant": name,
                "ckpt_blocks": n_ckpt,
                "num_blocks": layers,
                "transitions": len(reqs) * w,
                "micro_batch": mb,
            }
            label = f"{name:<22} ckpt {n_ckpt:>2}/{layers}"
            reset_peak(device)
            try:
                with memory_budget_of(variant):
                    measured = train_variant(
                        cfg, device, dtype, mesh, group, peak, attention, variant, mb, args.profile_train,
                        args.train_steps,
                    )  # fmt: skip
                row = base | measured
            except Exception as e:  # report and go on to the next variant
                error = "OOM" if is_oom(e) else f"FAILED: {type(e).__name__}"
                row = {**base, "error": error, "message": str(e)[:300], "peak_gib": peak_gib(device)}
                print(f"  (c) train {label}  {error}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            else:
                print(
                    f"  (c) train {label} {row['seconds']:7.3f} s ({row['seconds_min']:.3f}-{row['seconds_max']:.3f})"
                    f"  {row['tflops']:7.1f} TFLOP/s  "
                    f"{row['frac_peak']:.1%} of peak  peak {row['peak_gib']:.1f} GiB  "
                    f"max |dlogp| {row['logp_abs_diff_max']:.2e}  "
                    f"SM clock after each step (MHz) {row['sm_clock_mhz_after_steps']}",
                    flush=True,
                )
            rows.append(row)
            # The variant's model, optimizer and activations died with train_variant's frame (and, after a failure,
            # with the exception's traceback): collect reference cycles, then hand the cached blocks back.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------- report
def environment(device: torch.device) -> dict:
    import diffusers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "sdpa_backends": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        },
    }
    return env


def summary(args, cfg, env, peak, fwd, check, group, train) -> str:
    lines = [
        f"Stage-III GPU benchmark: size {cfg.size}, {args.dtype}, device {env['device']}, torch {env['torch']}, "
        f"diffusers {env['diffusers']}, CUDA {env['cuda']}",
        f"sequence: {cfg.history_tokens} history + {cfg.target_tokens} target video tokens + {cfg.action_steps} "
        f"action tokens; context {cfg.context_tokens} tokens (anchor: {args.text_tokens} text tokens)",
        "(b) and (c): "
        + ("all context tokens attended" if args.text_valid is None else f"{args.text_valid} text tokens attended"),
        f"measured {args.dtype} matmul peak: {peak:.1f} TFLOP/s",
        "",
        "(a) DiT forward; ratios are anchor time / row time against diffusers eager and diffusers compiled",
        f"{'batch':>5}  {'model':<32}{'ms':>9}{'TFLOP/s':>9}{'of peak':>9}{'x d.eager':>11}{'x d.comp':>10}"
        f"{'peak GiB':>10}",
    ]
    for r in fwd:
        lines.append(
            f"{r['batch']:>5}  {r['model']:<32}{r['seconds'] * 1e3:>9.1f}{r['tflops']:>9.1f}{r['frac_peak']:>9.1%}"
            f"{r['x_diffusers_eager']:>10.2f}x{r['x_diffusers_compiled']:>9.2f}x{r['peak_gib']:>10.1f}"
        )
    if check:
        lines += ["", "numerics vs fp32 eager (same weights, fresh random inputs)"]
        lines += [f"  {k:<34}{v:.3e}" for k, v in check.items()]
    if group:
        lines += [
            "",
            f"(b) one counterfactual group: 16 rollouts, K={args.num_steps}, window {args.window_size} steps from "
            f"step {args.window_start}",
            f"  {'variant':<26}{'s':>8}{'rollouts/s':>12}{'DiT rows':>10}{'TFLOP/s':>9}{'of peak':>9}{'peak GiB':>10}"
            "  |logp - logp_bf16| max / mean",
        ]
        for r in group:
            drift = f"  {r['logp_drift_max']:.2e} / {r['logp_drift_mean']:.2e}" if "logp_drift_max" in r else ""
            lines.append(
                f"  {r['variant']:<26}{r['seconds']:>8.3f}{r['rollouts_per_s']:>12.2f}{r['dit_rows']:>10}"
                f"{r['tflops']:>9.1f}{r['frac_peak']:>9.1%}{r['peak_gib']:>10.1f}{drift}"
            )
    if train:
        lines += [
            "",
            "(c) FSDP2 training step (1 rank) over the group's window transitions, WNMDiffusionActor.update_policy;",
            "    ckpt = blocks under activation checkpointing (the first ones) / all blocks",
            "    s = median of the timed steps; min-max = their spread",
            f"  {'variant':<22}{'ckpt':>7}{'s':>8}{'min-max':>14}{'trans.':>7}{'mb':>4}{'TFLOP/s':>9}{'of peak':>9}"
            f"{'peak GiB':>10}{'first s':>9}  max |logp_rollout - logp_recomputed|",
        ]
        for r in train:
            head = f"  {r['variant']:<22}{r['ckpt_blocks']:>4}/{r['num_blocks']:<2}"
            if "error" in r:
                # Peak GiB of a failed variant: the peak before the allocation that failed.
                word, why = ("OOM", "out of device memory") if r["error"] == "OOM" else ("FAILED", r["error"])
                lines.append(
                    f"{head}{word:>8}{'-':>14}{r['transitions']:>7}{r['micro_batch']:>4}{'-':>9}{'-':>9}"
                    f"{r['peak_gib']:>10.1f}"
                    f"{'-':>9}  {why}"
                )
                continue
            lines.append(
                f"{head}{r['seconds']:>8.3f}{r['seconds_min']:>8.3f}-{r['seconds_max']:<5.3f}"
                f"{r['transitions']:>7}{r['micro_batch']:>4}{r['tflops']:>9.1f}"
                f"{r['frac_peak']:>9.1%}{r['peak_gib']:>10.1f}{r['first_step_s']:>9.1f}  {r['logp_abs_diff_max']:.2e}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from verl_omni.models.wnm import WNMConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available; use scripts/bench_stage3_cpu.py", file=sys.stderr)
        return 2
    try:
        cfg = WNMConfig.from_size(args.size)
    except ValueError as e:
        print(f"error: --size: {e}", file=sys.stderr)
        return 2
    if args.text_valid is not None and args.text_valid > cfg.text_max_length:
        print(f"error: --text-valid {args.text_valid}: size {args.size} has {cfg.text_max_length} text positions",
              file=sys.stderr)  # fmt: skip
        return 2
    too_deep = [n for n in args.ckpt_block_counts if n is not None and n > cfg.num_layers]
    if too_deep:
        print(f"error: --ckpt-blocks {too_deep}: size {args.size} has {cfg.num_layers} blocks", file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    dtype = DTYPES[args.dtype]
    env = environment(device)
    print(f"environment: {json.dumps(env)}", flush=True)
    peak = matmul_peak_tflops(device, dtype)
    print(f"  matmul peak {peak:.1f} TFLOP/s", flush=True)
    backends = attention_backends(args)
    ours = ours_compiled = ours_isolated = None
    ours_rows = []
    # The inference models serve only (a), check and (b); (c) builds its own per variant, so a run of (c) alone
    # spends no time or device memory on them.
    if not {"a", "check", "b"} <= skip:
        ours = build_ours(cfg, device, dtype, attention=backends[0])
        # (a) times every backend asked for; check, (b) and (c) use the first.
        for i, backend in enumerate(backends):
            eager = ours if i == 0 else build_ours(cfg, device, dtype, attention=backend)
            label = "" if len(backends) == 1 else f", {backend} attn"
            ours_rows.append((f"WNM eager{label}", eager))
            if args.compile:
                compiled = copy.deepcopy(eager)
                compiled.compile_blocks()
                ours_rows.append((f"WNM compiled{label}", compiled))
                ours_compiled = compiled if i == 0 else ours_compiled
        if args.isolated_history:
            ours_isolated = copy.deepcopy(ours)
            ours_isolated.set_history_attention("isolated")
            if args.compile:
                ours_isolated.compile_blocks()
    fwd, check, group_rows, train_rows, group = [], {}, [], [], None
    if "a" not in skip:
        anchors = build_anchors(cfg, args, device, dtype)
        fwd = bench_forward(cfg, args, device, dtype, ours_rows, ours_isolated, anchors, peak)
        del anchors
        reset_peak(device)
    ours_rows = ours_rows[: 2 if args.compile else 1]  # free the other backends' copies
    if "check" not in skip:
        check = check_numerics(cfg, args, device, dtype, ours, ours_compiled, ours_isolated)
    if "b" not in skip:
        group_rows, group = bench_group(cfg, args, device, dtype, ours, ours_compiled, ours_isolated, peak)
    elif "c" not in skip:  # (c) only needs the group's requests and context, not (b)'s timings
        sampler, reqs = make_group(cfg, args)
        group = (sampler, reqs, group_context(cfg, args, device, dtype), args.window_size)
    del ours, ours_compiled, ours_isolated, ours_rows
    reset_peak(device)
    if "c" not in skip:
        train_rows = bench_train(cfg, args, device, dtype, group, peak, attention=backends[0])
    # Measured again after the work: the card's clocks move over a run (session 37: 775.8 and 722.6 TFLOP/s at the
    # start of two consecutive processes on one H100), and a fraction of peak moves with its denominator. Both are
    # printed and stored, so a reader can take every fraction against either; the seconds do not depend on it.
    peak_end = matmul_peak_tflops(device, dtype)
    print(f"  matmul peak at the end {peak_end:.1f} TFLOP/s (start {peak:.1f})", flush=True)
    report = summary(args, cfg, env, peak, fwd, check, group_rows, train_rows)
    report += f"\nmatmul peak measured again at the end: {peak_end:.1f} TFLOP/s (fractions above: start, {peak:.1f})"
    print()
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".partial")
        tmp.write_text(report + "\n")
        tmp.rename(args.out)
    if args.json is not None:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": env, "matmul_peak_tflops": peak}
        data["matmul_peak_tflops_end"] = peak_end
        data.update({"forward": fwd, "numerics": check, "group": group_rows, "train": train_rows})
        tmp = args.json.with_name(args.json.name + ".partial")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=float)
        tmp.rename(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
