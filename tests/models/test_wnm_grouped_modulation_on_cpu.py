"""The grouped modulation and gating in their compiled form (``block._per_token``) against the split/concatenate
form that eager autograd runs: the same per-element arithmetic, so the same bits in fp32."""

from __future__ import annotations

import pytest
import torch

from verl_omni.models.wnm import block as wnm_block


def test_per_token_gives_each_token_its_groups_row():
    table = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)  # [B=2, G=3, D=2]
    rows = wnm_block._per_token(table, [2, 1, 3], 6)
    assert rows.shape == (2, 6, 2)
    # Tokens 0-1 -> group 0, token 2 -> group 1, tokens 3-5 -> group 2, for each sample.
    for b in range(2):
        for s, g in enumerate([0, 0, 1, 2, 2, 2]):
            assert torch.equal(rows[b, s], table[b, g])


@pytest.mark.parametrize("lengths", [[5, 7], [3, 4, 5], [12]])
def test_compiled_form_has_the_split_forms_bits(lengths, monkeypatch):
    torch.manual_seed(0)
    b, d, g = 2, 8, len(lengths)
    x, y = torch.randn(b, sum(lengths), d), torch.randn(b, sum(lengths), d)
    scale, shift, gate = torch.randn(b, g, d), torch.randn(b, g, d), torch.randn(b, g, d)
    split_mod = wnm_block._modulate(x, scale, shift, lengths, torch.float32)  # grad is on: the split form
    split_gate = wnm_block._gate(x, y, gate, lengths, torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(wnm_block._modulate(x, scale, shift, lengths, torch.float32), split_mod)
    assert torch.equal(wnm_block._gate(x, y, gate, lengths, torch.float32), split_gate)
