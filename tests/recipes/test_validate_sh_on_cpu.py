"""validate.sh end to end: the OK token on a synthesized workspace, and named failures without it.

Failures found in the environment stage run in about a second each (no checkpoint is opened); the cases
that need the checkpoints and data (several seconds of imports each) are in
test_validate_contract_cases_on_cpu.py, which runs the same Python entry point in-process.
"""

from __future__ import annotations

import pytest
from recipe_test_helpers import TRAIN_SIZE, copy_recipe, run_script, write_paths_env

TOKEN = "STAGE3_CONFIG_CONTRACT_OK"


def _assert_refused(proc, *messages: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert TOKEN not in out, out
    for m in messages:
        assert m in out, f"expected {m!r} in:\n{out}"


def test_validate_ok_on_workspace_and_environment_wins(stage3_workspace, tmp_path):
    out_dir = tmp_path / "run"
    env_file = write_paths_env(tmp_path / "paths.env", stage3_workspace.paths_env(out_dir))
    proc = run_script("validate.sh", env_file, env={"WAM_TOTAL_STEPS": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == TOKEN
    # 16 rollouts x P=2 prompts over 2 CPU workers; P divides the 2 training rows.
    assert "prompt batch P = 2 -> 32 rollouts/step, 16 per rank" in proc.stdout
    assert "taken from the environment instead of paths.env: WAM_TOTAL_STEPS" in proc.stdout
    assert not out_dir.exists(), "validate.sh must not create the output directory"


REQUIRED = [
    "WNM3D_INITIAL_CHECKPOINT",
    "WAM_DATA_CONTRACT_CHECKPOINT",
    "WAM_DATA_ROOT",
    "WAM_EVENT_VAL_FILE",
    "WAM_EXPECTED_TRAIN_SIZE",
    "WAM_VAL_MAX_SAMPLES",
    "WAM_OUTPUT_DIR",
]


@pytest.mark.parametrize("var", REQUIRED)
def test_validate_missing_variable(stage3_workspace, tmp_path, var):
    values = stage3_workspace.paths_env(tmp_path / "run")
    values[var] = None
    proc = run_script("validate.sh", write_paths_env(tmp_path / "paths.env", values))
    _assert_refused(proc, f"{var} is not set", str(tmp_path / "paths.env"))


def _vllm_omni_installed() -> bool:
    from verl_omni.pipelines.wnm_vllm_omni.extra import vllm_omni_available

    return vllm_omni_available()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"WAM_DATA_ROOT": "/nonexistent/stage3-train"}, "WAM_DATA_ROOT=/nonexistent/stage3-train does not exist"),
        ({"WNM_VAE_SOURCE": "/nonexistent/vae"}, "WNM_VAE_SOURCE=/nonexistent/vae does not exist"),
        ({"WAM_TOTAL_STEPS": "ten"}, "WAM_TOTAL_STEPS='ten' is not an integer"),
        ({"WAM_EXPECTED_TRAIN_SIZE": "0"}, "WAM_EXPECTED_TRAIN_SIZE=0 must be >= 1"),
        ({"WAM_ROLLOUT_BACKEND": "tensorrt"}, "WAM_ROLLOUT_BACKEND='tensorrt' must be one of"),
        pytest.param(
            {"WAM_ROLLOUT_BACKEND": "vllm_omni"},
            "WAM_ROLLOUT_BACKEND=vllm_omni needs the 'vllm-omni' extra",
            marks=pytest.mark.skipif(_vllm_omni_installed(), reason="the vllm-omni extra is installed here"),
        ),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK=2 must be < NNODES=2"),
        ({"NNODES": "2"}, "MASTER_ADDR is not set but NNODES=2"),
        ({"WAM_NETWORK_INTERFACE": "nosuchif0"}, "WAM_NETWORK_INTERFACE=nosuchif0 does not exist on this machine"),
        ({"WAM_REPLACE_EXISTING_RAY": "maybe"}, "WAM_REPLACE_EXISTING_RAY='maybe' must be true or false"),
    ],
)
def test_validate_bad_values(stage3_workspace, tmp_path, overrides, message):
    values = stage3_workspace.paths_env(tmp_path / "run")
    values.update(overrides)
    proc = run_script("validate.sh", write_paths_env(tmp_path / "paths.env", values))
    _assert_refused(proc, message)


def test_validate_missing_paths_env(tmp_path):
    proc = run_script("validate.sh", tmp_path / "absent.env")
    _assert_refused(proc, f"WAM_PATHS_ENV={tmp_path / 'absent.env'} does not exist")


def test_validate_refuses_arguments(tmp_path):
    proc = run_script("validate.sh", tmp_path / "absent.env", "rollout.strata=8")
    _assert_refused(proc, "validate.sh takes no arguments")


def test_validate_topology_that_cannot_divide(stage3_workspace, tmp_path):
    # 3 CPU workers: prompt batches must be multiples of 3, none divides the 2 training rows.
    values = stage3_workspace.paths_env(tmp_path / "run")
    values["WAM_CPU_WORKERS"] = "3"
    proc = run_script("validate.sh", write_paths_env(tmp_path / "paths.env", values))
    _assert_refused(proc, "WAM_CPU_WORKERS", "topology cannot divide", f"divide the {TRAIN_SIZE} training rows")


def test_validate_changed_locked_constant(stage3_workspace, tmp_path):
    recipe = copy_recipe(tmp_path / "repo")
    locked = recipe / "config" / "locked.yaml"
    text = locked.read_text()
    assert "  strata: 4\n" in text
    locked.write_text(text.replace("  strata: 4\n", "  strata: 8\n"))
    values = stage3_workspace.paths_env(tmp_path / "run")
    proc = run_script(recipe / "validate.sh", write_paths_env(tmp_path / "paths.env", values))
    _assert_refused(proc, "locked constant rollout.strata is 8", "requires 4", str(locked))
