#!/usr/bin/env python
"""CPU-safe sibling of ``bench_stage3_gpu.py``: the same measurements at the ``tiny`` size in fp32 on CPU.

Runs in about a minute on two cores; useful to check the benchmark end to end without a GPU. Extra
arguments are passed through (e.g. ``--compile`` to include inductor-compiled blocks, slower to start).

    python scripts/bench_stage3_cpu.py [--compile] [--out FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stage3_gpu import main  # noqa: E402

CPU_DEFAULTS = [
    "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,4",
    "--micro-batch", "8", "--warmup", "1", "--iters", "3", "--text-tokens", "64",
]  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(CPU_DEFAULTS + sys.argv[1:]))
