#!/usr/bin/env python
"""Where a DiT forward spends its GPU time: our WNMTransformer vs diffusers' WanTransformer3DModel, kernel by kernel.

Runs ``torch.profiler`` (CUDA activity) over a few eager forwards of each model at the same dims (the models and
inputs of ``scripts/bench_stage3_gpu.py``) and prints, per model, the GPU time grouped by kind of kernel (GEMM,
attention, normalisation, elementwise/copies, other) and the top kernels, so that the gap between the two is
attributed to kernels rather than guessed. Optionally the same for ``compile_blocks()`` /
``compile_repeated_blocks(fullgraph=True)``. Timing claims come from ``bench_stage3_gpu.py``; this only explains them.

    python scripts/profile_dit.py --size wan2.1-1.3b --batch 4 [--compile] [--top 25]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import wan_anchor  # noqa: E402
from bench_stage3_gpu import build_ours, forward_inputs, padded_instruction  # noqa: E402

# Kernel-name patterns of each kind (first match wins); names are the CUDA kernels the profiler records.
KINDS: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|sdpa|cudnn_.*(mha|attn)"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|wgmma"),
    ("norm", r"norm|rms"),
    ("copy/cast", r"copy|cast|convert|cat|transpose|contiguous|memcpy|index|gather|scatter"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton|mul|add|silu|gelu|tanh|exp|sin|cos"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def profile(fn, iters: int, warmup: int = 3) -> list[tuple[str, float, int]]:
    """``[(kernel name, total ms per forward, calls per forward)]`` of ``fn`` over ``iters`` profiled calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return kernel_rows(prof, iters)


def kernel_rows(prof, calls: int) -> list[tuple[str, float, int]]:
    """``[(kernel name, ms per call, launches per call)]`` of a finished ``torch.profiler`` run over ``calls`` calls,
    largest first."""
    rows = []
    for ev in prof.key_averages():
        total_us = getattr(ev, "device_time_total", None)
        if total_us is None:
            total_us = ev.cuda_time_total
        if total_us <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        rows.append((ev.key, total_us / 1e3 / calls, ev.count // calls))
    return sorted(rows, key=lambda r: -r[1])


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length (ms) of the union of ``[start, end)`` intervals in microseconds: time with at least one kernel
    running, so that kernels overlapping on two streams are not counted twice."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total / 1e3


def profile_step(fn, label: str, top: int) -> str:
    """Kernel table of one call of ``fn`` (e.g. a training step), plus how much of its wall time the GPU was busy.

    The table groups kernels as :func:`report` does; the busy line compares the call's wall time with the union of
    its kernels' intervals, which tells kernel time from launch gaps, host work and synchronisation.
    """
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    intervals = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            intervals.append((ev.time_range.start, ev.time_range.end))
    busy = busy_ms(intervals)
    idle = wall_ms - busy
    head = f"{label}: wall {wall_ms:.1f} ms, GPU busy {busy:.1f} ms ({busy / wall_ms:.1%}), idle {idle:.1f} ms"
    return head + "\n" + report(label, kernel_rows(prof, 1), top, per="step")


def report(name: str, rows: list[tuple[str, float, int]], top: int, per: str = "forward") -> str:
    """The kernel table of ``rows`` (from :func:`kernel_rows`): sums by kind, then the ``top`` kernels, in ms per
    ``per`` (what one profiled call is: a forward, or a training step)."""
    total = sum(r[1] for r in rows)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for key, ms, calls in rows:
        k = by_kind[kind_of(key)]
        k[0] += ms
        k[1] += calls
    lines = [f"== {name}: {total:.1f} ms of kernels per {per}", f"{'kind':<14}{'ms':>9}{'share':>8}{'kernels':>9}"]
    for kind, (ms, calls) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{kind:<14}{ms:9.2f}{ms / total:8.1%}{calls:9d}")
    lines.append(f"top {top} kernels:")
    for key, ms, calls in rows[:top]:
        lines.append(f"  {ms:8.2f} ms {calls:5d}x  [{kind_of(key)}] {key[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="wan2.1-1.3b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--text-tokens", type=int, default=512, help="the anchor's text tokens (default 512)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--compile", action="store_true", help="also profile the compiled blocks of both")
    p.add_argument(
        "--text-valid",
        type=int,
        default=None,
        help="our context attends to only this many text positions (a padded instruction); default: all",
    )
    p.add_argument("--compiled-only", action="store_true", help="with --compile, skip the eager profiles")
    p.add_argument(
        "--attention",
        default="default",
        help="our model's attention kernel family (verl_omni.models.wnm.attention.ATTENTION_BACKENDS; fa4 needs "
        "the flash-attn-4 package); the anchor keeps its default",
    )
    args = p.parse_args(argv)
    from verl_omni.models.wnm.attention import ATTENTION_BACKENDS

    if args.attention not in ATTENTION_BACKENDS:
        p.error(f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {args.attention!r}")
    if args.compiled_only and not args.compile:
        p.error("--compiled-only needs --compile")
    if not torch.cuda.is_available():
        raise SystemExit("profile_dit.py needs a CUDA device (it profiles GPU kernels)")
    from verl_omni.models.wnm import WNMConfig

    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = WNMConfig.from_size(args.size)
    b = args.batch
    ours = build_ours(cfg, device, dtype)
    ours.attention_backend = args.attention
    anchor = wan_anchor(cfg, device, dtype, text_dim=cfg.text_dim)
    if args.text_valid is not None and not 1 <= args.text_valid <= cfg.text_max_length:
        p.error(f"--text-valid must be in [1, {cfg.text_max_length}] for size {args.size}, got {args.text_valid}")
    anchor_args, ours_args = forward_inputs(cfg, b, args.text_tokens, device, dtype)
    ours_args = padded_instruction(ours_args, args.text_valid, cfg)

    @torch.no_grad()
    def run_ours():
        ours(*ours_args)

    @torch.no_grad()
    def run_anchor():
        anchor(*anchor_args, return_dict=False)

    print(f"size {cfg.size}, batch {b}, bf16, torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(
        f"ours: {cfg.history_tokens}+{cfg.target_tokens}+{cfg.action_steps} tokens, context {cfg.context_tokens}"
        f"{'' if args.text_valid is None else f' ({args.text_valid} text positions attended)'}; "
        f"anchor: {cfg.history_tokens + cfg.target_tokens} tokens, text {args.text_tokens}; "
        f"our attention: {args.attention}",
        flush=True,
    )
    if not args.compiled_only:
        print(report("diffusers eager", profile(run_anchor, args.iters), args.top), flush=True)
        print(report("ours eager", profile(run_ours, args.iters), args.top), flush=True)
    if args.compile:
        anchor.compile_repeated_blocks(fullgraph=True)
        ours.compile_blocks()
        print(report("diffusers compiled", profile(run_anchor, args.iters), args.top), flush=True)
        print(report("ours compiled", profile(run_ours, args.iters), args.top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
