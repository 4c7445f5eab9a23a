#!/usr/bin/env python
"""Benchmark the WNM joint DiT against diffusers' WanTransformer3DModel of the same dims.

For each size and batch it times forward and forward+backward of (a) our WNMTransformer on the full joint
sequence [history video | target video | 32 action tokens] and (b) diffusers' WanTransformer3DModel on a video
of the same number of latent frames (history + target), i.e. the same video sequence length without the
action tokens, then prints a table with the time ratio (ours / Wan). Weights are randomly initialised: no
download is needed.

Examples:
    python scripts/bench_model.py                                  # tiny on CPU, fp32
    python scripts/bench_model.py --device cuda --dtype bfloat16 --sizes wan2.1-1.3b --batch 4
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time, peak_gib, reset_peak, wan_anchor  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny", help="comma-separated WNMConfig sizes (default: tiny)")
    p.add_argument("--batch", default="4", help="comma-separated batch sizes (default: 4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-wan", action="store_true", help="only benchmark our transformer")
    p.add_argument("--gradient-checkpointing", action="store_true")
    return p.parse_args(argv)


def bench_ours(cfg, batch: int, device, dtype, args) -> dict:
    from verl_omni.models.wnm import WNMContext, WNMTransformer

    model = WNMTransformer(cfg).to(device=device, dtype=dtype)
    model.gradient_checkpointing = args.gradient_checkpointing
    ctx = WNMContext(
        history_latents=torch.randn(batch, *cfg.history_latent_shape, device=device, dtype=dtype),
        encoder_tokens=torch.randn(batch, cfg.context_tokens, cfg.dim, device=device, dtype=dtype),
        encoder_mask=torch.ones(batch, cfg.context_tokens, dtype=torch.bool, device=device),
    )
    x = torch.randn(batch, *cfg.target_latent_shape, device=device, dtype=dtype)
    a = torch.randn(batch, cfg.action_steps, cfg.action_channels, device=device, dtype=dtype)
    s = torch.rand(batch, device=device)

    def fwd():
        with torch.no_grad():
            model(x, a, s, ctx)

    def fwd_bwd():
        v, va = model(x, a, s, ctx)
        (v.float().square().mean() + va.float().square().mean()).backward()
        model.zero_grad(set_to_none=True)

    return _measure(model, fwd, fwd_bwd, device, args, cfg.sequence_length)


def bench_wan(cfg, batch: int, device, dtype, args) -> dict:
    model = wan_anchor(cfg, device, dtype).train()
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    c, th, h, w = cfg.history_latent_shape
    tt = cfg.target_latent_shape[1]
    video = torch.randn(batch, c, th + tt, h, w, device=device, dtype=dtype)
    text = torch.randn(batch, cfg.context_tokens, cfg.dim, device=device, dtype=dtype)
    t = torch.rand(batch, device=device) * 1000

    def fwd():
        with torch.no_grad():
            model(video, t, text, return_dict=False)

    def fwd_bwd():
        out = model(video, t, text, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    return _measure(model, fwd, fwd_bwd, device, args, cfg.history_tokens + cfg.target_tokens)


def _measure(model, fwd, fwd_bwd, device, args, seq_len) -> dict:
    n_params = sum(p.numel() for p in model.parameters())
    reset_peak(device)
    t_fwd = median_time(fwd, device, args.warmup, args.iters)
    t_bwd = median_time(fwd_bwd, device, args.warmup, args.iters)
    return {"params": n_params, "seq": seq_len, "fwd": t_fwd, "fwd_bwd": t_bwd, "peak": peak_gib(device)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from verl_omni.models.wnm import WNMConfig

    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("CUDA is not available on this machine")
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        batches = [int(b) for b in args.batch.split(",")]
        configs = [WNMConfig.from_size(s) for s in sizes]
    except ValueError as e:
        print(f"error: --sizes/--batch/--device: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    rows = []
    for cfg in configs:
        for b in batches:
            res = {"WNM (ours)": bench_ours(cfg, b, device, dtype, args)}
            if not args.skip_wan:
                res["diffusers Wan"] = bench_wan(cfg, b, device, dtype, args)
            for name, r in res.items():
                rows.append((cfg.size, b, name, r))
            if not args.skip_wan:
                o, w = res["WNM (ours)"], res["diffusers Wan"]
                rows.append(
                    (
                        cfg.size,
                        b,
                        "ratio ours/Wan",
                        {"fwd": o["fwd"] / w["fwd"], "fwd_bwd": o["fwd_bwd"] / w["fwd_bwd"]},
                    )
                )
    header = (
        f"{'size':<12} {'batch':>5} {'model':<15} {'dtype':<9} {'device':<7} {'params':>12} {'seq':>6} "
        f"{'fwd s':>9} {'fwd+bwd s':>10} {'peak GiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for size, b, name, r in rows:
        if name.startswith("ratio"):
            print(
                f"{size:<12} {b:>5} {name:<15} {'':<9} {'':<7} {'':>12} {'':>6} {r['fwd']:>8.3f}x {r['fwd_bwd']:>9.3f}x"
            )
            continue
        peak = "n/a" if math.isnan(r["peak"]) else f"{r['peak']:.2f}"
        print(
            f"{size:<12} {b:>5} {name:<15} {args.dtype:<9} {device.type:<7} {r['params']:>12,} {r['seq']:>6} "
            f"{r['fwd']:>9.4f} {r['fwd_bwd']:>10.4f} {peak:>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
