"""Instruction variants name the goal object and room and never repeat within an episode."""

import numpy as np
import pytest

from verl_omni.sim.instructions import TEMPLATES, make_instructions


def test_variants_are_distinct_and_name_the_goal():
    out = make_instructions("kitchen", "blue table", 3, np.random.default_rng(0))
    assert len(out) == 3 and len(set(out)) == 3
    assert all("kitchen" in s and "blue table" in s for s in out)
    assert make_instructions("kitchen", "blue table", 3, np.random.default_rng(0)) == out
    every = make_instructions("hallway", "red plant", len(TEMPLATES), np.random.default_rng(1))
    assert sorted(every) == sorted(t.format(room="hallway", obj="red plant") for t in TEMPLATES)


def test_bad_count():
    with pytest.raises(ValueError, match="count"):
        make_instructions("kitchen", "blue table", 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="count"):
        make_instructions("kitchen", "blue table", len(TEMPLATES) + 1, np.random.default_rng(0))
