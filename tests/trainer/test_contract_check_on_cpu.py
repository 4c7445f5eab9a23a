"""Pure parts of the contract check: flattening, locked-constant comparison, variable parsing, environment."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from verl_omni.trainer import locked_recipe
from verl_omni.trainer.contract_check import check_config
from verl_omni.trainer.contract_env import Report, Settings, check_environment, parse_bool, parse_int
from verl_omni.trainer.locked_recipe import (
    LOCKED_PATH,
    canonical_problems,
    fingerprint,
    flatten,
    locked_constant_problems,
    read_locked_file,
)

LOCKED = read_locked_file(LOCKED_PATH)


def test_flatten_nested_mapping():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": None}
    # The one flatten of the locked check and the run provenance: an empty mapping (a reward module with its
    # defaults) is a leaf, and tuples read as the lists JSON gives back.
    assert flatten({"rewards": {"navigation": {}, "stop": {"weight": 1.0}}, "betas": (0.9, 0.999)}) == {
        "rewards.navigation": {},
        "rewards.stop.weight": 1.0,
        "betas": [0.9, 0.999],
    }


def test_locked_file_has_16_rollouts_and_9_layers():
    rollout = LOCKED["rollout"]
    assert rollout["strata"] * rollout["branches"] == 16
    assert len(LOCKED["algorithm"]["layers"]) == 9
    assert sorted(LOCKED["reward"]["reward_set"]["rewards"]) == [
        "collision",
        "navigation",
        "stop",
        "vision",
        "yaw",
    ]


def test_locked_constant_problems_names_each_change():
    tree = copy.deepcopy(LOCKED)
    assert locked_constant_problems(tree, "x/locked.yaml") == []
    tree["rollout"]["window"]["size"] = 3
    tree["algorithm"]["layer_weights"]["stop_4"] = 2.0
    del tree["actor"]["lr"]
    tree["algorithm"]["extra"] = 1
    problems = locked_constant_problems(tree, "x/locked.yaml")
    assert len(problems) == 4
    joined = "\n".join(problems)
    assert "rollout.window.size is 3" in joined and "requires 2" in joined
    assert "algorithm.layer_weights.stop_4 is 2.0" in joined
    assert "actor.lr is missing" in joined
    assert "algorithm.extra is not a locked constant" in joined
    # In a composed config, keys outside the locked set are fine; booleans are not numbers.
    tree = copy.deepcopy(LOCKED)
    tree["trainer"] = {"total_steps": 5}
    assert locked_constant_problems(tree, "composed") == []
    tree["rollout"]["shared_initial_noise"] = 1
    assert "rollout.shared_initial_noise is 1" in locked_constant_problems(tree, "composed")[0]
    tree = copy.deepcopy(LOCKED)
    tree["rollout"]["strata"] = 4.0  # YAML 4.0 == 4
    assert locked_constant_problems(tree, "composed") == []


def test_repository_locked_file_matches_its_published_fingerprint():
    assert canonical_problems() == []
    # Key order does not matter; a value does.
    assert fingerprint(dict(reversed(list(LOCKED.items())))) == fingerprint(LOCKED)
    changed = copy.deepcopy(LOCKED)
    changed["algorithm"]["clip_eps"] = 0.2
    assert fingerprint(changed) != fingerprint(LOCKED)


@pytest.fixture
def edited_repository_file(monkeypatch, tmp_path):
    """The repository's locked.yaml edited in place (here: a copy that the module is pointed at)."""

    def edit(old: str, new: str):
        path = tmp_path / "locked.yaml"
        path.write_text(LOCKED_PATH.read_text().replace(old, new))
        monkeypatch.setattr(locked_recipe, "LOCKED_PATH", path)
        locked_recipe._canonical.cache_clear()
        return path

    yield edit
    locked_recipe._canonical.cache_clear()


def test_in_place_edit_of_the_repository_file_is_refused(edited_repository_file):
    # A copied recipe compares equal to an edited source, so only the fingerprint sees this edit.
    path = edited_repository_file("  clip_eps: 1.0e-4\n", "  clip_eps: 0.2\n")
    assert locked_constant_problems(read_locked_file(path), str(path)) == []
    (problem,) = canonical_problems()
    assert "differ from the published recipe wnm-3d-stage3-navigation-grpo-r1" in problem
    path = edited_repository_file("recipe: wnm-3d-stage3-navigation-grpo-r1", "recipe: my-recipe")
    assert "recipe 'my-recipe' is not a published recipe" in canonical_problems()[0]


def test_parse_int_and_bool():
    assert parse_int({"X": "12"}, "X", 1, None) == (12, None)
    assert parse_int({}, "X", 1, 7) == (7, None)
    assert parse_int({"X": " "}, "X", 1, None) == (None, "X is not set")
    assert parse_int({"X": "1.5"}, "X", 1, None) == (None, "X='1.5' is not an integer")
    assert parse_int({"X": "-1"}, "X", 0, None) == (None, "X=-1 must be >= 0")
    assert parse_bool({"B": "true"}, "B") == (True, None)
    assert parse_bool({}, "B") == (False, None)
    assert parse_bool({"B": "sure"}, "B") == (False, "B='sure' must be true or false")


def test_check_environment_reports_every_problem(tmp_path):
    report = Report()
    env = {
        "WNM3D_INITIAL_CHECKPOINT": str(tmp_path),
        "WAM_DATA_ROOT": str(tmp_path / "absent"),
        "WAM_EXPECTED_TRAIN_SIZE": "x",
        "WAM_VAL_MAX_SAMPLES": "0",
        "WAM_OUTPUT_DIR": str(tmp_path / "new" / "run"),
        "WAM_GPUS_PER_NODE": "0",
        "NNODES": "3",
        "NODE_RANK": "1",
    }
    settings = check_environment(env, report, "my/paths.env")
    subjects = [s for s, _ in report.failures]
    assert subjects == [
        "WAM_DATA_CONTRACT_CHECKPOINT",
        "WAM_DATA_ROOT",
        "WAM_EVENT_VAL_FILE",
        "WAM_EXPECTED_TRAIN_SIZE",
        "MASTER_ADDR",
    ]
    messages = dict(report.failures)
    assert messages["WAM_DATA_CONTRACT_CHECKPOINT"].startswith(
        "WAM_DATA_CONTRACT_CHECKPOINT is not set: set it in my/paths.env"
    )
    assert "does not exist" in messages["WAM_DATA_ROOT"]
    assert settings.output_dir == tmp_path / "new" / "run" and not (tmp_path / "new").exists()
    assert settings.ints["WAM_TOTAL_STEPS"] == 1000 and settings.ints["WAM_VAL_MAX_SAMPLES"] == 0
    assert not report.success


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    report = Report()
    (tmp_path / "f").write_text("x")
    check_environment({"WAM_OUTPUT_DIR": str(tmp_path / "f")}, report, "")
    assert any(s == "WAM_OUTPUT_DIR" and "is not a directory" in m for s, m in report.failures)


def test_vllm_omni_backend_without_the_extra_is_refused(monkeypatch):
    from verl_omni.pipelines.wnm_vllm_omni import extra

    monkeypatch.setattr(extra, "REQUIRED_MODULES", {"vllm": "no_such_vllm", "vllm-omni": "no_such_vllm_omni"})
    report = Report()
    settings = check_environment({"WAM_ROLLOUT_BACKEND": "vllm_omni"}, report, "")
    messages = dict(report.failures)
    assert settings.backend == "vllm_omni"
    msg = messages["WAM_ROLLOUT_BACKEND"]
    assert "WAM_ROLLOUT_BACKEND=vllm_omni needs the 'vllm-omni' extra" in msg
    assert extra.INSTALL_COMMAND in msg and "rollout.backend=native" in msg
    report = Report()
    check_environment({"WAM_ROLLOUT_BACKEND": "native"}, report, "")
    assert "WAM_ROLLOUT_BACKEND" not in dict(report.failures)


def test_attention_backend_is_checked_before_ray_starts(monkeypatch):
    from verl_omni.models.wnm import flash_attention4

    report = Report()
    check_environment({"WAM_ATTENTION_BACKEND": "flash3"}, report, "")
    assert "must be one of default, cudnn, fa4" in dict(report.failures)["WAM_ATTENTION_BACKEND"]
    # fa4 on GPUs without an importable FlashAttention-4: refused by name, with the install command.
    missing = f"{flash_attention4.FA4_INSTALL_HINT}; import failed with: No module named 'flash_attn'"
    monkeypatch.setattr(flash_attention4, "fa4_import_problem", lambda: missing)
    report = Report()
    check_environment({"WAM_ATTENTION_BACKEND": "fa4", "WAM_GPUS_PER_NODE": "1"}, report, "")
    msg = dict(report.failures)["WAM_ATTENTION_BACKEND"]
    assert "WAM_ATTENTION_BACKEND=fa4" in msg and "pip install flash-attn-4" in msg
    assert "No module named 'flash_attn'" in msg  # the import's own error, not only the hint
    # An empty GPU count means "detect at launch", so GPUs are assumed and the package is required.
    report = Report()
    check_environment({"WAM_ATTENTION_BACKEND": "fa4", "WAM_GPUS_PER_NODE": ""}, report, "")
    assert "WAM_ATTENTION_BACKEND=fa4 but FlashAttention-4" in dict(report.failures)["WAM_ATTENTION_BACKEND"]
    # Without GPUs it only notes that the default kernel runs; installed, it passes.
    report = Report()
    check_environment({"WAM_ATTENTION_BACKEND": "fa4", "WAM_GPUS_PER_NODE": "0"}, report, "")
    assert "WAM_ATTENTION_BACKEND" not in dict(report.failures)
    assert any("WAM_ATTENTION_BACKEND=fa4 has no effect without GPUs" in n for n in report.notes)
    monkeypatch.setattr(flash_attention4, "fa4_import_problem", lambda: None)
    for value in ("fa4", "cudnn", "default", ""):
        report = Report()
        check_environment({"WAM_ATTENTION_BACKEND": value, "WAM_GPUS_PER_NODE": "1"}, report, "")
        assert "WAM_ATTENTION_BACKEND" not in dict(report.failures), value


def test_the_removed_fa4_tile_variable_is_noted_not_ignored():
    report = Report()
    check_environment({"WAM_FA4_FORWARD_TILE": "fit", "WAM_ATTENTION_BACKEND": "cudnn"}, report, "")
    assert "WAM_FA4_FORWARD_TILE" not in dict(report.failures)
    assert any("WAM_FA4_FORWARD_TILE is no longer read" in n for n in report.notes)
    report = Report()
    check_environment({"WAM_FA4_FORWARD_TILE": "", "WAM_ATTENTION_BACKEND": "cudnn"}, report, "")
    assert not any("WAM_FA4_FORWARD_TILE" in n for n in report.notes)


def test_gpu_plan_of_recipe_defaults_matches_rollout_and_update_shapes(monkeypatch, tmp_path):
    # 1 node x 8 GPUs: 8 prompts x 16 rollouts, mini-batch 8 prompts -> 16 rollouts per rank; micro 16 (recipe
    # target) equals the rollout's 16 per DiT call, so the recomputed bf16 log-probs use the rollout's shape.
    env = {
        "WNM3D_INITIAL_CHECKPOINT": str(tmp_path),
        "WAM_DATA_CONTRACT_CHECKPOINT": str(tmp_path),
        "WAM_DATA_ROOT": str(tmp_path),
        "WAM_EVENT_VAL_FILE": str(tmp_path / "v.parquet"),
        "WAM_EXPECTED_TRAIN_SIZE": "1024",
        "WAM_VAL_MAX_SAMPLES": "8",
        "WAM_OUTPUT_DIR": str(tmp_path / "out"),
        "WAM_GPUS_PER_NODE": "8",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    report = Report()
    config_dir = Path(__file__).resolve().parents[2] / "recipes" / "wnm_3d" / "stage3" / "config"
    plan = check_config(Settings(ints={"WAM_EXPECTED_TRAIN_SIZE": 1024}), env, config_dir, report)
    assert plan is not None and report.success, report.failures
    # The recipe's defaults match the shapes (micro-batch 16 = rollout chunk 16): no note.
    assert plan.resolved["topology"]["micro_batch_rollouts"] == 16
    assert not [n for n in report.notes if "rollout.micro_batch_size=16" in n]
