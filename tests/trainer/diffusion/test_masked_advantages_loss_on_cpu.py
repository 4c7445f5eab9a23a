"""Dead layers (chunks after a STOP or collision) leave advantages and loss: hand-computed tables."""

import math

import pytest
import torch

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.trainer.diffusion import AdvantageConfig, LossConfig, clipped_layer_loss, compute_layer_advantages
from verl_omni.trainer.diffusion.advantages import with_loss_mask

STRATA = [s for s in range(4) for _ in range(4)]
NAV_3 = LAYER_NAMES.index("nav_3")
EPS = 1e-4

# One prompt, 16 rollouts in 4 strata of 4. nav_3 rewards, None = dead (the rollout had stopped before chunk 3):
#   stratum 0: 1, 2, 3, dead   stratum 1: dead, dead, 4, 0   stratum 2: all dead   stratum 3: 2, 2, 2, 2
NAV_3_TABLE = [1, 2, 3, None, None, None, 4, 0, None, None, None, None, 2, 2, 2, 2]
# Live values 1 2 3 4 0 2 2 2 2: mean 18 / 9 = 2, squared deviations 1 0 1 4 4 0 0 0 0 = 10, population std
# sqrt(10 / 9). Stratum means over live entries: s0 (1 + 2 + 3) / 3 = 2, s1 (4 + 0) / 2 = 2, s3 2 (s2: none).
STD = math.sqrt(10 / 9)
EXPECTED_STRATUM = [-1 / STD, 0, 1 / STD, 0, 0, 0, 2 / STD, -2 / STD, 0, 0, 0, 0, 0, 0, 0, 0]


def _inputs():
    rewards = torch.zeros(16, 9, dtype=torch.float64)
    valid = torch.ones(16, 9, dtype=torch.bool)
    for i, v in enumerate(NAV_3_TABLE):
        if v is None:
            valid[i, NAV_3] = False  # its reward is 0, as the reward set writes for a dead layer
        else:
            rewards[i, NAV_3] = float(v)
    return rewards, valid


def test_stratum_baseline_and_prompt_std_over_live_entries_only():
    rewards, valid = _inputs()
    res = compute_layer_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig(), valid=valid)
    expected = torch.tensor([a * STD / (STD + EPS) for a in EXPECTED_STRATUM], dtype=torch.float64)
    torch.testing.assert_close(res.advantages[:, NAV_3].double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(res.loss_mask, valid)
    assert float(res.std[0, NAV_3]) == pytest.approx(STD)
    # Dead entries get exactly 0; every other layer is constant (0) and carries no signal.
    assert torch.all(res.advantages[~valid] == 0)
    assert bool(res.constant_layers[0, NAV_3]) is False and bool(res.constant_layers[0, 0]) is True
    assert res.metrics()["advantages/live_fraction/nav_3"] == pytest.approx(9 / 16)


def test_counting_dead_chunks_as_zero_rewards_would_credit_them():
    # Without the mask the 7 dead entries enter as rewards of 0: mean 18 / 16 = 1.125, and the stratum-2 rollouts,
    # which never reached chunk 3, get no advantage only because their whole stratum is dead; the dead entry of
    # stratum 0 is pulled below its live siblings' mean (1.5) and gets A = -1.5 / std: a chunk that never happened
    # is punished (and the stratum-1 dead pair rewarded or punished) for nothing it did.
    rewards, valid = _inputs()
    res = compute_layer_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig())
    sq = sum((v - 1.125) ** 2 for v in [1, 2, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 2, 2, 2, 2])
    std0 = math.sqrt(sq / 16)
    assert float(res.advantages[3, NAV_3]) == pytest.approx((0 - 1.5) / (std0 + EPS), rel=1e-6)
    masked = compute_layer_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig(), valid=valid)
    assert float(masked.advantages[3, NAV_3]) == 0.0


def test_prompt_baseline_over_live_entries():
    rewards, valid = _inputs()
    res = compute_layer_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig(baseline="prompt"), valid=valid)
    expected = [0.0 if v is None else (v - 2.0) / (STD + EPS) for v in NAV_3_TABLE]
    torch.testing.assert_close(
        res.advantages[:, NAV_3].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )


def test_a_layer_dead_in_a_whole_prompt_is_constant_and_the_prompt_may_carry_no_signal():
    rewards = torch.zeros(16, 9, dtype=torch.float64)
    rewards[:, NAV_3] = torch.arange(16, dtype=torch.float64)  # would be signal, but every entry is dead
    valid = torch.ones(16, 9, dtype=torch.bool)
    valid[:, NAV_3] = False
    res = compute_layer_advantages(rewards, ["p"] * 16, STRATA, AdvantageConfig(), valid=valid)
    assert torch.all(res.advantages == 0) and bool(res.zero_signal_prompts[0])


def test_summed_ablation_keeps_all_rollouts_in_the_statistics_and_masks_the_loss():
    rewards, valid = _inputs()
    total = rewards.sum(dim=1, keepdim=True).expand(-1, 9).contiguous()
    plain = compute_layer_advantages(total, ["p"] * 16, STRATA, AdvantageConfig())
    res = with_loss_mask(plain, valid)
    torch.testing.assert_close(res.advantages[valid], plain.advantages[valid])
    assert torch.all(res.advantages[~valid] == 0) and torch.equal(res.loss_mask, valid)
    torch.testing.assert_close(res.std, plain.std)


def test_masked_loss_by_hand():
    # Two rollouts, one window step, ratio 1 everywhere: the surrogate is -A per live entry, summed and divided by
    # N W = 2 (not by the live count). nav_1: A = 1 (live) and 3 (dead) -> -1 / 2; visual: both live -> -(2 + 4) / 2.
    logp = torch.zeros(2, 1, 9, requires_grad=True)
    old = torch.zeros(2, 1, 9)
    adv = torch.zeros(2, 9)
    adv[:, 0] = torch.tensor([2.0, 4.0])
    adv[:, 1] = torch.tensor([1.0, 3.0])
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 1:] = False  # rollout 1 stopped at step 0: every action layer of it is dead
    out = clipped_layer_loss(logp, old, adv, LossConfig(), loss_mask=mask)
    assert float(out.layer_loss[0]) == pytest.approx(-3.0)
    assert float(out.layer_loss[1]) == pytest.approx(-0.5)
    assert float(out.policy_loss.detach()) == pytest.approx((-3.0 - 0.5) / 9)
    out.loss.backward()
    # d loss / d logp = -A / (N W sum_w) for live entries, exactly 0 for dead ones whatever their advantage.
    assert float(logp.grad[1, 0, 1]) == 0.0
    assert float(logp.grad[0, 0, 1]) == pytest.approx(-1.0 / 2 / 9)
    assert out.metrics["actor/live_fraction"] == pytest.approx(10 / 18)


def test_masked_loss_is_invariant_to_micro_batching_and_ignores_dead_ratios():
    torch.manual_seed(0)
    n, w = 6, 2
    logp_old = torch.randn(n, w, 9) * 0.1
    logp = logp_old + torch.randn(n, w, 9) * 0.01
    logp[4, :, 2] = logp_old[4, :, 2] + 3.0  # a dead entry with a wild ratio: must not show in loss or metrics
    adv = torch.randn(n, 9)
    mask = torch.rand(n, 9) > 0.3
    mask[4, 2] = False
    cfg = LossConfig(clip_eps=0.2)
    full = clipped_layer_loss(logp, logp_old, adv, cfg, loss_mask=mask)
    parts = [slice(0, 2), slice(2, 6)]
    summed = sum(
        clipped_layer_loss(logp[s], logp_old[s], adv[s], cfg, loss_mask=mask[s]).loss * ((s.stop - s.start) / n)
        for s in parts
    )
    assert float(summed) == pytest.approx(float(full.loss), rel=1e-6, abs=1e-7)
    assert full.metrics["actor/ratio_max/nav_2"] < math.exp(1.0)
    # Zero advantages on the dead entries give the same loss: the mask changes only what a zero could not.
    zeroed = clipped_layer_loss(logp, logp_old, torch.where(mask, adv, 0.0), cfg)
    assert float(zeroed.loss) == pytest.approx(float(full.loss), rel=1e-6)


def test_masked_kl_by_hand():
    logp = torch.zeros(2, 1, 9)
    ref = torch.zeros(2, 1, 9)
    ref[1] = 1.0  # d = 1 on rollout 1: k3 = e - 2; rollout 1's action layers are dead
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 1:] = False
    out = clipped_layer_loss(
        logp, logp.clone(), torch.zeros(2, 9), LossConfig(kl_beta=0.5), logp_ref=ref, loss_mask=mask
    )
    # Only visual of rollout 1 is live with d = 1: layer_kl visual = (e - 2) / 2, others 0; mean over 9 weights.
    assert float(out.kl) == pytest.approx((math.e - 2) / 2 / 9, rel=1e-6)


def test_bad_mask_shape_is_refused():
    with pytest.raises(ValueError, match="loss_mask"):
        clipped_layer_loss(
            torch.zeros(2, 1, 9), torch.zeros(2, 1, 9), torch.zeros(2, 9), LossConfig(), loss_mask=torch.ones(3, 9)
        )
