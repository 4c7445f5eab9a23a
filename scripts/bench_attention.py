#!/usr/bin/env python
"""The DiT's two attention calls, kernel by kernel: PyTorch's flash (FA2), cuDNN and memory-efficient kernels.

Times ``F.scaled_dot_product_attention`` at the shapes one WNM block issues (bf16, ``[B, heads, S, head_dim]``):
self-attention over the joint sequence (history + target + action tokens) and cross-attention of that sequence
over the context. Each backend is forced with ``sdpa_kernel``. Forward alone, and forward + backward (the training
step's share); TFLOP/s count 4·B·H·S·L·Dh for the forward and 2.5× that for the backward. Accuracy: the relative
error of each kernel's output and input gradients against the fp32 math kernel on the first batch row.

Prints one table; medians of ``--iters`` calls after ``--warmup``.

    python scripts/bench_attention.py [--size wan2.1-1.3b] [--batches 4,16] [--backends flash,cudnn,efficient]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time  # noqa: E402

BACKENDS = ("flash", "cudnn", "efficient")


@contextlib.contextmanager
def forced(backend: str):
    """Forces SDPA onto ``backend``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    with sdpa_kernel(kind):
        yield


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="wan2.1-1.3b")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    from verl_omni.models.wnm import WNMConfig

    cfg = WNMConfig.from_size(args.size)
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
    seq = cfg.history_tokens + cfg.target_tokens + cfg.action_steps
    calls = {"self": (seq, seq), "cross": (seq, cfg.context_tokens)}
    print(
        f"size {cfg.size}: heads {heads} x head_dim {head_dim}, self {seq}x{seq}, cross {seq}x{cfg.context_tokens}; "
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}",
        flush=True,
    )
    header = f"{'batch':>5} {'call':<6} {'backend':<10}{'fwd ms':>9}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}"
    print(header + f"{'err out':>10}{'err dq':>10}{'err dk':>10}", flush=True)
    rows = []
    for b in (int(v) for v in args.batches.split(",") if v.strip()):
        for call, (s, length) in calls.items():
            gen = torch.Generator(device=device).manual_seed(b * 7 + s)
            q, k, v = (
                torch.randn(b, heads, n, head_dim, device=device, dtype=dtype, generator=gen)
                for n in (s, length, length)
            )
            grad = torch.randn(b, heads, s, head_dim, device=device, dtype=dtype, generator=gen)
            # fp32 math reference on the first row (accuracy only).
            q1, k1, v1 = (t[:1].float().requires_grad_() for t in (q, k, v))
            with forced("math"):
                ref = F.scaled_dot_product_attention(q1, k1, v1)
            ref_grads = torch.autograd.grad(ref, (q1, k1), grad[:1].float())
            fwd_flops = 4 * b * heads * s * length * head_dim
            for backend in backends:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                try:
                    with forced(backend):

                        def fwd(q=q, k=k, v=v):
                            with torch.no_grad():
                                return F.scaled_dot_product_attention(q, k, v)

                        def fwd_bwd(qg=qg, kg=kg, vg=vg, grad=grad):
                            out = F.scaled_dot_product_attention(qg, kg, vg)
                            return torch.autograd.grad(out, (qg, kg, vg), grad)

                        out = F.scaled_dot_product_attention(qg[:1], kg[:1], vg[:1])
                        dq, dk = torch.autograd.grad(out, (qg, kg), grad[:1])
                        errs = (relative_error(out, ref), relative_error(dq[:1], ref_grads[0]))
                        errs += (relative_error(dk[:1], ref_grads[1]),)
                        t_f = median_time(fwd, device, args.warmup, args.iters)
                        t_fb = median_time(fwd_bwd, device, args.warmup, args.iters)
                except Exception as e:  # a kernel that does not apply must not lose the other rows
                    print(f"{b:>5} {call:<6} {backend:<10} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = {
                    "batch": b,
                    "call": call,
                    "backend": backend,
                    "fwd_ms": t_f * 1e3,
                    "fwd_tflops": fwd_flops / t_f / 1e12,
                    "fwd_bwd_ms": t_fb * 1e3,
                    "fwd_bwd_tflops": 3.5 * fwd_flops / t_fb / 1e12,
                    "err_out": errs[0],
                    "err_dq": errs[1],
                    "err_dk": errs[2],
                }
                rows.append(row)
                print(
                    f"{b:>5} {call:<6} {backend:<10}{row['fwd_ms']:9.2f}{row['fwd_tflops']:9.0f}"
                    f"{row['fwd_bwd_ms']:12.2f}{row['fwd_bwd_tflops']:9.0f}"
                    f"{errs[0]:10.1e}{errs[1]:10.1e}{errs[2]:10.1e}",
                    flush=True,
                )
    if args.json is not None:
        tmp = args.json.with_name(args.json.name + ".partial")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.rename(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
