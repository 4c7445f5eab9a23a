"""Layer-conditioned advantages on hand-built reward tables, checked against hand arithmetic."""

import math

import pytest
import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, LayerLayoutError
from verl_omni.trainer.diffusion import (
    AdvantageConfig,
    compute_layer_advantages,
    estimate_advantages,
    summed_layer_rewards,
)

STRATA = [s for s in range(4) for _ in range(4)]


def table(columns: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    """Full reward mapping: given columns, every other layer constant 0."""
    return {n: torch.tensor(columns.get(n, [0.0] * 16), dtype=torch.float64) for n in LAYER_NAMES}


def test_stratum_baseline_prompt_std_by_hand():
    visual = [float(i) for i in range(16)]
    nav_2 = [1, 1, 1, 1, 0, 2, 0, 2, 3, 3, 3, 3, 5, 5, 5, 9]
    res = compute_layer_advantages(table({"visual": visual, "nav_2": nav_2}), ["p"] * 16, STRATA, AdvantageConfig())
    # visual: stratum means 4s + 1.5; population std of 0..15 = sqrt((16^2 - 1) / 12)
    std_v = math.sqrt(255 / 12)
    exp_v = [(i - (4 * (i // 4) + 1.5)) / (std_v + 1e-4) for i in range(16)]
    torch.testing.assert_close(
        res.advantages[:, 0].double(), torch.tensor(exp_v, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    # nav_2: mean 44/16 = 2.75; sum of squares 4 + 8 + 36 + 75 + 81 = 204 -> var 204/16 - 2.75^2 = 5.1875
    std_n = math.sqrt(204 / 16 - 2.75**2)
    base = [1] * 4 + [1] * 4 + [3] * 4 + [6] * 4
    exp_n = [(r - b) / (std_n + 1e-4) for r, b in zip(nav_2, base)]
    torch.testing.assert_close(
        res.advantages[:, 2].double(), torch.tensor(exp_n, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    assert res.advantages[:4, 2].abs().max() == 0  # stratum 0 all equal -> no credit
    # every other layer is constant: zero advantages and reported
    assert res.advantages[:, [1, 3, 4, 5, 6, 7, 8]].abs().max() == 0
    assert res.constant_layers.tolist() == [[False, True, False, True, True, True, True, True, True]]
    assert res.zero_signal_prompts.tolist() == [False]
    m = res.metrics()
    assert m["advantages/constant_groups/nav_1"] == 1.0 and m["advantages/constant_groups/visual"] == 0.0


def test_prompt_baseline_clip_and_zero_signal_prompt():
    stop_1 = [0.0] * 16
    stop_1[5] = 1.0
    rewards = {
        n: torch.cat([table({"stop_1": stop_1})[n], torch.full((16,), 7.0, dtype=torch.float64)]) for n in LAYER_NAMES
    }
    keys = ["p"] * 16 + ["q"] * 16
    cfg = AdvantageConfig(baseline="prompt", a_max=2.0)
    res = compute_layer_advantages(rewards, keys, STRATA * 2, cfg)
    std = math.sqrt(15) / 16  # Bernoulli(1/16) population std
    hi = (1 - 1 / 16) / (std + 1e-4)  # 3.87 -> clipped to 2
    lo = (0 - 1 / 16) / (std + 1e-4)
    col = res.advantages[:, LAYER_NAMES.index("stop_1")].double()
    assert hi > 2 and col[5] == 2.0
    torch.testing.assert_close(col[0], torch.tensor(lo, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert res.zero_signal_prompts.tolist() == [False, True]
    assert res.advantages[16:].abs().max() == 0
    assert res.clipped_fraction == pytest.approx(1 / (32 * 9))


def test_global_std():
    a = [float(i % 4) for i in range(16)]  # per stratum 0,1,2,3
    b = [2.0 * float(i % 4) for i in range(16)]
    rewards = {n: torch.zeros(32, dtype=torch.float64) for n in LAYER_NAMES}
    rewards["visual"] = torch.tensor(a + b, dtype=torch.float64)
    res = compute_layer_advantages(rewards, ["p"] * 16 + ["q"] * 16, STRATA * 2, AdvantageConfig(std="global"))
    allv = torch.tensor(a + b, dtype=torch.float64)
    g_std = math.sqrt(float(((allv - allv.mean()) ** 2).mean()))  # population std over the whole batch
    # prompt q, rollout 3: reward 6, stratum mean (0 + 2 + 4 + 6) / 4 = 3
    assert float(res.advantages[19, 0]) == pytest.approx(3 / (g_std + 1e-4), rel=1e-6)
    assert float(res.advantages[3, 0]) == pytest.approx(1.5 / (g_std + 1e-4), rel=1e-6)


def test_bad_tables_are_refused():
    with pytest.raises(LayerLayoutError):
        compute_layer_advantages({"visual": torch.zeros(16)}, ["p"] * 16, STRATA, AdvantageConfig())
    bad = table({})
    bad["nav_3"][4] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite rewards in rollout rows \[4\]"):
        compute_layer_advantages(bad, ["p"] * 16, STRATA, AdvantageConfig())
    with pytest.raises(ValueError, match="has 15 rollouts"):
        compute_layer_advantages(torch.zeros(15, 9), ["p"] * 15, STRATA[:15], AdvantageConfig())
    with pytest.raises(ValueError, match="stratum 0 has 5"):
        compute_layer_advantages(torch.zeros(16, 9), ["p"] * 16, [0] * 5 + STRATA[5:], AdvantageConfig())
    with pytest.raises(ValueError, match="AdvantageConfig.baseline"):
        AdvantageConfig(baseline="batch")
    with pytest.raises(ValueError, match="AdvantageConfig.eps"):
        AdvantageConfig(eps=0)


def test_summed_layer_rewards_by_hand():
    # Row [1, 2, 0, ...]: visual weight 3, the other eight weigh 1 -> (3 x 1 + 1 x 2) / (3 + 8) = 5 / 11.
    rewards = torch.zeros(2, 9, dtype=torch.float64)
    rewards[0, 0], rewards[0, 1] = 1.0, 2.0
    rewards[1, 8] = 11.0  # stop_4 only: 11 / 11 = 1
    total = summed_layer_rewards(rewards, {"visual": 3.0})
    torch.testing.assert_close(total, torch.tensor([[5 / 11] * 9, [1.0] * 9], dtype=torch.float64))
    with pytest.raises(ValueError, match="not all 0"):
        summed_layer_rewards(rewards, dict.fromkeys(LAYER_NAMES, 0.0))


def test_estimate_advantages_summed_ablation_by_hand():
    # visual = i, nav_1 = 1 for rollout i = 0..15, all weights 1: T[i] = (i + 1) / 9. Prompt std of T is
    # std(0..15) / 9 = sqrt((16^2 - 1) / 12) / 9; a stratum holds 4 consecutive i, so T - baseline is
    # (-1.5, -0.5, 0.5, 1.5) / 9 and A = (-1.5, -0.5, 0.5, 1.5) / sqrt(255 / 12) on every layer.
    rewards = table({"visual": [float(i) for i in range(16)], "nav_1": [1.0] * 16})
    valid = torch.ones(16, 9, dtype=torch.bool)
    valid[0, 8] = False  # stop_4 of rollout 0 is dead: A = 0 there and out of the loss, statistics unchanged
    cfg = AdvantageConfig(eps=1e-12, layer_conditioned=False)
    res = estimate_advantages(rewards, ["p"] * 16, STRATA, cfg, valid=valid)
    offsets = [-1.5, -0.5, 0.5, 1.5] * 4
    expected = torch.tensor([[o / math.sqrt(255 / 12)] * 9 for o in offsets], dtype=torch.float32)
    expected[0, 8] = 0.0
    torch.testing.assert_close(res.advantages, expected)
    assert torch.equal(res.loss_mask, valid)
    torch.testing.assert_close(res.std[0], torch.full((9,), math.sqrt(255 / 12) / 9, dtype=torch.float64))
    # Layer-conditioned, the same table gives visual its own advantages and nav_1 (constant) zero.
    res = estimate_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig(eps=1e-12), valid=valid)
    torch.testing.assert_close(res.advantages[:4, 0], torch.tensor(offsets[:4]) / math.sqrt(255 / 12))
    assert torch.all(res.advantages[:, 1] == 0)
