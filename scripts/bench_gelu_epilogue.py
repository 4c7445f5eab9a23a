#!/usr/bin/env python
"""The feed-forward's first product with its GELU fused into the GEMM (cuBLASLt's bias + GELU epilogue) or not.

A Wan block's feed-forward computes ``gelu_tanh(x W1^T + b1)`` over ``[tokens, 8960]``: as a GEMM that writes the
product and a separate GELU kernel that reads and writes it again, that is two extra passes over the block's largest
activation. ``torch._addmm_activation(..., use_gelu=True)`` asks cuBLASLt for the bias and GELU in the GEMM's
epilogue. This script times, in one process at the DiT's shapes (bf16, CUDA), medians:

- ``linear + gelu``: ``F.gelu(F.linear(x, W, b), approximate="tanh")``, eager and compiled (what the block runs);
- ``addmm + GELU epilogue``: ``torch._addmm_activation(b, x, W^T, use_gelu=True)``, eager and compiled;
- the epilogue GEMM over 2 or 4 row blocks of ``x`` (cuBLASLt's heuristics choose the kernel by shape);
- ``mm, no bias or GELU``: the same product alone, the ceiling the epilogue kernel is measured against;

and prints which GELU the epilogue computes (its distance from the tanh form and from the exact form; on CPU
PyTorch computes the exact one, so the two devices would differ).

cuBLAS chooses its kernel by heuristics that depend on the workspace it may use and on which library PyTorch calls.
``--settings`` repeats the table under other choices, each in a fresh child process because PyTorch reads the
workspace variables once per process: ``lt-ws=KIB`` sets ``CUBLASLT_WORKSPACE_SIZE`` (KiB), ``ws=CONFIG`` sets
``CUBLAS_WORKSPACE_CONFIG``, ``lib=cublaslt`` calls ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
join several with ``+``.

    python scripts/bench_gelu_epilogue.py --batches 4,16
    python scripts/bench_gelu_epilogue.py --batches 16 --settings "lt-ws=32768,lt-ws=65536,lib=cublaslt"
"""

from __future__ import annotations

import argparse
import os
import subprocess
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


def addmm_gelu_chunked(x, w, b, chunks: int):
    """The epilogue GEMM over ``chunks`` row blocks of ``x``, written into one output: cuBLASLt picks its kernel
    by shape, so a smaller M can get another tile or cluster shape."""
    out = x.new_empty(x.shape[0], w.shape[0])
    for rows, dst in zip(x.chunk(chunks), out.chunk(chunks)):
        torch._addmm_activation(b, rows, w.t(), use_gelu=True, out=dst)
    return out


def mm_only(x, w, b):
    return torch.mm(x, w.t())


SETTING_KEYS = {"lt-ws": "CUBLASLT_WORKSPACE_SIZE", "ws": "CUBLAS_WORKSPACE_CONFIG", "lib": None}


def parse_setting(text: str) -> tuple[dict[str, str], str | None]:
    """One ``--settings`` item (``lt-ws=32768+lib=cublaslt``) as (environment variables, BLAS library or None)."""
    env, library = {}, None
    for part in text.split("+"):
        key, sep, value = part.partition("=")
        if not sep or key not in SETTING_KEYS or not value:
            raise SystemExit(f"--settings: {part!r} is not one of lt-ws=KIB, ws=CONFIG, lib=cublas|cublaslt")
        if key == "lib":
            if value not in ("cublas", "cublaslt"):
                raise SystemExit(f"--settings: lib={value!r}; use lib=cublas or lib=cublaslt")
            library = value
        else:
            env[SETTING_KEYS[key]] = value
    return env, library


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1536, help="model width (default: Wan2.1-1.3B's)")
    p.add_argument("--ffn-dim", type=int, default=8960, help="feed-forward width (default: Wan2.1-1.3B's)")
    p.add_argument("--seq", type=int, default=4640, help="tokens per sample (default: the wan2.1-1.3b WNM sequence)")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--settings",
        default="",
        help="comma-separated cuBLAS settings to repeat the timing under, each in a child process: "
        "lt-ws=KIB (CUBLASLT_WORKSPACE_SIZE), ws=CONFIG (CUBLAS_WORKSPACE_CONFIG), lib=cublas|cublaslt; "
        "join several with + (default: the process's own settings only)",
    )
    p.add_argument("--blas-library", choices=("cublas", "cublaslt"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = [parse_setting(item) for item in args.settings.split(",") if item]
    batches = [v.strip() for v in args.batches.split(",") if v.strip()]
    if not batches or not all(v.isdigit() and int(v) > 0 for v in batches):
        p.error(f"--batches must be comma-separated positive integers (e.g. 4,16), got {args.batches!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_gelu_epilogue.py needs a CUDA device")
    if args.blas_library:
        torch.backends.cuda.preferred_blas_library(args.blas_library)
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
    compiled = {"linear + gelu": torch.compile(linear_gelu), "addmm + GELU epilogue": torch.compile(addmm_gelu)}
    chosen = " ".join(f"{k}={os.environ[k]}" for k in SETTING_KEYS.values() if k and k in os.environ)
    library = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    print(f"dim {dim}, ffn {ffn}, {seq} tokens a sample, {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(f"cuBLAS settings: {chosen or 'defaults'}, preferred library {library}")
    print(f"{'batch':>5}  {'variant':<36}{'ms':>8}{'TFLOP/s':>9}{'x eager linear+gelu':>21}")
    for batch in (int(v) for v in batches):
        x = torch.randn(batch * seq, dim, device=device, generator=g, dtype=torch.bfloat16)
        rows = {
            "linear + gelu, eager": lambda x=x: linear_gelu(x, wb, bb),
            "linear + gelu, compiled": lambda x=x: compiled["linear + gelu"](x, wb, bb),
            "addmm + GELU epilogue, eager": lambda x=x: addmm_gelu(x, wb, bb),
            "addmm + GELU epilogue, compiled": lambda x=x: compiled["addmm + GELU epilogue"](x, wb, bb),
            "addmm + GELU epilogue, M in 2 chunks": lambda x=x: addmm_gelu_chunked(x, wb, bb, 2),
            "addmm + GELU epilogue, M in 4 chunks": lambda x=x: addmm_gelu_chunked(x, wb, bb, 4),
            "mm, no bias or GELU": lambda x=x: mm_only(x, wb, bb),
        }
        ms = {name: median_time(fn, device, 3, args.iters) * 1e3 for name, fn in rows.items()}
        base = ms["linear + gelu, eager"]
        flops = 2 * batch * seq * dim * ffn
        for name, t in ms.items():
            print(f"{batch:>5}  {name:<36}{t:8.3f}{flops / t / 1e9:9.1f}{base / t:20.2f}x", flush=True)
    for env, library in settings:
        # A fresh process per setting: PyTorch sizes the cuBLAS(Lt) workspace once, at its first GEMM.
        child = [sys.executable, __file__, "--dim", str(dim), "--ffn-dim", str(ffn), "--seq", str(seq)]
        child += ["--batches", args.batches, "--iters", str(args.iters)]
        child += ["--blas-library", library] if library else []
        print(flush=True)
        subprocess.run(child, env={**os.environ, **env}, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
