#!/usr/bin/env python
"""The feed-forward's first product with its GELU fused into the GEMM (cuBLASLt's bias + GELU epilogue) or not.

A Wan block's feed-forward computes ``gelu_tanh(x W1^T + b1)`` over ``[tokens, 8960]``: as a GEMM that writes the
product and a separate GELU kernel that reads and writes it again, that is two extra passes over the block's largest
activation. ``torch._addmm_activation(..., use_gelu=True)`` asks cuBLASLt for the bias and GELU in the GEMM's
epilogue. This script times, in one process at the DiT's shapes (bf16, CUDA), medians:

- ``linear + gelu``: ``F.gelu(F.linear(x, W, b), approximate="tanh")``, eager and compiled (what the block runs);
- ``addmm + GELU epilogue``: ``torch._addmm_activation(b, x, W^T, use_gelu=True)``, eager and compiled;
- with ``--quack``, the same product by QuACK's CuTe DSL GEMM (``quack.gemm_interface.gemm_act``, the package
  FlashAttention-4 installs), which applies bias and GELU in its own epilogue: with its default config and, with
  ``--quack-tuned``, autotuned; the feed-forward's second product (``x W2^T + b2``) by cuBLAS and by QuACK; and the
  backward's first product with the GELU's derivative (``(dy W2) * gelu'(h)``: a GEMM then inductor's pointwise
  kernel, against QuACK's ``gemm_dact``, which fuses the derivative into the GEMM's epilogue);

and prints which GELU each fused form computes (its distance from the tanh form and from the exact form; on CPU
PyTorch computes the exact one, so the two devices would differ). TFLOP/s count 2·M·K·N per product.

    python scripts/bench_gelu_epilogue.py --batches 4,16 [--quack [--quack-tuned]]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time  # noqa: E402


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def addmm_gelu(x, w, b):
    return torch._addmm_activation(b, x, w.t(), use_gelu=True)


def quack_gelu(x, w, b, tuned: bool = False):
    """QuACK's GEMM with the bias and tanh GELU in its epilogue; only the activation is stored."""
    from quack.gemm_interface import gemm_act

    return gemm_act(x, w.t(), bias=b, activation="gelu_tanh_approx", store_preact=False, tuned=tuned)[1]


def quack_linear(x, w, b, tuned: bool = False):
    from quack.gemm_interface import gemm

    return gemm(x, w.t(), bias=b, tuned=tuned)


def gelu_grad_composite(dy, w2, h):
    """``d loss / d h`` of ``gelu_tanh(h) W2^T`` given ``dy``: the GEMM, then the GELU's derivative pointwise."""
    return torch.ops.aten.gelu_backward(dy @ w2, h, approximate="tanh")


def gelu_grad_quack(dy, w2, h, tuned: bool = False):
    """The same by QuACK's ``gemm_dact`` (derivative in the epilogue; it also re-emits ``gelu_tanh(h)``)."""
    from quack.gemm_interface import gemm_dact

    return gemm_dact(dy, w2, h, activation="gelu_tanh_approx", tuned=tuned)[0]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1536, help="model width (default: Wan2.1-1.3B's)")
    p.add_argument("--ffn-dim", type=int, default=8960, help="feed-forward width (default: Wan2.1-1.3B's)")
    p.add_argument("--seq", type=int, default=4640, help="tokens per sample (default: the wan2.1-1.3b WNM sequence)")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quack", action="store_true", help="add QuACK's GEMMs (needs the quack-kernels package)")
    p.add_argument("--quack-tuned", action="store_true", help="with --quack, also QuACK's autotuned configs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gelu_epilogue.py needs a CUDA device")
    device = torch.device("cuda")
    dim, ffn, seq = args.dim, args.ffn_dim, args.seq
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(ffn, dim, device=device, generator=g) / dim**0.5
    b = torch.randn(ffn, device=device, generator=g) * 0.1
    x32 = torch.randn(256, dim, device=device, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        y = addmm_gelu(x32.to(dtype), w.to(dtype), b.to(dtype)).double()
        z = F.linear(x32.double(), w.double(), b.double())
        tanh, exact = F.gelu(z, approximate="tanh"), F.gelu(z)
        print(
            f"epilogue GELU, {dtype}: max |diff| from the tanh form {(y - tanh).abs().max():.2e}, "
            f"from the exact form {(y - exact).abs().max():.2e}"
        )
    wb, bb = w.bfloat16(), b.bfloat16()
    w2 = (torch.randn(dim, ffn, device=device, generator=g) / ffn**0.5).bfloat16()
    b2 = (torch.randn(dim, device=device, generator=g) * 0.1).bfloat16()
    tunings = ([False, True] if args.quack_tuned else [False]) if args.quack else []
    if args.quack:
        xb = x32.bfloat16()
        ref = F.linear(xb.double(), wb.double(), bb.double())
        for tuned in tunings:
            y = quack_gelu(xb, wb, bb, tuned).double()
            tanh_form, exact_form = F.gelu(ref, approximate="tanh"), F.gelu(ref)
            print(
                f"QuACK epilogue GELU{' (tuned)' if tuned else ''}, bf16: relative difference from the tanh form "
                f"{rel_diff(y, tanh_form):.2e}, from the exact form {rel_diff(y, exact_form):.2e}"
            )
        dy, h = torch.randn(256, dim, device=device, generator=g).bfloat16(), ref.bfloat16()
        exact = torch.ops.aten.gelu_backward(dy.double() @ w2.double(), h.double(), approximate="tanh")
        print(
            f"GELU gradient, bf16, relative difference from float64: composite "
            f"{rel_diff(gelu_grad_composite(dy, w2, h), exact):.2e}, QuACK gemm_dact "
            f"{rel_diff(gelu_grad_quack(dy, w2, h), exact):.2e}"
        )
    compiled = {
        "linear + gelu": torch.compile(linear_gelu),
        "addmm + GELU epilogue": torch.compile(addmm_gelu),
        "gelu grad": torch.compile(gelu_grad_composite),
    }
    print(f"dim {dim}, ffn {ffn}, {seq} tokens a sample, {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(f"{'batch':>5}  {'variant':<44}{'ms':>8}{'TFLOP/s':>9}{'x first row':>13}")
    for batch in (int(v) for v in args.batches.split(",")):
        tokens = batch * seq
        x = torch.randn(tokens, dim, device=device, generator=g, dtype=torch.bfloat16)
        hidden = F.linear(x, wb, bb)
        dy = torch.randn(tokens, dim, device=device, generator=g, dtype=torch.bfloat16)
        flops = 2.0 * tokens * dim * ffn  # every product here is tokens x dim x ffn
        groups: dict[str, dict] = {
            "up": {
                "linear + gelu, eager": lambda x=x: linear_gelu(x, wb, bb),
                "linear + gelu, compiled": lambda x=x: compiled["linear + gelu"](x, wb, bb),
                "addmm + GELU epilogue, eager": lambda x=x: addmm_gelu(x, wb, bb),
                "addmm + GELU epilogue, compiled": lambda x=x: compiled["addmm + GELU epilogue"](x, wb, bb),
            },
            "down": {"second product, cuBLAS (F.linear)": lambda h=hidden: F.linear(h, w2, b2)},
            "grad": {"GELU gradient, GEMM + inductor": lambda dy=dy, h=hidden: compiled["gelu grad"](dy, w2, h)},
        }
        for tuned in tunings:
            tag = "autotuned" if tuned else "default config"
            groups["up"][f"QuACK gemm_act, {tag}"] = lambda x=x, t=tuned: quack_gelu(x, wb, bb, t)
            groups["down"][f"second product, QuACK, {tag}"] = lambda h=hidden, t=tuned: quack_linear(h, w2, b2, t)
            groups["grad"][f"GELU gradient, QuACK gemm_dact, {tag}"] = lambda dy=dy, h=hidden, t=tuned: gelu_grad_quack(
                dy, w2, h, t
            )
        for rows in groups.values():
            base = None
            for name, fn in rows.items():
                try:
                    t = median_time(fn, device, 3, args.iters) * 1e3
                except Exception as e:  # a QuACK config that fails to build or run gets a row, the rest still run
                    print(f"{batch:>5}  {name:<44}  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                base = base or t
                print(f"{batch:>5}  {name:<44}{t:8.3f}{flops / t / 1e9:9.1f}{base / t:12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
