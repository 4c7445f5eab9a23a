"""Compiled, the deferred feed-forward residual fuses into the next block's first LayerNorm (inductor may then keep
the sum unrounded before the norm), so on the GPU the outputs are compared within bf16 rounding, not bit for bit."""

from __future__ import annotations

import pytest
import torch
from wnm_inputs import cuda_bf16_outputs_with_and_without
from wnm_inputs import relative_difference as _rel

from verl_omni.models.wnm import transformer as transformer_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("compiled", [False, True])
def test_deferred_residual_stays_within_bf16_rounding_of_the_in_block_add(compiled, monkeypatch):
    off = lambda m: monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", False)  # noqa: E731
    deferred, added = cuda_bf16_outputs_with_and_without(off, num_layers=3, compiled=compiled)
    for d, a in zip(deferred, added, strict=True):
        assert torch.isfinite(d).all()
        if compiled:
            assert _rel(d, a) < 2e-2  # bf16 rounding only
        else:
            assert torch.equal(d, a)  # eager runs the same operations in the same order
