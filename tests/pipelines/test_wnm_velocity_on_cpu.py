"""Queued finiteness checks (``FiniteChecks``): the first failing check, in the order added, is the one named."""

from __future__ import annotations

import pytest
import torch

from verl_omni.pipelines.wnm_shared.velocity import FiniteChecks, NonFiniteError, check_finite


def test_no_failure_raises_nothing_and_empties_the_queue():
    checks = FiniteChecks(["a", "b"])
    checks.raise_first()  # nothing queued
    checks.add(torch.zeros(2, 3), "velocity", 0)
    checks.add(torch.ones(2, 4, 5), "latents", 0)
    checks.raise_first()
    checks.add(torch.full((2, 1), float("nan")), "latents", 1)
    with pytest.raises(NonFiniteError):
        checks.raise_first()
    checks.raise_first()  # the failing flags were read and dropped with the rest


def test_the_earliest_failing_check_is_reported_with_its_rows_and_step():
    ids = ["r0", "r1", "r2"]
    fine = torch.zeros(3, 4)
    step1 = torch.zeros(3, 4)
    step1[2, 1] = float("inf")  # row 2 fails at step 1 ...
    step2 = torch.zeros(3, 4)
    step2[:, 0] = float("nan")  # ... and every row at step 2
    checks = FiniteChecks(ids)
    for step, t in enumerate((fine, step1, step2)):
        checks.add(fine, "velocity", step)
        checks.add(t, "latents", step)
    with pytest.raises(NonFiniteError) as err:
        checks.raise_first()
    assert (err.value.what, err.value.request_ids, err.value.denoising_step) == ("latents", ["r2"], 1)
    # The immediate check names the same failure.
    with pytest.raises(NonFiniteError) as now:
        check_finite(step1, "latents", ids, 1)
    assert str(now.value) == str(err.value)


def test_log_probs_without_a_step():
    checks = FiniteChecks(["x", "y"])
    checks.add(torch.tensor([[0.0, float("nan")], [1.0, 2.0]]), "log-probs", None)
    with pytest.raises(NonFiniteError, match=r"non-finite log-probs in request\(s\) x \(1 affected\)"):
        checks.raise_first()
