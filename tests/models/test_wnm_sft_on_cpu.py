"""Flow-matching SFT pieces and the make_tiny_wnm_checkpoint CLI on a minimal hand-written GN0 collection."""

import dataclasses
import json
import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_omni.data.video import write_video
from verl_omni.models.wnm import WNMConfig, WNMModel, load_wnm_checkpoint, read_checkpoint_contract, sft
from verl_omni.models.wnm.flow_matching import interpolate, velocity_target
from verl_omni.models.wnm.sft_resume import SFTResume

torch.set_num_threads(1)
TOOL = Path(__file__).resolve().parents[2] / "tools" / "checkpoint" / "make_tiny_wnm_checkpoint.py"


def _write_collection(root: Path, episodes: int = 2) -> Path:
    """Episodes of 6 frames; one query at t = 5 whose expert drives straight ahead (+x) 0.1 m per step."""
    rng = np.random.default_rng(0)
    (root / "episodes").mkdir(parents=True)
    (root / "collection.json").write_text(
        json.dumps(
            {
                "format": "gn0-dagger/1",
                "fps": 4,
                "image_size": [64, 64],
                "policy": {},
                "history_frames": 33,
                "target_frames": 33,
            }
        )
    )
    for e in range(episodes):
        ep = root / "episodes" / f"s0000_e{e:03d}"
        ep.mkdir()
        write_video(ep / "rgb.mp4", rng.integers(0, 256, (6, 64, 64, 3), dtype=np.uint8), 4)
        write_video(ep / "ref_5.mp4", rng.integers(0, 256, (33, 64, 64, 3), dtype=np.uint8), 4)
        ref = [[0.1 * min(k, 28), 0.0, 0.0] for k in range(33)]  # stops moving after step 28
        stop = [0] * 28 + [1] * 4
        record = {
            "episode_id": ep.name,
            "scene_id": "s0000",
            "instructions": ["go ahead", "drive forward"],
            "goal": [2.8, 0.0],
            "success_radius": 0.5,
            "video": "rgb.mp4",
            "poses": [[0.0, 0.0, 0.0]] * 6,
            "queries": [
                {
                    "t": 5,
                    "reference_poses": ref,
                    "reference_stop": stop,
                    "reference_video": "ref_5.mp4",
                    "events": ["required_stop"],
                }
            ],
        }
        (ep / "episode.json").write_text(json.dumps(record))
    return root


def test_flow_matching_by_hand():
    x0, eps = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.0, 3.0]])
    torch.testing.assert_close(interpolate(x0, eps, torch.tensor([0.25])), torch.tensor([[1.5, 0.0]]))
    torch.testing.assert_close(velocity_target(x0, eps), torch.tensor([[-2.0, 4.0]]))


def test_history_indices_clamp_at_zero():
    assert sft.history_indices(5, 33) == [0] * 28 + [1, 2, 3, 4, 5]
    assert sft.history_indices(40, 33) == list(range(8, 41))


def test_load_examples_actions_and_split(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=3)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    assert len(examples) == 3
    ex = examples[0]
    assert ex.history.shape == (33, 64, 64, 3) and ex.target.shape == (33, 64, 64, 3)
    expected = np.zeros((32, 4))
    expected[:28, 0] = 0.1
    expected[28:, 3] = 1.0
    np.testing.assert_allclose(ex.actions, expected, atol=1e-12)
    train, held = sft.split_by_episode(examples, 0.34, seed=0)
    assert len(held) == 1 and len(train) == 2
    assert not {e.episode_id for e in train} & {e.episode_id for e in held}
    with pytest.raises(ValueError, match=r"image_size.*\[32, 32\]"):
        sft.load_expert_examples(root, 33, (32, 32), progress=False)


def test_encode_calibrates_latents_and_training_reduces_loss(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=2)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1), sft.fit_action_normalization(examples))
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True)
    assert rows.rows == 4 and rows.text.shape[0] == 4  # 2 examples x 2 instruction variants
    z = rows.target_latents.transpose(0, 1).flatten(1).double()
    torch.testing.assert_close(z.mean(1), torch.zeros(16, dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(z.std(1), torch.ones(16, dtype=torch.float64), atol=1e-4, rtol=0)
    # Normalized dx: mean 0.1 * 28/32 = 0.0875; the stop channel is left raw.
    assert model.action_normalization.mean[0] == pytest.approx(0.0875)
    cfg = sft.SFTConfig(steps=40, batch_size=4, lr=3e-3, eval_every=20, eval_rows=4)
    result = sft.train_sft(model, rows, rows, cfg, progress=False)
    assert [c[0] for c in result["curve"]] == [0, 20, 40]
    assert result["final_heldout"]["loss"] < 0.8 * result["initial_heldout"]["loss"]
    assert all(math.isfinite(x) for x in result["train_losses"])
    clock = result["timings"]  # where the time went: 40 steps, 3 held-out evaluations (steps 0, 20, 40), no snapshot
    assert clock["steps"] == 40 and clock["snapshot_s"] == 0 and clock["heldout_eval_s"] > 0 and clock["probes_s"] > 0
    assert clock["refresh_features_s"] == 0  # no encoder trained, nothing to refresh
    assert clock["ms_per_step"] == pytest.approx(1000 * clock["steps_s"] / 40)
    # 40 steps are too few to report the first 20 apart (20 steady steps at least): no split
    assert clock["warmup_steps"] == 0 and clock["steady_ms_per_step"] == clock["ms_per_step"]


def test_train_sft_splits_off_the_first_steps_of_a_long_enough_loop(tmp_path):
    model, rows, _ = _fresh(tmp_path)
    cfg = sft.SFTConfig(steps=41, batch_size=2, eval_every=41, eval_rows=2)
    clock = sft.train_sft(model, rows, rows, cfg, progress=False)["timings"]
    assert clock["warmup_steps"] == sft.WARMUP_STEPS == 20 and 0 < clock["warmup_s"] < clock["steps_s"]
    steady_s = clock["steps_s"] - clock["warmup_s"]
    assert clock["steady_ms_per_step"] == pytest.approx(1000 * steady_s / 21)


def test_phase_clock_reports_the_warmup_steps_apart(monkeypatch):
    now = [0.0]  # a hand-driven clock: the seconds below are exact
    monkeypatch.setattr(sft.time, "perf_counter", lambda: now[0])
    clock = sft.PhaseClock(torch.device("cpu"))
    with clock.phase("loop"):
        now[0] += 2.0  # the first 20 steps take 2 s of their own ...
        with clock.phase("heldout_eval"):
            now[0] += 1.5  # ... plus an evaluation at step 20, which no step is charged with
        now[0] += 1.0
        clock.end_warmup(20)  # 3 s for the first 20 steps
        with clock.phase("snapshot"):
            now[0] += 0.5
        now[0] += 8.0  # 80 more steps at 100 ms
    r = clock.report(100)
    assert r["steps_s"] == pytest.approx(11.0)  # 13.0 s in the loop less 1.5 s of evaluation and 0.5 s of snapshot
    assert r["ms_per_step"] == pytest.approx(110.0)
    assert (r["warmup_steps"], r["warmup_s"]) == (20, pytest.approx(3.0))
    assert r["steady_ms_per_step"] == pytest.approx(100.0)
    assert (r["heldout_eval_s"], r["snapshot_s"]) == (pytest.approx(1.5), pytest.approx(0.5))


def test_process_pool_loader_keeps_episode_order_and_subsets(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=3)
    serial = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    pooled = sft.load_expert_examples(root, 33, (64, 64), progress=False, workers=2)
    assert [e.episode_id for e in pooled] == [e.episode_id for e in serial] == [f"s0000_e{i:03d}" for i in range(3)]
    for a, b in zip(serial, pooled, strict=True):
        np.testing.assert_array_equal(a.history, b.history)
        np.testing.assert_array_equal(a.target, b.target)
    picked = sft.load_expert_examples(root, 33, (64, 64), progress=False, episode_ids=["s0000_e002"])
    assert [e.episode_id for e in picked] == ["s0000_e002"]
    with pytest.raises(ValueError, match="unknown episode ids"):
        sft.load_expert_examples(root, 33, (64, 64), progress=False, episode_ids=["nope"])


def test_split_episode_ids_matches_split_by_episode(tmp_path):
    ids = [f"e{i:02d}" for i in range(20)]
    train, held = sft.split_episode_ids(ids, 0.1, seed=3)
    assert len(held) == 2 and len(train) == 18 and not set(train) & set(held) and sorted(train + held) == ids
    fake = [sft.ExpertExample(i, None, None, None, ()) for i in ids for _ in range(2)]  # two states per episode
    tr, he = sft.split_by_episode(fake, 0.1, seed=3)
    assert sorted({e.episode_id for e in he}) == held and len(tr) == 36


def test_goal_variants_are_held_out_with_their_episode():
    ids = [f"s0000_e{i:03d}" for i in range(10)] + [f"s0000_e{i:03d}_g{k}" for i in range(10) for k in (1, 2)]
    assert sft.episode_group("s0000_e003_g2") == "s0000_e003" and sft.episode_group("s0000_e003") == "s0000_e003"
    train, held = sft.split_episode_ids(ids, 0.2, seed=1)
    assert len(held) == 6 and len(train) == 24  # 2 of 10 driven episodes, each with its 2 variants
    assert not {sft.episode_group(e) for e in train} & {sft.episode_group(e) for e in held}


def test_concat_reoffsets_examples():
    def rows(n_ex, per):
        return sft.EncodedRows(
            history_latents=torch.arange(n_ex).float().view(n_ex, 1),
            target_latents=torch.zeros(n_ex, 1),
            actions=torch.zeros(n_ex, 1),
            row_example=torch.arange(n_ex).repeat_interleave(per),
            text=torch.zeros(n_ex * per, 1),
            text_mask=torch.ones(n_ex * per, 1, dtype=torch.bool),
            image=torch.zeros(n_ex, 1),
            geometry=None,
            text_ids=torch.zeros(n_ex * per, 1, dtype=torch.long),
            views=torch.zeros(n_ex, 1, dtype=torch.uint8),
        )

    cat = sft.EncodedRows.concat([rows(2, 3), rows(3, 1)])
    assert cat.examples == 5 and cat.rows == 9 and cat.geometry is None
    assert cat.row_example.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 4]  # the second part's examples start at 2
    hist, _ = cat.features(torch.tensor([6, 8]))
    assert hist.view(-1).tolist() == [0.0, 2.0]  # row 6 is example 0 of part 2, row 8 its example 2


def test_training_the_builtin_encoders_changes_them_and_refreshes_the_cache(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=2)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1))
    rows = sft.encode_examples(model, iter(examples), progress=False, calibrate=True, fit_normalization=True)
    assert model.action_normalization.mean[0] == pytest.approx(0.0875)  # 0.1 * 28 / 32, by hand
    assert rows.views.shape == (2, 4, 64, 64, 3) and rows.text_ids.shape == (4, 32)
    # The newest history frame is the last view: the query is at t = 5 of a 6-frame episode.
    np.testing.assert_array_equal(rows.views[0, -1].numpy(), examples[0].history[-1])
    before = {n: [p.detach().clone() for p in getattr(model, n).parameters()] for n in sft.TRAINABLE_ENCODERS}
    cached_text = rows.text.clone()
    cfg = sft.SFTConfig(
        steps=3, batch_size=4, lr=1e-2, eval_every=3, eval_rows=4, train_encoders=sft.TRAINABLE_ENCODERS
    )
    sft.train_sft(model, rows, rows, cfg, progress=False)
    for name, old in before.items():
        module = getattr(model, name)
        assert any(not torch.equal(a, b) for a, b in zip(old, module.parameters(), strict=True)), name
        assert not any(p.requires_grad for p in module.parameters()) and not module.training  # frozen again
    assert not torch.equal(cached_text, rows.text)
    with torch.no_grad():
        torch.testing.assert_close(rows.text, model.text_encoder(rows.text_ids, rows.text_mask))
        torch.testing.assert_close(rows.image, model.image_encoder(rows.views[:, -1]))
        torch.testing.assert_close(
            rows.geometry, model.geometry_encoder(torch.from_numpy(np.stack([e.history for e in examples])))
        )


def test_instruction_gap_is_zero_when_every_row_has_the_same_instruction(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=3)  # every episode: ["go ahead", "drive forward"]
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1))
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True)
    cfg = sft.SFTConfig(eval_rows=6)
    # 6 rows (3 examples x 2 variants); each is paired with the row 3 further on, which holds the other variant
    # ("go ahead" vs "drive forward"): a randomly initialised model reads different text, so the loss moves.
    gap = sft.instruction_gap(model, rows, cfg)
    assert gap["action"] > 0 and gap["gap"] != 0.0
    rows.text[:] = rows.text[0]  # now every row carries the same instruction: swapping changes nothing, exactly
    rows.text_mask[:] = rows.text_mask[0]
    same = sft.instruction_gap(model, rows, cfg)
    assert same["gap"] == 0.0 and same["action"] == same["action_swapped"]


def test_train_encoders_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"train_encoders: unknown \['vae'\]"):
        sft.SFTConfig(train_encoders=("vae",))


def _run_tool(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(TOOL), *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(TOOL), run_name="__main__")
    return exc.value.code


def test_tool_writes_checkpoint_from_collection(tmp_path, monkeypatch, capsys):
    root = _write_collection(tmp_path / "gn0", episodes=2)
    out = tmp_path / "ckpt"
    code = _run_tool(
        [
            "--output-dir",
            str(out),
            "--collection",
            str(root),
            "--sft-steps",
            "2",
            "--eval-every",
            "1",
            "--no-progress",
            "--max-shard-mb",
            "0.5",
        ],
        monkeypatch,
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out flow-matching loss: initial" in printed and "loss curve" in printed
    contract = read_checkpoint_contract(out)
    assert contract["transform_metadata"]["fps"] == 4
    assert contract["action_normalization"]["mean"][0] == pytest.approx(0.0875)
    manifest = json.loads((out / "checkpoint_manifest.json").read_text())
    assert manifest["provenance"]["sft_steps"] == 2 and len(manifest["provenance"]["loss_curve"]) == 3
    assert (out / "transformer" / "model.safetensors.index.json").is_file()
    assert load_wnm_checkpoint(out).config.fps == 4


def test_tool_bad_arguments(tmp_path, monkeypatch, capsys):
    assert _run_tool(["--output-dir", str(tmp_path), "--size", "tiny"], monkeypatch) == 2
    assert "already exists" in capsys.readouterr().err
    assert _run_tool(["--output-dir", str(tmp_path / "x"), "--sft-steps", "5"], monkeypatch) == 2
    assert "--sft-steps needs --collection" in capsys.readouterr().err
    assert _run_tool(["--output-dir", str(tmp_path / "y"), "--size", "huge"], monkeypatch) == 2
    assert "unknown size 'huge'" in capsys.readouterr().err
    for bad, needle in ((["--set", "bogus=1"], "bogus"), (["--set", "=3"], "expected FIELD=VALUE")):
        assert _run_tool(["--output-dir", str(tmp_path / "z"), *bad], monkeypatch) == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_tool_set_overrides_a_preset_field(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    assert _run_tool(["--output-dir", str(out), "--set", "text_encoder_layers=1", "--no-progress"], monkeypatch) == 0
    assert load_wnm_checkpoint(out).config.text_encoder_layers == 1


def test_swap_partners_skip_the_same_instruction_and_the_same_example():
    from types import SimpleNamespace

    ids = {"a": [5, 6], "b": [7, 6], "c": [8, 8]}
    data = SimpleNamespace(
        rows=4,
        text_ids=torch.tensor([ids["a"], ids["b"], ids["a"], ids["c"]]),
        row_example=torch.tensor([0, 1, 2, 3]),
    )
    # Row 0 starts half the set away (row 2), which holds the same text "a", so it takes row 3 ("c"); row 2
    # likewise skips row 0 ("a") for row 1 ("b"). Worked out by hand.
    assert sft.swap_partners(data, torch.arange(4)).tolist() == [3, 3, 1, 1]
    # Two rows of one example never pair, even with different text; a set with one text keeps every row.
    one_example = SimpleNamespace(rows=2, text_ids=torch.tensor([ids["a"], ids["b"]]), row_example=torch.tensor([0, 0]))
    assert sft.swap_partners(one_example, torch.arange(2)).tolist() == [0, 1]


def test_examples_carry_the_goal_direction_of_their_query_pose(tmp_path):
    from verl_omni.models.wnm.goal_probe import DISTANCE_SCALE_M

    root = _write_collection(tmp_path / "gn0", episodes=1)  # pose (0, 0, 0) at t = 5, goal (2.8, 0): dead ahead
    (example,) = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    np.testing.assert_allclose(example.goal_polar, [1.0, 0.0, 2.8 / DISTANCE_SCALE_M], atol=1e-6)


def test_independent_action_noise_off_is_unchanged_and_on_changes_the_draws(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=2)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1), sft.fit_action_normalization(examples))
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    real_loss = sft.joint_flow_matching_loss

    def spy(*args, **kwargs):
        seen.append(args[8] if len(args) > 8 else kwargs.get("action_sigma"))
        return real_loss(*args, **kwargs)

    def run(share):
        model.load_state_dict(state)
        seen.clear()
        cfg = sft.SFTConfig(steps=6, batch_size=4, eval_every=6, eval_rows=4, independent_action_noise=share)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sft, "joint_flow_matching_loss", spy)
            out = sft.train_sft(model, rows, rows, cfg, progress=False)
        return out["train_losses"], [s for s in seen if s is not None]

    default_losses, default_levels = run(0.0)
    assert default_levels == []  # off: every row shares the video's level, no extra draw
    losses, levels = run(1.0)
    assert len(levels) == 6 and all(lv.shape == (4,) and ((lv >= 0) & (lv <= 1)).all() for lv in levels)
    assert losses != default_losses
    with pytest.raises(ValueError, match="independent_action_noise"):
        sft.SFTConfig(independent_action_noise=1.5)


# SFT cut off after a snapshot goes on from it and ends where an uninterrupted run ends (bit for bit on CPU).


class _Killed(Exception):
    pass


class _KilledAfterSave(SFTResume):
    """Stands in for a call's time limit: the process dies right after the snapshot of step ``at``."""

    def __init__(self, path, at: int) -> None:
        super().__init__(path, every_s=0, log=lambda _msg: None)
        self.at = at

    def save(self, fingerprint, snapshot):
        super().save(fingerprint, snapshot)
        if snapshot["step"] == self.at:
            raise _Killed


def _fresh(tmp_path):
    root = _write_collection(tmp_path / "gn0", episodes=2)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1))
    rows = sft.encode_examples(model, examples, progress=False, calibrate=True, fit_normalization=True)
    return model, rows, {k: v.clone() for k, v in model.state_dict().items()}


RESUME_CFG = sft.SFTConfig(steps=7, batch_size=4, lr=3e-3, eval_every=3, eval_rows=4,
                    train_encoders=("text_encoder",), view_aux_weight=0.0, independent_action_noise=0.5)  # fmt: skip


def test_a_run_cut_off_after_a_snapshot_ends_where_an_uninterrupted_run_ends(tmp_path):
    model, rows, init = _fresh(tmp_path)
    plain = sft.train_sft(model, rows, rows, RESUME_CFG, progress=False)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    path = tmp_path / "snap" / "sft.pt"
    model.load_state_dict(init)
    _, rows, _ = _fresh(tmp_path / "again")  # the cached text features were refreshed by the first run
    with pytest.raises(_Killed):
        sft.train_sft(model, rows, rows, RESUME_CFG, progress=False, resume=_KilledAfterSave(path, at=4))
    assert path.is_file() and not path.with_name("sft.pt.partial").exists()
    assert torch.load(path, weights_only=False)["step"] == 4

    model.load_state_dict(init)  # a new process: the model starts from its initial weights again
    for p in model.text_encoder.parameters():
        p.requires_grad_(False)
    messages = []
    resumed = sft.train_sft(model, rows, rows, RESUME_CFG, progress=False, resume=SFTResume(path, 0, messages.append))
    assert messages == ["sft.pt: resuming SFT after step 4"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert resumed["train_losses"] == plain["train_losses"]  # steps 1-4 from the snapshot, 5-7 trained again
    assert resumed["curve"] == plain["curve"]
    assert torch.load(path, weights_only=False)["step"] == 6  # the last step is left to the caller to save
    assert resumed["timings"]["steps"] == 3 and resumed["timings"]["snapshot_s"] > 0  # this call's steps 5-7
    assert resumed["timings"]["refresh_features_s"] > 0  # the text encoder trained


def test_a_snapshot_of_other_settings_or_an_unreadable_one_is_not_continued(tmp_path):
    model, rows, init = _fresh(tmp_path)
    path = tmp_path / "sft.pt"
    with pytest.raises(_Killed):
        sft.train_sft(model, rows, rows, RESUME_CFG, progress=False, resume=_KilledAfterSave(path, at=2))
    messages = []
    other = sft.SFTConfig(**{**RESUME_CFG.__dict__, "lr": 1e-3})
    assert SFTResume(path, 0, messages.append).load({"sft": other.__dict__}) is None
    assert messages == [f"{path}: SFT snapshot of other settings; training from step 0"]
    path.write_bytes(b"not a snapshot")
    messages.clear()
    assert SFTResume(path, 0, messages.append).load({}) is None
    assert messages[0].startswith(f"{path}: unreadable SFT snapshot")
    with pytest.raises(ValueError, match="every_s"):
        SFTResume(path, -1)


def test_snapshots_written_before_the_moving_average_existed_are_still_continued(tmp_path):
    # The SFT settings as snapshots stored them before SFTConfig.ema_decay was added (written out by hand): the key
    # of a run with the average off must be exactly this, so that such a snapshot is continued, not retrained.
    old_fields = {"steps", "batch_size", "lr", "weight_decay", "action_weight", "eval_every", "eval_rows", "seed",
                  "train_encoders", "goal_aux_weight", "independent_action_noise", "goal_aux_pure_noise",
                  "view_aux_weight", "autocast", "newest_share", "newest_rows_from"}  # fmt: skip
    settings = sft.snapshot_settings(RESUME_CFG)
    assert set(settings) == old_fields and settings["lr"] == 3e-3 and settings["steps"] == 7
    assert sft.snapshot_settings(sft.SFTConfig(**{**RESUME_CFG.__dict__, "ema_decay": 0.8}))["ema_decay"] == 0.8

    model, rows, init = _fresh(tmp_path)
    path = tmp_path / "sft.pt"
    with pytest.raises(_Killed):
        sft.train_sft(model, rows, rows, RESUME_CFG, progress=False, resume=_KilledAfterSave(path, at=2))
    snap = torch.load(path, weights_only=False)
    old_key = {k: v for k, v in RESUME_CFG.__dict__.items() if k != "ema_decay"}
    assert snap["fingerprint"]["sft"] == json.loads(json.dumps(old_key))  # what the older code wrote
    messages = []
    model.load_state_dict(init)
    sft.train_sft(model, rows, rows, RESUME_CFG, progress=False, resume=SFTResume(path, 0, messages.append))
    assert messages == ["sft.pt: resuming SFT after step 2"]


def test_bfloat16_autocast_trains_float32_weights_and_changes_the_result(tmp_path):
    model, rows, init = _fresh(tmp_path)
    cfg = sft.SFTConfig(steps=3, batch_size=4, lr=3e-3, eval_every=3, eval_rows=4)
    plain = sft.train_sft(model, rows, rows, cfg, progress=False)["train_losses"]
    model.load_state_dict(init)
    amp = sft.train_sft(model, rows, rows, sft.SFTConfig(**{**cfg.__dict__, "autocast": "bfloat16"}), progress=False)
    assert all(p.dtype == torch.float32 for p in model.transformer.parameters())
    assert len(amp["train_losses"]) == 3 and all(math.isfinite(x) for x in amp["train_losses"])
    assert amp["train_losses"][0] != plain[0] and amp["train_losses"][0] == pytest.approx(plain[0], rel=0.05)
    with pytest.raises(ValueError, match="autocast"):
        sft.SFTConfig(autocast="float16")


def test_zero_steps_leave_the_weights_and_still_measure_the_model(tmp_path):
    """steps=0 (train_stage2 --sft-steps 0: round 0 is a carried checkpoint): no optimizer step, every weight and
    cached feature as it was, the held-out loss the same before and after; negative steps are refused."""
    model, rows, init = _fresh(tmp_path)
    text_before = rows.text.clone()
    cfg = sft.SFTConfig(**{**dataclasses.asdict(RESUME_CFG), "steps": 0})
    result = sft.train_sft(model, rows, rows, cfg, progress=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, init[k]), k
    assert torch.equal(rows.text, text_before)  # the refreshed text features are those of the untouched encoder
    assert result["train_losses"] == [] and result["curve"] == [(0, None, result["initial_heldout"]["loss"])]
    assert result["final_heldout"]["loss"] == result["initial_heldout"]["loss"]
    assert result["timings"]["steps"] == 0 and result["timings"]["ms_per_step"] == 0
    with pytest.raises(ValueError, match="steps"):
        sft.SFTConfig(steps=-1)


def test_encoded_features_are_the_encoders_outputs_of_each_example_and_instruction(tmp_path):
    """Each cached feature is what the model's own encoders give for that example's frames and that row's
    instruction (text of every variant, image of the last history frame, geometry of the history clip)."""
    root = _write_collection(tmp_path / "gn0", episodes=2)
    examples = sft.load_expert_examples(root, 33, (64, 64), progress=False)
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1))
    rows = sft.encode_examples(model, examples, batch=3, progress=False, calibrate=True)
    for r in range(rows.rows):
        ex = int(rows.row_example[r])
        e = examples[ex]
        variant = r - int((rows.row_example == ex).nonzero()[0])
        text, mask = model.encode_text([e.instructions[variant]])
        torch.testing.assert_close(rows.text[r][mask[0]], text[0][mask[0]], rtol=1e-5, atol=1e-5)
        frames = torch.from_numpy(e.history[None])
        torch.testing.assert_close(rows.image[ex], model.image_encoder(frames[:, -1]).float()[0], rtol=1e-5, atol=1e-5)
        if rows.geometry is not None:
            torch.testing.assert_close(rows.geometry[ex], model.geometry_encoder(frames).float()[0], rtol=1e-5,
                                       atol=1e-5)  # fmt: skip


def test_draw_rows_splits_each_batch_between_earlier_and_newest_rows_by_hand():
    # 10 earlier rows (0-9) and 30 newest (10-39); a share of 0.25 of a batch of 8 is exactly 2 newest rows.
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows = sft.draw_rows(40, 8, g, newest_share=0.25, newest_rows_from=10)
        assert rows.shape == (8,) and rows.dtype == torch.int64
        assert (rows[:6] < 10).all() and (rows[6:] >= 10).all() and (rows[6:] < 40).all()
    # round(0.3 * 8) = 2 as well; shares 0 and 1 draw from one side only.
    assert (sft.draw_rows(40, 8, g, 0.3, 10)[6:] >= 10).all()
    assert (sft.draw_rows(40, 8, g, 0.0, 10) < 10).all()
    assert (sft.draw_rows(40, 8, g, 1.0, 10) >= 10).all()


def test_draw_rows_without_a_share_keeps_the_uniform_stream():
    # None (the default), or no earlier or no newest rows: the same draws as before the option existed.
    for share, start in ((None, 10), (0.25, 0), (0.25, 40)):
        a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        assert torch.equal(sft.draw_rows(40, 8, a, share, start), torch.randint(0, 40, (8,), generator=b))


def test_newest_share_is_validated():
    with pytest.raises(ValueError, match="newest_share"):
        sft.SFTConfig(newest_share=1.5)
    with pytest.raises(ValueError, match="newest_rows_from"):
        sft.SFTConfig(newest_rows_from=-1)


def test_sft_steps_tell_the_transformer_whether_the_context_mask_is_all_true(tmp_path, monkeypatch):
    """Every training step passes the context's all-True flag from the host, so the transformer never checks the
    mask on the device; the flag is what the mask holds, for batches with and without padded instructions."""
    from verl_omni.models.wnm.transformer import WNMTransformer

    model, rows, _ = _fresh(tmp_path)
    rows.text_mask[:] = True  # every instruction fills the text window, but one: batches that draw that row keep
    rows.text_mask[0, -1] = False  # the mask, the others drop it
    seen = []
    real = WNMTransformer._context_mask

    def spy(context):
        if torch.is_grad_enabled():  # training steps (held-out losses run without grad and may check themselves)
            seen.append((context.encoder_mask_all_true, bool(context.encoder_mask.all())))
        return real(context)

    monkeypatch.setattr(WNMTransformer, "_context_mask", staticmethod(spy))
    cfg = sft.SFTConfig(steps=8, batch_size=2, eval_every=8, eval_rows=2)
    sft.train_sft(model, rows, rows, cfg, progress=False)
    assert len(seen) == 8
    assert all(flag is not None and flag == actual for flag, actual in seen)
    assert {actual for _, actual in seen} == {True, False}  # both kinds of batch were drawn


# The moving average of the SFT weights (SFTConfig.ema_decay).


def test_ema_decay_ramp_and_update_by_hand():
    assert sft.ema_decay_at(1, 0.999) == pytest.approx(2 / 11)  # (1 + 1) / (10 + 1) below the decay
    assert sft.ema_decay_at(8, 0.5) == 0.5  # 9 / 18 = 0.5: the ramp meets the decay
    assert sft.ema_decay_at(1000, 0.9) == 0.9
    average = [torch.tensor([1.0, 2.0]), torch.tensor(4.0)]
    sft.ema_update(average, [torch.tensor([3.0, 0.0]), torch.tensor(0.0)], 0.75)
    # 0.75 * 1 + 0.25 * 3 = 1.5; 0.75 * 2 + 0.25 * 0 = 1.5; 0.75 * 4 = 3
    assert average[0].tolist() == [1.5, 1.5] and average[1].item() == 3.0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="ema_decay"):
            sft.SFTConfig(ema_decay=bad)


def _trained_params(model):
    return [p for p in model.transformer.parameters()] + [p for p in model.text_encoder.parameters()]


def test_sft_ends_with_the_moving_average_of_its_iterates(tmp_path):
    """The weights a run ends with are the average of the weights after each step, computed here in float64."""
    model, rows, _ = _fresh(tmp_path)
    cfg = sft.SFTConfig(steps=5, batch_size=4, lr=3e-3, eval_every=5, eval_rows=4, train_encoders=("text_encoder",),
                        ema_decay=0.9)  # fmt: skip
    expected = [p.detach().double().clone() for p in _trained_params(model)]
    last = []

    def after_each_step(step):
        decay = min(0.9, (1 + step) / (10 + step))
        last[:] = [p.detach().double().clone() for p in _trained_params(model)]
        for avg, p in zip(expected, last, strict=True):
            avg.mul_(decay).add_(p, alpha=1 - decay)

    sft.train_sft(model, rows, rows, cfg, progress=False, step_hook=after_each_step)
    final = [p.detach().double() for p in _trained_params(model)]
    for got, want in zip(final, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert any(not torch.allclose(f, raw) for f, raw in zip(final, last, strict=True))  # not the last iterate


def test_a_run_with_a_moving_average_resumes_where_an_uninterrupted_run_ends(tmp_path):
    cfg = sft.SFTConfig(**{**RESUME_CFG.__dict__, "ema_decay": 0.8})
    model, rows, init = _fresh(tmp_path)
    sft.train_sft(model, rows, rows, cfg, progress=False)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "snap" / "sft.pt"
    model.load_state_dict(init)
    _, rows, _ = _fresh(tmp_path / "again")
    with pytest.raises(_Killed):
        sft.train_sft(model, rows, rows, cfg, progress=False, resume=_KilledAfterSave(path, at=4))
    assert len(torch.load(path, weights_only=False)["average"]) == len(_trained_params(model))
    model.load_state_dict(init)
    for p in model.text_encoder.parameters():
        p.requires_grad_(False)
    sft.train_sft(model, rows, rows, cfg, progress=False, resume=SFTResume(path, 0, lambda _m: None))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
