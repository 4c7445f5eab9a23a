"""Auxiliary goal-direction target and head (verl_omni/models/wnm/goal_probe.py) and its use in SFT."""

import math

import numpy as np
import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMModel, sft
from verl_omni.models.wnm.goal_probe import (
    DISTANCE_SCALE_M,
    GoalProbe,
    ObjectViewProbe,
    bearing_error_deg,
    goal_polar,
    object_view_target,
)


def test_goal_polar_by_hand():
    # Goal up and to the right of a robot facing +x: 45 degrees left, sqrt(2) m away.
    got = goal_polar(np.array([0.0, 0.0, 0.0]), np.array([1.0, 1.0]))
    np.testing.assert_allclose(got, [math.sqrt(0.5), math.sqrt(0.5), math.sqrt(2) / DISTANCE_SCALE_M], rtol=1e-6)
    # Robot at (1, 1) facing +y, goal 2 m straight ahead: bearing 0.
    got = goal_polar(np.array([1.0, 1.0, math.pi / 2]), np.array([1.0, 3.0]))
    np.testing.assert_allclose(got, [1.0, 0.0, 2.0 / DISTANCE_SCALE_M], atol=1e-6)
    # Goal behind a robot facing -x... is straight ahead of it.
    got = goal_polar(np.array([0.0, 0.0, math.pi]), np.array([-4.0, 0.0]))
    np.testing.assert_allclose(got, [1.0, 0.0, 1.0], atol=1e-6)


def _examples(n_goals: int = 3, repeats: int = 4):
    cfg = WNMConfig.from_size("tiny", num_layers=1)
    rng = np.random.default_rng(0)
    history = rng.integers(0, 255, (cfg.history_frames, *cfg.image_size, 3), dtype=np.uint8)
    target = rng.integers(0, 255, (cfg.target_frames, *cfg.image_size, 3), dtype=np.uint8)
    out = []
    for k in range(repeats):
        for j in range(n_goals):
            bearing = -1.0 + j  # one goal direction per instruction
            polar = np.array([math.cos(bearing), math.sin(bearing), 0.5], np.float32)
            out.append(sft.ExpertExample(f"e{k}_{j}", history, target, np.zeros((32, 4)), (f"goal number {j}",),
                                         polar))  # fmt: skip
    return cfg, out


def test_probe_needs_a_forward_and_trains_the_dit():
    cfg, examples = _examples(repeats=1)
    torch.manual_seed(0)
    model = WNMModel(cfg)
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True, fit_normalization=True)
    probe = GoalProbe(cfg.dim)
    with pytest.raises(RuntimeError, match="no transformer forward"):
        probe.loss(rows.goal_polar)
    hist, feats = rows.features(torch.arange(rows.rows))
    ctx = model.context_from_features(hist, feats)
    b = rows.rows
    with probe.attached(model.transformer):
        model.transformer(rows.target_latents, rows.actions, torch.full((b,), 0.5), ctx)
        loss = probe.loss(rows.goal_polar)
    loss.backward()
    # The loss reaches the DiT's blocks (through the action tokens' hidden state), not only the head.
    assert model.transformer.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0
    assert not model.transformer.action_norm_out._forward_pre_hooks  # detached on exit


def test_sft_with_goal_loss_learns_it_and_weight_zero_changes_nothing():
    cfg, examples = _examples()
    torch.manual_seed(0)
    model = WNMModel(cfg)
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True, fit_normalization=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def run(weight, polar):
        model.load_state_dict(state)
        data = sft.EncodedRows(**{**rows.__dict__, "goal_polar": polar})
        c = sft.SFTConfig(steps=40, batch_size=6, lr=1e-3, eval_every=40, eval_rows=6, goal_aux_weight=weight)
        return sft.train_sft(model, data, data, c, progress=False)

    plain = run(0.0, None)
    zero = run(0.0, rows.goal_polar)
    assert zero["train_losses"] == plain["train_losses"] and zero["goal_aux_losses"] == []  # off = unchanged
    with_aux = run(1.0, rows.goal_polar)
    aux = with_aux["goal_aux_losses"]
    assert len(aux) == 40 and np.mean(aux[-5:]) < 0.5 * np.mean(aux[:5])  # it learns the instruction -> direction
    # The held-out grounding report: own and swapped bearing errors, their gap, and the constant answer.
    gd = with_aux["goal_direction"]
    assert plain["goal_direction"] is None
    assert gd["gap"] == pytest.approx(gd["bearing_error_deg_swapped"] - gd["bearing_error_deg"])
    # Bearings -1, 0, +1 rad in equal shares: their mean direction is 0, so the constant answer is off by
    # (1 + 0 + 1) / 3 rad on average.
    assert gd["constant"] == pytest.approx(math.degrees(2 / 3), abs=1e-3)
    with pytest.raises(ValueError, match="goal_aux_weight > 0 needs goal targets"):
        run(1.0, None)
    with pytest.raises(ValueError, match="goal_aux_weight"):
        sft.SFTConfig(goal_aux_weight=-1.0)


def test_bearing_error_by_hand():
    def unit(deg):
        return [math.cos(math.radians(deg)), math.sin(math.radians(deg)), 0.3]

    pred = torch.tensor([unit(0), unit(170), [2.0, 0.0, 0.0], unit(-45)])
    target = torch.tensor([unit(90), unit(-170), unit(30), unit(-45)])
    # 90 degrees; 20 across the +-180 seam (not 340); the length of the prediction does not matter; 0.
    torch.testing.assert_close(bearing_error_deg(pred, target), torch.tensor([90.0, 20.0, 30.0, 0.0]), atol=1e-4,
                               rtol=0)  # fmt: skip


def test_probe_loss_on_selected_rows():
    torch.manual_seed(0)
    probe = GoalProbe(8)
    probe._hidden = torch.randn(4, 5, 8)  # what a forward would have recorded: [B, 32 action tokens, D]
    target = torch.randn(4, 3)
    pred = probe.predict().detach()
    rows = torch.tensor([True, False, True, False])
    expected = torch.nn.functional.mse_loss(pred[rows], target[rows])
    torch.testing.assert_close(probe.loss(target, rows), expected)
    none = probe.loss(target, torch.zeros(4, dtype=torch.bool))
    assert none.item() == 0.0 and none.requires_grad


def test_goal_head_rows_at_pure_noise():
    cfg, examples = _examples(repeats=1)
    torch.manual_seed(0)
    model = WNMModel(cfg)
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True, fit_normalization=True)
    seen = []
    real = sft.joint_flow_matching_loss

    def spy(*args, **kwargs):
        seen.append((args[4].clone(), args[8] if len(args) > 8 else kwargs.get("action_sigma")))
        return real(*args, **kwargs)

    c = sft.SFTConfig(steps=3, batch_size=3, eval_every=3, eval_rows=3, goal_aux_weight=1.0, goal_aux_pure_noise=1.0,
                      independent_action_noise=1.0)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sft, "joint_flow_matching_loss", spy)
        sft.train_sft(model, rows, rows, c, progress=False)
    training = [(s, sa) for s, sa in seen if sa is not None]  # evaluation calls pass no action level
    assert len(training) == 3
    for s, sa in training:  # every row is a goal-head row: video and actions both at sigma = 1
        assert torch.equal(s, torch.ones(3)) and torch.equal(sa, torch.ones(3))
    with pytest.raises(ValueError, match="goal_aux_pure_noise"):
        sft.SFTConfig(goal_aux_pure_noise=-0.1)


def test_object_view_target_by_hand():
    np.testing.assert_allclose(object_view_target(math.nan, math.nan), [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(object_view_target(math.pi / 6, 2.0), [1.0, math.sqrt(3) / 2, 0.5, 2.0 / 4.0], rtol=1e-6)


def test_object_view_loss_by_hand():
    probe = ObjectViewProbe(4)
    pred = torch.tensor([[0.0, 1.0, 0.0, 0.9], [2.0, 0.0, 1.0, 0.5]])
    probe.predict = lambda: pred  # what the head said; the loss is checked by hand below
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.6, 0.8, 0.2]])
    # BCE: row 0 logit 0 vs 0 -> ln 2; row 1 logit 2 vs 1 -> ln(1 + e^-2); mean of the two. Bearing and distance
    # terms only on the visible row 1: (0 - 0.6)^2 + (1 - 0.8)^2 + (0.5 - 0.2)^2 = 0.49, over one visible row.
    bce = (math.log(2.0) + math.log1p(math.exp(-2.0))) / 2
    assert probe.loss(target).item() == pytest.approx(bce + 0.49, rel=1e-6)


def test_sft_with_view_loss_learns_the_named_object():
    cfg, examples = _examples()
    # Instruction j names an object that is out of view (j = 0) or drawn at -0.4 / +0.4 rad (j = 1, 2).
    views = {0: math.nan, 1: -0.4, 2: 0.4}
    for e in examples:
        e.goal_view = object_view_target(views[int(e.instructions[0].split()[-1])], 1.0)
    torch.manual_seed(0)
    model = WNMModel(cfg)
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True, fit_normalization=True)
    assert rows.goal_view.shape == (12, 4)
    c = sft.SFTConfig(steps=60, batch_size=6, lr=1e-3, eval_every=60, eval_rows=6, view_aux_weight=1.0,
                      train_encoders=("text_encoder",))  # fmt: skip
    res = sft.train_sft(model, rows, rows, c, progress=False)
    aux = res["view_aux_losses"]
    assert len(aux) == 60 and np.mean(aux[-5:]) < 0.5 * np.mean(aux[:5])
    ov = res["object_view"]
    # Two of the three instructions name a visible object: always answering "in view" is right in 2/3.
    assert ov["base_rate"] == pytest.approx(2 / 3)
    assert ov["gap"] == pytest.approx(ov["visible_accuracy"] - ov["visible_accuracy_swapped"])
    assert ov["visible_accuracy"] == 1.0  # the instruction alone tells the answer, and it was learned
    assert res["object_view_pure_noise"] is not None and res["goal_direction"] is None
    no_view = sft.EncodedRows(**{**rows.__dict__, "goal_view": None})
    with pytest.raises(ValueError, match="goal_object_bearing"):
        sft.train_sft(model, no_view, no_view, c, progress=False)
    with pytest.raises(ValueError, match="view_aux_weight"):
        sft.SFTConfig(view_aux_weight=-1.0)
