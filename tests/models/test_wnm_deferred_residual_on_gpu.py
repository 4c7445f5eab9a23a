"""Compiled, the deferred feed-forward residual fuses into the next block's first LayerNorm (inductor may then keep
the sum unrounded before the norm), so on the GPU the outputs are compared within bf16 rounding, not bit for bit."""

from __future__ import annotations

import pytest
import torch
from wnm_inputs import cuda_bf16_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm import transformer as transformer_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("compiled", [False, True])
@torch.no_grad()
def test_deferred_residual_stays_within_bf16_rounding_of_the_in_block_add(compiled, monkeypatch):
    torch.manual_seed(0)
    model = WNMTransformer(WNMConfig.from_size("tiny", num_layers=3)).cuda().to(torch.bfloat16).eval()
    if compiled:
        model.compile_blocks()
    inputs = cuda_bf16_dit_inputs(model.config, b=3)
    deferred = model(*inputs)
    monkeypatch.setattr(transformer_module, "DEFER_FFN_RESIDUAL", False)
    added = model(*inputs)
    for d, a in zip(deferred, added, strict=True):
        assert torch.isfinite(d).all()
        if compiled:
            assert _rel(d, a) < 2e-2  # bf16 rounding only
        else:
            assert torch.equal(d, a)  # eager runs the same operations in the same order
