"""Session fixtures shared by the end-to-end CPU tests.

``stage3_workspace`` builds a small but complete workspace with the real user commands (synthesize ->
tiny checkpoint -> convert -> sample -> event val); ``trained_run`` trains it for 2 steps through Ray with
2 CPU actor workers and 1 reward worker. Both are built once per test session.

``scripts/test.sh`` runs the CPU suite on two pytest-xdist workers (``--dist loadgroup``). The tests that start
a Ray runtime, and those that use the Stage-III session fixtures, all go to one worker, one after another (the
``ray`` group, :func:`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

from pathlib import Path

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


TESTS = Path(__file__).resolve().parent
# Modules whose tests start a Ray runtime (the trainer through ``main_stage3``, the study runner or the quickstart;
# launch.sh; a Ray head of their own) or use the Stage-III session fixtures. launch.sh refuses to start while any
# Ray runtime runs on the machine (its safety check would see the other xdist worker's), and a session fixture is
# built once per worker, so these modules all run on one worker, one test after another.
RAY_MODULES = frozenset(
    {
        "recipes/test_launch_sh_on_cpu.py",
        "recipes/test_validate_contract_cases_on_cpu.py",
        "recipes/test_validate_sh_on_cpu.py",
        "scripts/test_quickstart_smallest_on_cpu.py",
        "scripts/test_study_stage3_on_cpu.py",
        "tools/test_export_wnm_checkpoint_on_cpu.py",
        "tools/test_hot_save_on_cpu.py",
        "trainer/test_checkpoint_integrity_on_cpu.py",
        "trainer/test_stage3_trainer_e2e_on_cpu.py",
        "trainer/test_stage3_wnm_2d_on_cpu.py",
        "trainer/test_variant_check_on_cpu.py",
    }
)
SESSION_FIXTURES = frozenset({"stage3_workspace", "trained_run"})


def _module(nodeid: str) -> str:
    """``tests/a/test_b.py::test_c[x]`` -> ``a/test_b.py``."""
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_configure(config):
    missing = sorted(m for m in RAY_MODULES if not (TESTS / m).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py RAY_MODULES names test files that do not exist: {missing}")
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with xdist loaded (-p no:xdist drops it)
        config.pluginmanager.register(_RayGroupPlugin(), "wnm_ray_group")


def pytest_itemcollected(item):
    """Refuses a user of a Stage-III session fixture outside RAY_MODULES (it would build the fixture again on the
    other worker, or start Ray beside the group)."""
    uses = SESSION_FIXTURES & set(getattr(item, "fixturenames", ()))
    if uses and _module(item.nodeid) not in RAY_MODULES:
        raise pytest.UsageError(f"{item.nodeid} uses {sorted(uses)}: add its module to tests/conftest.py RAY_MODULES")


class _RayGroupPlugin:
    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """``--dist loadgroup`` (scripts/test.sh): the RAY_MODULES tests form one work unit, every other test its
        own.

        Why not xdist's own ``xdist_group`` markers: with pytest 9.2 and pytest-xdist 3.8 (the newest release) the
        marked tests were still spread over both workers here. This is xdist's scope scheduler with the grouping
        decided from the test id. xdist hands out the largest unit first, so the Ray group starts at once.
        """
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class RayGroupScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return "ray" if _module(nodeid) in RAY_MODULES else nodeid

        return RayGroupScheduling(config, log)
