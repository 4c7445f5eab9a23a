"""Session fixtures shared by the end-to-end CPU tests.

``stage3_workspace`` builds a small but complete workspace with the real user commands (synthesize ->
tiny checkpoint -> convert -> sample -> event val); ``trained_run`` trains it for 2 steps through Ray with
2 CPU actor workers and 1 reward worker. Both are built once per test session.
"""

from __future__ import annotations

import pytest
from stage3_e2e_helpers import build_workspace, run_cli, write_trainer_config


@pytest.fixture(scope="session")
def stage3_workspace(tmp_path_factory) -> dict:
    return build_workspace(tmp_path_factory.mktemp("stage3_ws"))


@pytest.fixture(scope="session")
def trained_run(stage3_workspace, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stage3_run")
    cfg_dir = root / "config"
    out = root / "out"
    write_trainer_config(cfg_dir / "run.yaml", stage3_workspace, out)
    proc = run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"], timeout=900
    )
    return {
        "output_dir": out,
        "config_dir": cfg_dir,
        "config_name": "run",
        "workspace": stage3_workspace,
        "stdout": proc.stdout,
    }
