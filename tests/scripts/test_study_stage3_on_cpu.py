"""Pure parts of the Stage-III study (scripts/study): smoothing, CI math, closed-loop pooling, trainer configs,
tables and plots on synthetic numbers. Expected values are hand calculations or scipy/numpy recomputations."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from study import plan, plots, report, stats  # noqa: E402


# ---------------------------------------------------------------------------------------------- stats
def test_trailing_mean_by_hand_and_nan():
    out = stats.trailing_mean([1.0, 3.0, 5.0, 7.0], 2)
    np.testing.assert_allclose(out, [1.0, 2.0, 4.0, 6.0])
    out = stats.trailing_mean([1.0, np.nan, 5.0, np.nan, np.nan], 2)
    # windows: [1], [1, nan], [nan, 5], [5, nan], [nan, nan]
    np.testing.assert_allclose(out[:4], [1.0, 1.0, 5.0, 5.0])
    assert np.isnan(out[4])
    with pytest.raises(ValueError, match="window"):
        stats.trailing_mean([1.0], 0)


def test_t_interval_matches_hand_formula():
    x = [1.0, 2.0, 3.0, 4.0]
    m, lo, hi = stats.t_interval(x)
    sem = math.sqrt(sum((v - 2.5) ** 2 for v in x) / 3) / 2  # sample std / sqrt(4)
    q = sps.t.ppf(0.975, 3)
    assert m == 2.5
    assert lo == pytest.approx(2.5 - q * sem) and hi == pytest.approx(2.5 + q * sem)
    assert stats.t_interval([2.0]) == (2.0, None, None)
    assert stats.t_interval([2.0, 2.0]) == (2.0, 2.0, 2.0)


def test_seed_band_per_step():
    curves = np.array([[0.0, 1.0, np.nan], [2.0, 3.0, 5.0], [4.0, 5.0, np.nan]])
    mean, lo, hi = stats.seed_band(curves)
    np.testing.assert_allclose(mean, [2.0, 3.0, 5.0])
    half = sps.t.ppf(0.975, 2) * 2.0 / math.sqrt(3)  # std of (0, 2, 4) is 2
    assert lo[0] == pytest.approx(2.0 - half) and hi[1] == pytest.approx(3.0 + half)
    assert np.isnan(lo[2]) and np.isnan(hi[2])  # one seed at step 3: no band


def test_welch_and_early_late_against_scipy():
    a, b = [1.0, 2.0, 3.0], [4.0, 6.0, 8.0, 10.0]
    w = stats.welch_difference(a, b)
    ref = sps.ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
    assert w["diff"] == pytest.approx(5.0)
    assert (w["low"], w["high"]) == (pytest.approx(ref.low), pytest.approx(ref.high))
    curve = np.arange(10, dtype=float)  # first 20% = (0, 1), last 20% = (8, 9)
    ch = stats.early_late_change(curve, 0.2)
    assert ch["window"] == 2 and ch["diff"] == pytest.approx(8.0)
    # By hand: both windows have variance 0.5, se = sqrt(0.5/2 + 0.5/2), Welch df = 0.25 / 0.125 = 2.
    half = sps.t.ppf(0.975, 2) * math.sqrt(0.5)
    assert ch["low"] == pytest.approx(8.0 - half) and ch["high"] == pytest.approx(8.0 + half)


def test_overlap_relative_wilson():
    assert stats.intervals_overlap((0.0, 1.0), (1.0, 2.0)) is True
    assert stats.intervals_overlap((0.0, 0.9), (1.0, 2.0)) is False
    assert stats.intervals_overlap((None, 1.0), (0.0, 2.0)) is None
    assert stats.relative_change(2.0, 1.4) == pytest.approx(-0.3)
    assert stats.relative_change(0.0, 1.0) is None
    lo, hi = stats.wilson(5, 10)
    z = sps.norm.ppf(0.975)
    centre = (0.5 + z * z / 20) / (1 + z * z / 10)
    half = z / (1 + z * z / 10) * math.sqrt(0.25 / 10 + z * z / 400)
    assert lo == pytest.approx(centre - half) and hi == pytest.approx(centre + half)


def _episodes(success, collisions, prefix="e"):
    return [
        {
            "episode_id": f"{prefix}{i}",
            "success": bool(s),
            "oracle_success": bool(s),
            "spl": 0.5 * s,
            "ne": 2.0 - s,
            "collisions": int(c),
            "collided": c > 0,
        }
        for i, (s, c) in enumerate(zip(success, collisions, strict=True))
    ]


def test_compare_closed_loop_pools_seeds_per_episode():
    base = _episodes([0, 0, 1, 0], [2, 2, 0, 4])
    s1 = _episodes([1, 0, 1, 1], [0, 1, 0, 1])
    s2 = _episodes([1, 1, 1, 0], [0, 1, 0, 3])
    comp = stats.compare_closed_loop(base, [s1, s2])
    sr = comp["success"]
    # per-episode seed means: (1, 0.5, 1, 0.5) -> 0.75; differences vs (0, 0, 1, 0): (1, 0.5, 0, 0.5)
    assert sr["before"][0] == 0.25 and sr["after"][0] == pytest.approx(0.75)
    assert sr["before"][1:] == pytest.approx(stats.wilson(1, 4))
    m, lo, hi = sr["diff"]
    d = np.array([1.0, 0.5, 0.0, 0.5])
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert m == pytest.approx(0.5) and lo == pytest.approx(0.5 - half) and hi == pytest.approx(0.5 + half)
    assert sr["per_seed"] == [0.75, 0.75] and sr["seeds"] == 2 and sr["episodes"] == 4
    col = comp["collisions"]
    # before mean 2.0, after per-episode means (0, 1, 0, 2) -> 0.75: relative change -62.5%
    assert col["after"][0] == pytest.approx(0.75) and col["relative"] == pytest.approx(-0.625)
    goal = stats.goal_check(comp)
    assert goal["sr_gain"] == pytest.approx(0.5) and goal["sr_goal_met"]
    assert goal["collision_reduction"] == pytest.approx(0.625) and goal["collision_goal_met"]
    assert goal["met"] == (goal["sr_cis_apart"] and goal["collision_cis_apart"])
    with pytest.raises(ValueError, match="same episodes"):
        stats.compare_closed_loop(base, [_episodes([1, 1, 1, 1], [0, 0, 0, 0], prefix="x")])


def test_compare_closed_loop_reports_the_gaming_signs_beside_sr():
    """Premature STOP (binary, Wilson before), progress and path length are compared like SR; path length has no
    better direction (improved None); reports without these fields (older evaluators) simply lack the rows."""
    base = _episodes([0, 0, 1, 0], [2, 2, 0, 4])
    after = _episodes([1, 0, 1, 1], [0, 1, 0, 1])
    for eps, stops, prog, path in ((base, [1, 1, 0, 0], [0.0, 0.5, 3.0, 1.0], [0.0, 1.0, 3.5, 4.0]),
                                   (after, [0, 1, 0, 0], [3.0, 0.5, 3.0, 3.0], [3.5, 1.0, 3.5, 3.5])):  # fmt: skip
        for e, st, pr, pa in zip(eps, stops, prog, path, strict=True):
            e.update(premature_stop=bool(st), progress=pr, path_length=pa)
    comp = stats.compare_closed_loop(base, [after])
    ps = comp["premature_stop"]
    assert ps["before"] == pytest.approx((0.5, *stats.wilson(2, 4)))
    assert ps["after"][0] == pytest.approx(0.25) and ps["diff"][0] == pytest.approx(-0.25)
    pg = comp["progress"]  # differences (3.0, 0.0, 0.0, 2.0): mean 1.25
    d = np.array([3.0, 0.0, 0.0, 2.0])
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert pg["diff"] == pytest.approx((1.25, 1.25 - half, 1.25 + half))
    assert half == pytest.approx(2.387, abs=1e-3) and pg["improved"] is False  # the interval holds 0
    assert comp["path_length"]["diff"][0] == pytest.approx(0.75) and comp["path_length"]["improved"] is None
    rows = report.closed_loop_main_table(comp)
    assert [r[0] for r in rows[-3:]] == ["premature STOP", "geodesic progress (m)", "path length (m)"]
    older = stats.compare_closed_loop(_episodes([0, 1], [1, 0]), [_episodes([1, 1], [0, 0])])
    assert "premature_stop" not in older and "success" in older
    assert [r[0] for r in report.closed_loop_main_table(older)][-1] == "episodes w/ collision"


# ---------------------------------------------------------------------------------------------- plan
def test_plan_runs_and_trainer_config_ablation_switches(tmp_path):
    settings = plan.StudySettings(steps=7, main_seeds=(1, 2, 3), ablation_seeds=(1,))
    runs = plan.plan_runs(settings)
    assert [r.name for r in runs] == [
        "main_s1",
        "main_s2",
        "main_s3",
        "abl_a_summed_s1",
        "abl_b_prompt_baseline_s1",
        "abl_c_independent_noise_s1",
    ]
    locked = plan.load_locked_recipe()
    ws = {"ckpt": tmp_path / "c", "train": tmp_path / "t", "eventval": tmp_path / "v", "scenes": tmp_path / "s"}
    ws["train_size"] = 32
    cfgs = {r.name: plan.trainer_config(r, settings, ws, tmp_path / r.name, locked) for r in runs}
    main = cfgs["main_s1"]
    assert main["algorithm"]["layer_conditioned"] is True and main["algorithm"]["baseline"] == "stratum"
    assert main["rollout"]["shared_initial_noise"] is True and main["rollout"]["strata"] == 4
    assert main["trainer"]["total_steps"] == 7 and main["trainer"]["seed"] == 1 and main["data"]["seed"] == 1
    assert main["topology"]["ppo_mini_batch_prompts"] == main["topology"]["prompts_per_step"] == 4
    assert cfgs["abl_a_summed_s1"]["algorithm"]["layer_conditioned"] is False
    assert cfgs["abl_b_prompt_baseline_s1"]["algorithm"]["baseline"] == "prompt"
    assert cfgs["abl_c_independent_noise_s1"]["rollout"]["shared_initial_noise"] is False
    # Each ablation differs from the same-seed main run in exactly its switch (and its output/experiment name).
    for name, switch in (("abl_a_summed_s1", ("algorithm", "layer_conditioned")),):
        diff = {
            (sec, k)
            for sec in main
            if isinstance(main[sec], dict)
            for k in main[sec]
            if main[sec][k] != cfgs[name][sec][k]
        }
        assert diff == {switch, ("trainer", "output_dir"), ("trainer", "experiment_name")}
    from verl_omni.trainer.config import trainer_config_from_dict

    for cfg in cfgs.values():
        trainer_config_from_dict(cfg)  # every generated config passes the trainer's own validation
    # The extra arm runs only when named, on the ablation seeds, and differs from main in its one reward option.
    (extra,) = plan.plan_runs(settings, ("no_stop_chunk_charge",))
    assert extra.name == "no_stop_chunk_charge_s1"
    extra_cfg = plan.trainer_config(extra, settings, ws, tmp_path / extra.name, locked)
    assert extra_cfg["reward"]["reward_set"]["rewards"]["navigation"]["charge_stop_chunk"] is False
    assert main["reward"]["reward_set"]["rewards"]["navigation"]["charge_stop_chunk"] is True  # the recipe's
    trainer_config_from_dict(extra_cfg)
    # The premature-STOP candidate changes the stop reward's base and cap only; the recipe keeps base 0.
    (cand,) = plan.plan_runs(settings, ("cand_premature_base",))
    cand_cfg = plan.trainer_config(cand, settings, ws, tmp_path / cand.name, locked)
    stop = cand_cfg["reward"]["reward_set"]["rewards"]["stop"]
    assert (stop["premature_base"], stop["premature_cap"]) == (1.0, 3.0)
    assert "premature_base" not in main["reward"]["reward_set"]["rewards"]["stop"]
    trainer_config_from_dict(cand_cfg)
    with pytest.raises(ValueError, match="unknown arm"):
        plan.plan_runs(settings, ("nope",))
    with pytest.raises(ValueError, match="StudySettings.lr"):
        plan.StudySettings(lr=0.0)


# ---------------------------------------------------------------------------------------------- report + plots
def _write_results(root: Path) -> Path:
    """A synthetic results folder: rising rewards, validation every 5 steps, evaluations of 6 episodes."""
    results = root / "results"
    names = ["main_s1", "main_s2", "abl_a_summed_s1"]
    status = {"runs": {"stage2": {"state": "done"}}}
    rng = np.random.default_rng(0)
    for k, name in enumerate(names):
        out = results / "runs" / name / "out"
        out.mkdir(parents=True)
        lines = []
        for step in range(1, 21):
            m = {"step": step}
            for layer in report.LAYERS:
                m[f"reward/{layer}/mean"] = 0.05 * step + 0.01 * rng.standard_normal()
            m["reward/nav_total/mean"] = 0.2 * step
            m["reward/stop_total/mean"] = -1.0 + 0.01 * step
            m["reward_terms/collision/hard"] = 0.125  # one chunk in 4 of every second rollout: half collide
            m["reward_terms/geometry/stop_step"] = 20.0 - 0.5 * step
            if step % 5 == 0:
                for ev in report.EVENTS:
                    m[f"val/{ev}/nav_total"] = 0.1 * step + k
                    m[f"val/{ev}/stop_total"] = 0.0
            lines.append(json.dumps(m))
        (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        status["runs"][name] = {"state": "done", "steps_done": 20}
    evals = {
        "stage2": _episodes([0, 0, 1, 0, 0, 1], [3, 2, 0, 4, 1, 2]),
        "main_s1": _episodes([1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 0, 0]),
        "main_s2": _episodes([1, 1, 1, 0, 0, 1], [1, 0, 0, 2, 0, 1]),
        "abl_a_summed_s1": _episodes([0, 0, 1, 1, 0, 1], [2, 2, 0, 3, 1, 1]),
    }
    for name, eps in evals.items():
        d = results / "evals" / name
        d.mkdir(parents=True)
        rep = {"format": "wnm-closed-loop-eval/1", "runs": {"checkpoint": {"episodes": eps}}}
        (d / "report.json").write_text(json.dumps(rep))
    (results / "status.json").write_text(json.dumps(status))
    return results


def test_report_tables_and_plots_on_synthetic_results(tmp_path):
    data = report.load_results(_write_results(tmp_path))
    assert data.arms == ["main", "abl_a_summed"] and len(data.arm_runs("main")) == 2

    train = report.training_table(data)
    nav_total = next(r for r in train if r[0] == "nav_total")
    # 20 steps, windows of 4: mean(17..20) - mean(1..4) = 16 steps x 0.2 = +3.2. Both windows hold 0.2 x
    # (k, k+1, k+2, k+3): variance 0.04 x 5/3, se = sqrt(2 x variance / 4), Welch df = 6 (equal sizes/spreads).
    half = sps.t.ppf(0.975, 6) * math.sqrt(2 * 0.04 * 5 / 3 / 4)
    assert nav_total[1] == f"+3.200 [{3.2 - half:+.3f}, {3.2 + half:+.3f}]"

    behaviour = {r[0]: r[1:] for r in report.rollout_behaviour_table(data)}
    assert behaviour["training rollouts with a hard collision"][0] == "0.500 -> 0.500 (+0.000 [+0.000, +0.000])"
    # STOP step 20 - 0.5 k: steps 1-4 average 18.75, steps 17-20 average 10.75; each window is 0.5 x (k..k+3),
    # variance 0.25 x 5/3, so the same Welch half-width as above at half the scale.
    half = sps.t.ppf(0.975, 6) * math.sqrt(2 * 0.25 * 5 / 3 / 4)
    assert (
        behaviour["STOP step (32: none)"][0]
        == f"18.750 -> 10.750 ({-8.0:+.3f} [{-8.0 - half:+.3f}, {-8.0 + half:+.3f}])"
    )
    assert behaviour["first collision step (32: none)"] == ["n/a", "n/a"]  # not logged by these runs

    val = report.validation_table(data)
    all_row = next(r for r in val if r[0] == "all")
    # main seeds: first 0.5 + k, last 2.0 + k -> change 1.5 for both seeds
    assert all_row[1].startswith("+1.000 -> +2.500 (+1.500 [+1.500, +1.500])")

    comps = report.closed_loop_comparisons(data)
    assert set(comps) == {"main", "abl_a_summed"}
    assert comps["main"]["success"]["before"][0] == pytest.approx(2 / 6)
    assert comps["main"]["success"]["after"][0] == pytest.approx(8 / 12)
    assert comps["abl_a_summed"]["collisions"]["after"][0] == pytest.approx(9 / 6)
    md = report.render_markdown(data, comps, ["x/closed_loop.png"], "synthetic")
    assert "| SR |" in md and "abl_a_summed" in md and "![closed_loop](x/closed_loop.png)" in md

    figs = tmp_path / "figs"
    plots.reward_curves(data, figs / "r.png", window=3)
    plots.validation_curves(data, figs / "v.png")
    plots.closed_loop_bars(comps, figs / "c.png")
    from PIL import Image

    for name in ("r.png", "v.png", "c.png"):
        with Image.open(figs / name) as im:
            assert im.format == "PNG" and min(im.size) > 100
        assert (figs / name).stat().st_size < 300_000  # small enough to commit
    assert report.split_run_name("abl_b_prompt_baseline_s12") == ("abl_b_prompt_baseline", 12)


# ---------------------------------------------------------------------------------------------- files
def test_relocate_rewrites_only_roots(tmp_path):
    from study import workspace

    carry = tmp_path / "carry"
    desc = {"paths": {"collection": "collection", "scenes": "scenes", "train": "train", "eventval": "eventval"}}
    for key in ("train", "eventval"):
        (carry / key).mkdir(parents=True)
        manifest = {"source_root": "/elsewhere/c", "occupancy_root": "/elsewhere/s", "shards": [{"sha256": "ab"}]}
        (carry / key / "manifest.json").write_text(json.dumps(manifest))
    changed = workspace.relocate(carry, desc)
    assert len(changed) == 2
    m = json.loads((carry / "train" / "manifest.json").read_text())
    assert m["source_root"] == str((carry / "collection").resolve())
    assert m["occupancy_root"] == str((carry / "scenes").resolve())
    assert m["shards"] == [{"sha256": "ab"}]
    assert workspace.relocate(carry, desc) == []  # already in place: nothing rewritten


def test_pack_leaves_out_weights_and_doc_block_update(tmp_path):
    import tarfile

    import study_stage3

    results, carry = tmp_path / "results", tmp_path / "carry"
    (results / "runs" / "main_s1" / "out" / "global_step_4" / "actor").mkdir(parents=True)
    (results / "runs" / "main_s1" / "out" / "global_step_4" / "actor" / "w.pt").write_text("weights")
    (results / "runs" / "main_s1" / "export").mkdir()
    (results / "runs" / "main_s1" / "export" / "model.safetensors").write_text("weights")
    (results / "runs" / "main_s1" / "out" / "metrics.jsonl").write_text("{}\n")
    (results / "status.json").write_text("{}")
    carry.mkdir()
    (carry / "workspace.json").write_text("{}")
    dest = tmp_path / "o" / "r.tar.gz"
    study_stage3._pack(results, carry, dest)
    with tarfile.open(dest) as tar:
        names = set(tar.getnames())
    assert "results/runs/main_s1/out/metrics.jsonl" in names and "results/workspace.json" in names
    assert not any("global_step_" in n or "/export" in n for n in names)
    with pytest.raises(study_stage3.StudyError, match="already exists"):
        study_stage3._pack(results, carry, dest)

    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{study_stage3.DOC_BEGIN}\nold\n{study_stage3.DOC_END}\noutro\n")
    study_stage3._update_doc(doc, "new table\n")
    assert doc.read_text() == f"intro\n{study_stage3.DOC_BEGIN}\nnew table\n{study_stage3.DOC_END}\noutro\n"
    doc.write_text("no markers")
    with pytest.raises(study_stage3.StudyError, match="markers"):
        study_stage3._update_doc(doc, "x")


def test_eval_settings_argv_synthesized_or_carried_scenes():
    from study.runner import EvalSettings

    carried = EvalSettings(episodes=4, max_steps=16, seed=7).argv(Path("/s"))
    assert carried[:2] == ["--scenes", "/s"] and "--synthesize" not in carried and "--stop-gate" not in carried
    assert carried[carried.index("--execute-steps") + 1] == "8"  # the evaluator's own default: whole chunks
    drawn = EvalSettings(episodes=400, seed=2000, synthesize=40, level="two_rooms", goal_point="nearest",
                         execute_steps=3, stop_gate=True, workers=16).argv(Path("/s"))  # fmt: skip
    assert drawn[:6] == ["--synthesize", "40", "--level", "two_rooms", "--goal-point", "nearest"]
    assert "--scenes" not in drawn and drawn[-2:] == ["--stop-gate", "--no-progress"]
    flags = dict(zip(drawn[6:-2:2], drawn[7:-2:2], strict=True))
    assert flags["--episodes"] == "400" and flags["--seed"] == "2000" and flags["--execute-steps"] == "3"
    assert flags["--workers"] == "16"


def test_closed_loop_validation_table_separates_stops_just_short_of_the_goal():
    # Start: 4 episodes, 1 success, 2 premature STOPs at 0.8 m and 3.0 m, 1 timeout -> premature 0.50, within 1 m
    # 0.25. Run at step 40: premature STOPs at 0.6 and 0.9 m, 2 successes -> premature 0.50, within 1 m 0.50.
    def ep(success, premature, ne):
        return {"success": success, "premature_stop": premature, "ne": ne, "progress": 1.0, "path_length": 2.0,
                "collisions": 0}  # fmt: skip

    start = [ep(True, False, 0.2), ep(False, True, 0.8), ep(False, True, 3.0), ep(False, False, 2.0)]
    run = report.RunData("main_s1", "main", 1, [], None, {})
    run.validation[40] = [ep(True, False, 0.1), ep(True, False, 0.4), ep(False, True, 0.6), ep(False, True, 0.9)]
    rows = report.closed_loop_validation_table(report.StudyData([run], None, {}, start))
    assert rows[0][4:6] == ["premature STOP", "premature STOP <= 1 m"]
    assert rows[1][0] == "stage2 (start)" and rows[1][4:6] == ["0.50", "0.25"]
    assert rows[2][:2] == ["main_s1", "40"] and rows[2][3].startswith("0.500") and rows[2][4:6] == ["0.50", "0.50"]


def test_best_validated_step_by_hand_and_report_success_rate(tmp_path):
    from study.runner import StudyRunner, best_validated_step, validation_success_rate

    assert best_validated_step({50: 0.30, 100: 0.35, 150: 0.35}) == 150  # tie: the later step
    assert best_validated_step({50: 0.40, 100: 0.30}) == 50
    with pytest.raises(ValueError, match="no validated checkpoint"):
        best_validated_step({})
    report_path = tmp_path / "report.json"
    episodes = [{"episode_id": str(i), "success": ok} for i, ok in enumerate((True, False, True))]
    report_path.write_text(json.dumps({"runs": {"checkpoint": {"episodes": episodes}}}))
    assert validation_success_rate(report_path) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="needs val_settings"):
        StudyRunner(tmp_path / "r", [], tmp_path, tmp_path, None, 1, 1, 1.0, 1.0, select_by_validation=True)


def test_workspace_settings_refuse_bad_task_and_checkpoint(tmp_path):
    from study.workspace import WorkspaceSettings

    for kw, needle in (({"level": "castle"}, "WorkspaceSettings.level"),
                       ({"goal_point": "far"}, "WorkspaceSettings.goal_point"),
                       ({"behaviour_beta": 1.5}, "WorkspaceSettings.behaviour_beta"),
                       ({"behaviour_execute_steps": 0}, "WorkspaceSettings.behaviour_execute_steps"),
                       ({"stage2_checkpoint": str(tmp_path)}, "checkpoint_manifest.json"),
                       ({"prompt_event_share": "collision_precursor"}, "prompt_event_share"),
                       ({"prompt_event_share": "walls=0.5"}, "prompt_event_share"),
                       ({"prompt_event_share": "collision_precursor=1.5"}, "prompt_event_share")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            WorkspaceSettings(**kw)
    assert WorkspaceSettings(prompt_event_share="collision_precursor=0.25").prompt_event_share


def test_study_from_a_stage2_checkpoint_resumes_a_cut_off_training(tmp_path):
    """prepare --stage2-checkpoint: the checkpoint is copied in and drives the collection (collect_dagger.py);
    run --heldout-seed draws the evaluator's own held-out episodes, --val-episodes validates every saved
    checkpoint in closed loop during training; run --resume goes on with a training cut off after step 1 of 2
    (from its checkpoint, not from scratch) and keeps the finished Stage-II evaluation; report tabulates it."""
    import subprocess

    maker = [sys.executable, str(REPO / "tools/checkpoint/make_tiny_wnm_checkpoint.py")]
    ckpt = tmp_path / "stage2"
    subprocess.run([*maker, "--output-dir", str(ckpt), "--no-progress"], check=True, capture_output=True)
    study = [sys.executable, str(REPO / "scripts/study_stage3.py")]
    work = tmp_path / "w"
    prep = [*study, "prepare", "--workdir", str(work), "--stage2-checkpoint", str(ckpt), "--level", "one_room",
            "--goal-point", "nearest", "--face-goal-object", "--scenes", "2", "--episodes-per-scene", "3",
            "--train-size", "2", "--per-event", "1", "--heldout-scenes", "2", "--behaviour-max-steps", "64",
            "--behaviour-num-steps", "2", "--behaviour-beta", "0.8", "--workers", "2",
            "--prompt-event-share", "required_stop=0.5"]  # fmt: skip
    proc = subprocess.run(prep, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sampled = json.loads((work / "full" / "train" / "manifest.json").read_text())
    assert sampled["args"]["event_share"] == "required_stop=0.5" and "required_stop" in sampled["provenance"]["rule"]
    meta = json.loads((work / "full" / "collection" / "collection.json").read_text())
    assert meta["policy"]["type"] == "dagger" and meta["policy"]["beta"] == 0.8 and meta["level"] == "one_room"
    assert meta["dagger_summary"]["execute_steps"] == 3
    sha = json.loads((ckpt / "checkpoint_manifest.json").read_text())["files"]
    assert json.loads((work / "carry" / "ckpt" / "checkpoint_manifest.json").read_text())["files"] == sha

    run = [*study, "run", "--workdir", str(work), "--cpu", "--steps", "2", "--save-freq", "1", "--arms", "main",
           "--main-seeds", "1", "--heldout-seed", "2000", "--heldout-scenes", "2", "--eval-episodes", "2",
           "--eval-execute-steps", "3", "--val-episodes", "2", "--val-seed", "1000"]  # fmt: skip
    proc = subprocess.run(run, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = work / "results"
    log = (results / "evals" / "main_s1.log").read_text()
    assert "--synthesize 2 --level one_room --goal-point nearest" in log and "--execute-steps 3" in log
    assert "--seed 2000" in log
    stage2_report = results / "evals" / "stage2" / "report.json"
    stamp = stage2_report.stat().st_mtime_ns
    validation = json.loads((results / "status.json").read_text())["runs"]["main_s1"]["validation"]
    assert sorted(validation) == ["1", "2"] and all(v["state"] == "done" for v in validation.values())
    val_log = (results / "evals" / "val" / "main_s1" / "step_1.log").read_text()
    assert (
        "--seed 1000" in val_log
        and "--episodes 2" in val_log
        and "global_step_1" in (results / "runs" / "main_s1" / "val" / "step_1" / "export.log").read_text()
    )
    # The start itself on the validation episodes (step 0): the baseline of every run's validation rows.
    start_val = json.loads((results / "status.json").read_text())["runs"]["stage2"]["validation"]
    assert list(start_val) == ["0"] and start_val["0"]["state"] == "done"
    start_log = (results / "evals" / "val" / "stage2" / "step_0.log").read_text()
    assert "--seed 1000" in start_log and "--episodes 2" in start_log
    start_report = results / "evals" / "val" / "stage2" / "step_0" / "report.json"
    assert json.loads(start_report.read_text())["runs"]["checkpoint"]["checkpoint"]["path"].endswith("ckpt")
    start_stamp = start_report.stat().st_mtime_ns
    bad = [*run, "--results-name", "r2", "--val-seed", "2000"]
    bad = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--val-seed 2000" in bad.stderr and not (work / "r2").exists()

    # Cut off after step 1: the last checkpoint is step 1, nothing exported or evaluated, status "training".
    import shutil

    out = results / "runs" / "main_s1" / "out"
    shutil.rmtree(out / "global_step_2")
    (out / "latest_checkpointed_iteration.txt").write_text("1")
    shutil.rmtree(results / "runs" / "main_s1" / "export")
    status = json.loads((results / "status.json").read_text())
    status["runs"]["main_s1"] = {"state": "training", "output_dir": str(out)}
    (results / "status.json").write_text(json.dumps(status))
    again = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr  # never overwritten without --resume
    # The one-command form goes on from here: the workspace is reused, the results resumed, the report written.
    every = [*study, "all", *prep[3:], *run[3:], "--select-by-validation"]
    proc = subprocess.run(every, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== prepare: reusing the workspace" in proc.stdout and "== run (resuming)" in proc.stdout
    final = json.loads((results / "status.json").read_text())["runs"]
    assert final["main_s1"]["state"] == "done" and final["stage2"]["state"] == "done"
    assert "resumed from" in (results / "runs" / "main_s1" / "train.log").read_text()
    assert (out / "global_step_2").is_dir()
    assert stage2_report.stat().st_mtime_ns == stamp  # the finished evaluation was kept, not run again
    assert start_report.stat().st_mtime_ns == start_stamp  # and so was the start's validation
    assert len(list((results / "evals").glob("main_s1.cut-off-*"))) == 1  # the old evaluation, kept aside
    validation = final["main_s1"]["validation"]
    assert sorted(validation) == ["1", "2"] and all(v["state"] == "done" for v in validation.values())
    assert len(list((results / "evals" / "val" / "main_s1").glob("step_2.cut-off-*"))) == 1

    tables = (work / "report" / "tables.md").read_text()
    assert "Closed-loop validation during training" in tables and "| main_s1 | 2 | 2 |" in tables
    assert "| stage2 (start) | 0 | 2 |" in tables
    # --select-by-validation: the export is the checkpoint with the best validation SR (ties: the later one).
    rates = {}
    for step, entry in validation.items():
        episodes = json.loads(Path(entry["report"]).read_text())["runs"]["checkpoint"]["episodes"]
        rates[int(step)] = np.mean([bool(e["success"]) for e in episodes])
    best = max(rates, key=lambda k: (rates[k], k))
    assert final["main_s1"]["selected_step"] == best and f"exported step {best}" in tables
    assert f"global_step_{best}" in (results / "runs" / "main_s1" / "export.log").read_text()
    assert "premature STOP" in tables and "path length (m)" in tables  # the gaming signs beside SR
    assert (work / "report" / "closed_loop_validation.png").stat().st_size > 1000
    # Stage II beside main_s1 on the same held-out episodes, drawn from the evaluations' own trajectories.
    assert (work / "report" / "trajectories.png").stat().st_size > 1000 and "trajectories.png)" in tables


def test_premature_stop_distance_table_by_hand(tmp_path):
    """Premature STOPs binned by metres beyond the radius, read from reports whose specs carry the radius."""
    results = tmp_path / "results"
    # Radius 0.5 (from the specs) for the start, 0.3 from the argument for the run (an older report, no specs).
    # Start: STOPs ending 0.6 (0.1 beyond), 1.2 (0.7 beyond) and 2.5 m (2.0 beyond) from the goal, one success.
    # Run: STOPs ending 0.6 (0.3 beyond: still the first bin) and 0.9 m (0.6 beyond: second bin), one timeout.
    start = [(0.6, True), (1.2, True), (2.5, True), (0.2, False)]
    run = [(0.6, True), (0.9, True), (3.0, False), (0.1, False)]
    for name, ends, radius_in_specs in (("stage2", start, True), ("main_s1", run, False)):
        d = results / "evals" / name
        d.mkdir(parents=True)
        eps = [{"episode_id": f"e{i}", "ne": ne, "premature_stop": prem, "success": ne <= 0.5, "collisions": 0,
                "oracle_success": ne <= 0.5, "spl": 0.0}
               for i, (ne, prem) in enumerate(ends)]  # fmt: skip
        rep = {"format": "wnm-closed-loop-eval/1", "runs": {"checkpoint": {"episodes": eps}}}
        if radius_in_specs:
            rep["episodes"] = [{"episode_id": f"e{i}", "success_radius": 0.5} for i in range(len(ends))]
        else:
            rep["arguments"] = {"success_radius": 0.3}
        (d / "report.json").write_text(json.dumps(rep))
    (results / "runs" / "main_s1" / "out").mkdir(parents=True)
    (results / "status.json").write_text(json.dumps({"runs": {"stage2": {}, "main_s1": {"state": "done"}}}))
    data = report.load_results(results)
    rows = report.premature_stop_distance_table(data)
    assert rows[0] == ["evaluation", "episodes", "0-0.5 m", "0.5-1.5 m", "> 1.5 m", "all premature STOPs"]
    assert rows[1:] == [["stage2", "4", "1", "1", "1", "3"], ["main_s1", "4", "1", "1", "0", "2"]]
    md = report.render_markdown(data, report.closed_loop_comparisons(data), [], "synthetic")
    assert "| main_s1 | 4 | 1 | 1 | 0 | 2 |" in md
