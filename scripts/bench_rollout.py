#!/usr/bin/env python
"""Rollout throughput of the native backend vs a plain Euler loop over diffusers' WanTransformer3DModel.

Both run randomly initialized (no downloads) at the same latent shape, batch and step count, in the same
process. The WNM side is the full rollout path (request RNG, SDE window with per-layer log-probs, NaN checks,
decoding); the baseline is only the DiT calls plus an Euler update, i.e. the floor the backend is measured
against. Examples::

    python scripts/bench_rollout.py --size tiny                      # CPU, fp32
    python scripts/bench_rollout.py --size wan2.1-1.3b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import wan_anchor  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="WNM size preset (tiny, small, wan2.1-1.3b, wan2.2-5b)")
    p.add_argument("--variant", default="wnm_3d", choices=["wnm_3d", "wnm_2d"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--prompts", type=int, default=1, help="prompts per generate call (16 rollouts each)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps K")
    p.add_argument("--window-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed generate calls")
    p.add_argument("--warmup", type=int, default=1, help="untimed generate calls first")
    p.add_argument(
        "--deterministic",
        choices=["auto", "on", "off"],
        default="auto",
        help="per-request evaluation (bit-identical across batches); auto = on for CPU",
    )
    p.add_argument("--skip-baseline", action="store_true", help="do not time the diffusers Wan loop")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="accelerator peak for MFU (default 989 for cuda bf16/fp16 = H200 dense)",
    )
    p.add_argument("--output", type=Path, default=None, help="also write the results as JSON (must not exist)")
    args = p.parse_args(argv)
    for flag in ("prompts", "steps", "window_size", "iters"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.window_size > args.steps - 1:
        p.error(f"--window-size {args.window_size} must be <= --steps - 1 ({args.steps - 1})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    if args.output is not None and args.output.exists():
        p.error(f"--output {args.output} already exists; choose a new path")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, iters: int, warmup: int, device: torch.device, label: str) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in tqdm(range(iters), desc=label, leave=False):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def forward_flops(cfg, batch: int) -> float:
    """Approximate FLOPs of one DiT forward: matmuls of the blocks + self/cross attention scores."""
    d, s, lc = cfg.dim, cfg.sequence_length, cfg.context_tokens
    per_block = 2 * s * (4 * d * d) + 2 * (s * d * d * 2 + lc * d * d * 2) + 2 * s * 2 * d * cfg.ffn_dim
    attn = 4 * s * s * d + 4 * s * lc * d
    return float(batch) * cfg.num_layers * (per_block + attn)


def build_wnm(args, device, dtype):
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMContext, WNMTransformer
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, SamplerConfig

    cfg = WNMConfig.from_size(args.size, variant=args.variant)
    torch.manual_seed(0)
    transformer = WNMTransformer(cfg)
    gen = torch.Generator().manual_seed(1)
    # Synthetic prompt contexts of the exact encoded shapes: the frozen encoders are not part of rollout cost.
    ctx = WNMContext(
        history_latents=torch.randn(args.prompts, *cfg.history_latent_shape, generator=gen),
        encoder_tokens=torch.randn(args.prompts, cfg.context_tokens, cfg.dim, generator=gen),
    )
    sampler = SamplerConfig(num_steps=args.steps, window_strategy="fixed", window_start=0, window_size=args.window_size)
    deterministic = {"auto": None, "on": True, "off": False}[args.deterministic]
    backend = NativeRolloutBackend(
        transformer,
        cfg.target_latent_shape,
        ActionNormalization.identity(),
        sampler,
        NativeBackendConfig(device=str(device), dtype=args.dtype, deterministic=deterministic),
    )
    return cfg, backend, ctx


def build_wan_baseline(cfg, batch: int, device, dtype):
    model = wan_anchor(cfg, device, dtype)
    c, th, h, w = cfg.history_latent_shape
    tt = cfg.target_latent_shape[1]
    gen = torch.Generator().manual_seed(2)
    # History + target latent frames in one clip: the same number of video tokens as the WNM sequence.
    latents = torch.randn(batch, c, th + tt, h, w, generator=gen).to(device)
    text = torch.randn(batch, cfg.context_tokens, cfg.dim, generator=gen).to(device=device, dtype=dtype)
    return model, latents, text


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    from verl_omni.pipelines.wnm_shared import shifted_sigmas, stratified_requests

    cfg, backend, ctx = build_wnm(args, device, dtype)
    requests = stratified_requests([f"bench_{p}" for p in range(args.prompts)], run_seed=0, step=0)
    rollouts = len(requests)
    params = sum(p.numel() for p in backend.transformer.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wnm_times = timed(lambda: backend.generate(requests, ctx), args.iters, args.warmup, device, "wnm native")
    wnm_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    deterministic = backend.config.deterministic
    rows = [("wnm native", wnm_times, wnm_mem)]

    # The same DiT calls with a bare Euler update: separates the model's cost from the sampler's bookkeeping.
    from verl_omni.pipelines.wnm_shared import joint_velocity

    batch_ctx = ctx.to(device, dtype).select(torch.tensor([r.context_row for r in requests], device=device))
    x0 = torch.randn(rollouts, backend.layout.numel, generator=torch.Generator().manual_seed(3)).to(device)
    sig = backend.sampler.sigmas().tolist()

    @torch.no_grad()
    def wnm_dit_loop():
        x = x0
        for i in range(args.steps):
            v = joint_velocity(backend.transformer, backend.layout, x, sig[i], batch_ctx, dtype)
            x = x - (sig[i] - sig[i + 1]) * v
        return x

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dit_times = timed(wnm_dit_loop, args.iters, args.warmup, device, "wnm DiT-only loop")
    dit_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    rows.append(("wnm DiT-only loop", dit_times, dit_mem))

    if not args.skip_baseline:
        del backend, batch_ctx
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        wan, latents, text = build_wan_baseline(cfg, rollouts, device, dtype)
        sigmas = shifted_sigmas(args.steps, 3.0).tolist()

        @torch.no_grad()
        def wan_loop():
            x = latents.float()
            for i in range(args.steps):
                t = torch.full((rollouts,), sigmas[i] * 1000.0, device=device)
                v = wan(x.to(dtype), t, text, return_dict=False)[0]
                x = x - (sigmas[i] - sigmas[i + 1]) * v.float()
            return x

        wan_times = timed(wan_loop, args.iters, args.warmup, device, "diffusers wan loop")
        wan_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        rows.append(("diffusers Wan loop", wan_times, wan_mem))

    peak = args.peak_tflops
    if peak is None and device.type == "cuda" and dtype != torch.float32:
        peak = 989.0
    flops = forward_flops(cfg, rollouts) * args.steps
    print(
        f"\nrollout benchmark: size={args.size} variant={args.variant} device={device} dtype={args.dtype} "
        f"DiT params={params / 1e6:.1f}M seq={cfg.sequence_length} ctx={cfg.context_tokens} "
        f"batch={rollouts} rollouts x K={args.steps} (SDE window {args.window_size}) "
        f"deterministic={deterministic}"
    )
    header = f"{'path':<20} {'rollouts/s':>11} {'s/call':>9} {'ms/step':>9} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9}"
    print(header)
    print("-" * len(header))
    results = []
    for name, times, mem in rows:
        med = sorted(times)[len(times) // 2]
        tflops = flops / med / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
        print(
            f"{name:<20} {rollouts / med:>11.2f} {med:>9.3f} {1000 * med / args.steps:>9.1f} "
            f"{tflops:>9.2f} {mfu:>7} {mem:>9.2f}"
        )
        results.append(
            {
                "path": name,
                "rollouts_per_s": rollouts / med,
                "median_s": med,
                "times_s": times,
                "approx_tflops": tflops,
                "peak_gib": None if math.isnan(mem) else mem,
            }
        )
    if len(rows) == 3:
        medians = [sorted(t)[len(t) // 2] for _, t, _ in rows]
        print(
            f"native backend throughput = {medians[2] / medians[0]:.2f} x the plain diffusers Wan loop "
            f"(sampler bookkeeping costs {100 * (medians[0] / medians[1] - 1):.1f}% over the WNM DiT-only loop)"
        )
    if args.output is not None:
        tmp = args.output.with_name(args.output.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
        tmp.rename(args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
