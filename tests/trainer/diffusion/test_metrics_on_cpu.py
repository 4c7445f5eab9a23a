"""Step metrics from the layer table and the phase timer, checked by hand."""

import numpy as np
import pytest
import torch

from verl_omni.trainer.diffusion import AdvantageConfig, compute_layer_advantages
from verl_omni.trainer.diffusion.metrics import PhaseTimer, advantage_metrics, reward_metrics, validation_metrics


def _scores():
    # Columns visual, nav_1..4, stop_1..4. Row 0: nav 1+2+3+4 = 10, stop -1; row 1: nav 0, stop 0 + 2 = 2.
    return np.array(
        [
            [0.5, 1, 2, 3, 4, -1, 0, 0, 0],
            [1.5, 0, 0, 0, 0, 0, 0, 0, 2],
        ],
        dtype=np.float64,
    )


def test_reward_metrics_by_hand():
    diag = {"term": np.array([1.0, np.nan]), "empty": np.array([]), "dead": np.array([np.inf, np.nan])}
    m = reward_metrics(_scores(), diag)
    assert m["reward/nav_total/mean"] == 5.0 and m["reward/stop_total/mean"] == 0.5
    assert m["reward/visual/mean"] == 1.0 and m["reward/visual/std"] == 0.5
    assert m["reward/nav_1/mean"] == 0.5 and m["reward/stop_4/mean"] == 1.0
    assert m["reward_terms/term"] == 1.0 and "reward_terms/empty" not in m and "reward_terms/dead" not in m


def test_validation_metrics_group_by_event():
    m = validation_metrics(_scores(), [["turn"], ["turn", "stop"]])
    assert m["val/all/nav_total"] == 5.0 and m["val/all/count"] == 2.0 and m["val/all/visual"] == 1.0
    assert m["val/stop/nav_total"] == 0.0 and m["val/stop/stop_total"] == 2.0 and m["val/stop/count"] == 1.0
    assert m["val/turn/count"] == 2.0


def test_advantage_metrics_add_per_layer_std():
    strata = [s for s in range(4) for _ in range(4)]
    rewards = torch.zeros(16, 9, dtype=torch.float64)
    rewards[:, 0] = torch.arange(16, dtype=torch.float64)
    res = compute_layer_advantages(rewards, ["p"] * 16, strata, AdvantageConfig())
    m = advantage_metrics(res)
    assert m["advantages/std/nav_1"] == 0.0
    assert m["advantages/std/visual"] == pytest.approx(float(res.advantages[:, 0].std()))
    assert m["advantages/zero_signal_prompts"] == 0.0


def test_phase_timer_records_also_when_the_block_raises():
    timer = PhaseTimer()
    with timer.phase("a") as lap:
        pass
    with pytest.raises(KeyError), timer.phase("b"):
        raise KeyError("x")
    assert timer.timings["a"] == [lap.seconds] and len(timer.timings["b"]) == 1
    table = timer.table(("b", "a", "never"))
    assert table.splitlines()[3].startswith("b ") and table.splitlines()[4].startswith("a ") and "never" not in table
