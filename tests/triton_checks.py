"""Shared by the tests of our Triton kernels: unit roundoffs, and running a kernel under Triton's interpreter.

Triton's interpreter (``TRITON_INTERPRET=1``) executes a kernel's source with NumPy on the CPU. It is chosen when
Triton is first imported (its standard library, ``tl.sum`` included, is decorated then), and other tests of a
session may have imported Triton already. So a kernel runs in a child process started with the variable set: the
child reads the cases the test saved, calls the op, and saves the outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Triton's interpreter casts fp32 to bf16 by truncation (checked: about half of random values land one ulp below
# round-to-nearest; fp_downcast_rounding="rtne" does not change that), while the GPU rounds to nearest. A
# truncation errs by up to one ulp (2 u), so interpreted bf16 gets twice the bound; fp16 rounds to nearest in
# both. The GPU tests check the GPU's roundings against the 1 u bound.
INTERPRETED_ROUNDINGS = {torch.bfloat16: 2.0, torch.float16: 1.0}


# The child process: loads the cases, calls the test's ``run(case)`` on each without grad, saves the outputs.
_CHILD = """
import sys
import torch
{runner}
cases = torch.load(sys.argv[1])
with torch.no_grad():
    out = {{name: run(case) for name, case in cases.items()}}
torch.save(out, sys.argv[2])
"""


def run_interpreted(runner: str, cases: dict, directory) -> dict:
    """Runs each case through a kernel under Triton's interpreter, in a child process; returns the outputs by name.

    Args:
        runner: Python source (imports included) defining ``run(case) -> outputs`` for one case.
        cases: ``{name: case}``, passed to the child with ``torch.save``.
        directory: Where the two files go (a pytest temporary directory).
    """
    pytest.importorskip("triton", reason="Triton's interpreter runs the kernel on the CPU (the triton extra)")
    inputs, outputs = directory / "cases.pt", directory / "outputs.pt"
    torch.save(cases, inputs)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(runner=runner), str(inputs), str(outputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(outputs)
