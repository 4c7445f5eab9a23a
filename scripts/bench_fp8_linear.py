#!/usr/bin/env python
"""Where an FP8 linear layer's time goes at the DiT's shapes: the float8 matrix product against bf16, and the
activation quantization around it.

For each linear shape of a Wan block (attention projections ``D -> D``, feed-forward ``D -> F`` and ``F -> D``) at
``tokens = batch x sequence`` rows, times in one process (CUDA, compute capability 8.9+), medians:

- ``bf16``: ``torch.nn.functional.linear`` in bf16 (cuBLAS), the reference;
- ``fp8 GEMM, row-wise``: ``torch._scaled_mm`` on operands already in float8, one scale per row / column (the
  recipe of ``verl_omni.models.wnm.fp8``), i.e. the matrix product alone;
- ``fp8 GEMM, tensor-wise``: the same with one scale per operand;
- ``quantize x``: ``quantize_rowwise`` of the activation alone, compiled;
- ``Float8Linear``: the layer as the FP8 rollout copy runs it (quantize + GEMM), compiled.

Prints TFLOP/s per row (2 x tokens x in x out FLOPs per product) and the layer's speed-up over bf16.

    python scripts/bench_fp8_linear.py --size wan2.1-1.3b --batches 4,16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time  # noqa: E402


@torch.no_grad()
def time_shape(m: int, k: int, n: int, device, quantize, iters: int) -> dict[str, float]:
    """Median milliseconds of each variant for ``x [m, k] @ W [n, k]^T`` (bf16 in, bf16 out)."""
    from verl_omni.models.wnm.fp8 import FLOAT8, Float8Linear

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    lin = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_linear(lin)
    fp8_compiled = torch.compile(fp8)
    x_q, x_s = quantize(x)
    w_t = fp8.weight_fp8.t()
    one = torch.ones((), device=device)
    x_amax = x.float().abs().amax() / 448
    x_qt = (x.float() / x_amax).to(FLOAT8)
    rows = {
        "bf16": lambda: F.linear(x, lin.weight, lin.bias),
        "fp8 GEMM, row-wise": lambda: torch._scaled_mm(
            x_q, w_t, scale_a=x_s, scale_b=fp8.weight_scale, bias=lin.bias, out_dtype=torch.bfloat16
        ),
        "fp8 GEMM, tensor-wise": lambda: torch._scaled_mm(
            x_qt, w_t, scale_a=x_amax, scale_b=one, out_dtype=torch.bfloat16
        ),
        "quantize x (compiled)": lambda: quantize(x),
        "Float8Linear (compiled)": lambda: fp8_compiled(x),
    }
    return {name: median_time(fn, device, 3, iters) * 1e3 for name, fn in rows.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="wan2.1-1.3b")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench_fp8_linear.py needs a CUDA device with FP8 tensor cores (compute capability 8.9+)")
    from verl_omni.models.wnm import WNMConfig
    from verl_omni.models.wnm.fp8 import quantize_rowwise

    device = torch.device("cuda")
    cfg = WNMConfig.from_size(args.size)
    pt, ph, pw = cfg.patch_size
    _, th, hh, wh = cfg.history_latent_shape
    _, tt, ht, wt = cfg.target_latent_shape
    seq = (th // pt) * (hh // ph) * (wh // pw) + (tt // pt) * (ht // ph) * (wt // pw) + cfg.action_steps
    shapes = [("attention projection", cfg.dim, cfg.dim), ("feed-forward in", cfg.dim, cfg.ffn_dim),
              ("feed-forward out", cfg.ffn_dim, cfg.dim)]  # fmt: skip
    quantize = torch.compile(quantize_rowwise)
    print(f"size {cfg.size}, sequence {seq} tokens, torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(f"{'batch':>5}  {'shape':<28}{'variant':<24}{'ms':>8}{'TFLOP/s':>9}{'x bf16':>8}")
    for b in (int(v) for v in args.batches.split(",")):
        for name, k, n in shapes:
            ms = time_shape(b * seq, k, n, device, quantize, args.iters)
            flops = 2 * b * seq * k * n
            for variant, t in ms.items():
                tflops = f"{flops / t / 1e9:9.1f}" if "quantize" not in variant else f"{'-':>9}"
                print(f"{b:>5}  {name + f' {k}->{n}':<28}{variant:<24}{t:8.3f}{tflops}{ms['bf16'] / t:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
