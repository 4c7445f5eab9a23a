#!/usr/bin/env python
"""The DiT's two attention calls, kernel by kernel: PyTorch's flash (FA2), cuDNN and memory-efficient kernels.

Times ``F.scaled_dot_product_attention`` at the shapes one WNM block issues (bf16, ``[B, heads, S, head_dim]``):
self-attention over the joint sequence (history + target + action tokens) and cross-attention of that sequence
over the context. Each backend is forced with ``sdpa_kernel``. Forward alone, and forward + backward (the training
step's share); TFLOP/s count 4·B·H·S·L·Dh for the forward and 2.5× that for the backward. Accuracy: the relative
error of each kernel's output and input gradients against the fp32 math kernel on the first batch row.

Prints one table; medians of ``--iters`` calls after ``--warmup``.

``--shapes`` replaces the size's two calls by any list of ``name:SxL`` (S queries over L keys), e.g. our
self-attention beside the anchor's (``self:4640x4640,anchor:4608x4608``), to tell a token-count cost from a kernel
one. ``--layout bshd`` hands the kernel ``[B, S, H, Dh]`` tensors viewed as ``[B, H, S, Dh]`` (how both models call
it: heads split off a projection's output, no copy) instead of contiguous ``[B, H, S, Dh]`` ones.

    python scripts/bench_attention.py [--size wan2.1-1.3b] [--batches 4,16] [--backends flash,cudnn,efficient]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time  # noqa: E402

BACKENDS = ("flash", "cudnn", "efficient", "fa4")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """``[B, H, S, Dh]`` attention by ``backend``: SDPA under :func:`forced`, or FlashAttention-4's op (which takes
    ``[B, S, H, Dh]``; with ``--layout bshd`` the transposes are free views, as in the model)."""
    if backend == "fa4":
        from verl_omni.models.wnm.flash_attention4 import fa4_attention

        return fa4_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v)


@contextlib.contextmanager
def forced(backend: str):
    """Forces SDPA onto ``backend`` (no-op for ``fa4``, which does not go through SDPA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "fa4":
        yield
        return

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


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """``"self:4640x4640,cross:4640x545"`` -> ``{"self": (4640, 4640), "cross": (4640, 545)}``.

    Raises:
        ValueError: naming the entry that is not ``name:SxL`` with positive S and L, or a repeated name.
    """
    shapes: dict[str, tuple[int, int]] = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, dims = entry.partition(":")
        s, _, length = dims.partition("x")
        if not name or not s.isdigit() or not length.isdigit() or int(s) < 1 or int(length) < 1:
            raise ValueError(f"{entry!r} is not name:SxL with positive integers S and L (e.g. self:4640x4640)")
        if name in shapes:
            raise ValueError(f"the name {name!r} is given twice")
        shapes[name] = (int(s), int(length))
    if not shapes:
        raise ValueError("no shape given")
    return shapes


def make_input(shape, layout: str, device, dtype, gen) -> torch.Tensor:
    """A random ``[B, H, S, Dh]`` tensor, contiguous (``bhsd``) or a transposed view of ``[B, S, H, Dh]`` (``bshd``)."""
    b, h, s, d = shape
    if layout == "bshd":
        return torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen).transpose(1, 2)
    return torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="wan2.1-1.3b")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shapes", default=None, help="name:SxL,... (S queries over L keys) instead of the size's calls")
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd", help="memory layout of q, k, v (see above)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    shapes = None
    if args.shapes is not None:
        try:
            shapes = parse_shapes(args.shapes)
        except ValueError as e:
            p.error(f"--shapes: {e}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    from verl_omni.models.wnm import WNMConfig

    cfg = WNMConfig.from_size(args.size)
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
    seq = cfg.history_tokens + cfg.target_tokens + cfg.action_steps
    calls = shapes or {"self": (seq, seq), "cross": (seq, cfg.context_tokens)}
    listed = ", ".join(f"{name} {s}x{n}" for name, (s, n) in calls.items())
    print(
        f"size {cfg.size}: heads {heads} x head_dim {head_dim}, {listed}, layout {args.layout}; "
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}",
        flush=True,
    )
    header = f"{'batch':>5} {'call':<12} {'backend':<10}{'fwd ms':>9}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}"
    print(header + f"{'err out':>10}{'err dq':>10}{'err dk':>10}", flush=True)
    rows = []
    for b in (int(v) for v in args.batches.split(",") if v.strip()):
        for call, (s, length) in calls.items():
            gen = torch.Generator(device=device).manual_seed(b * 7 + s)
            q, k, v, grad = (
                make_input((b, heads, n, head_dim), args.layout, device, dtype, gen) for n in (s, length, length, s)
            )
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

                        def fwd(q=q, k=k, v=v, backend=backend):
                            with torch.no_grad():
                                return attention(q, k, v, backend)

                        def fwd_bwd(qg=qg, kg=kg, vg=vg, grad=grad, backend=backend):
                            out = attention(qg, kg, vg, backend)
                            return torch.autograd.grad(out, (qg, kg, vg), grad)

                        out = attention(qg[:1], kg[:1], vg[:1], backend)
                        dq, dk = torch.autograd.grad(out, (qg, kg), grad[:1])
                        errs = (relative_error(out, ref), relative_error(dq[:1], ref_grads[0]))
                        errs += (relative_error(dk[:1], ref_grads[1]),)
                        t_f = median_time(fwd, device, args.warmup, args.iters)
                        t_fb = math.nan if args.no_backward else median_time(fwd_bwd, device, args.warmup, args.iters)
                except Exception as e:  # a kernel that does not apply must not lose the other rows
                    print(f"{b:>5} {call:<12} {backend:<10} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = {
                    "batch": b,
                    "call": call,
                    "backend": backend,
                    "fwd_ms": t_f * 1e3,
                    "fwd_tflops": fwd_flops / t_f / 1e12,
                    "fwd_bwd_ms": None if math.isnan(t_fb) else t_fb * 1e3,
                    "fwd_bwd_tflops": None if math.isnan(t_fb) else 3.5 * fwd_flops / t_fb / 1e12,
                    "err_out": errs[0],
                    "err_dq": errs[1],
                    "err_dk": errs[2],
                }
                rows.append(row)
                print(
                    f"{b:>5} {call:<12} {backend:<10}{row['fwd_ms']:9.2f}{row['fwd_tflops']:9.0f}"
                    f"{t_fb * 1e3:12.2f}{3.5 * fwd_flops / t_fb / 1e12:9.0f}"
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
