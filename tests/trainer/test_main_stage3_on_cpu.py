"""The driver's entry point resolves the recipe's topology itself, to the counts the contract check resolves."""

from __future__ import annotations

from pathlib import Path

from stage3_e2e_helpers import set_recipe_env

from verl_omni.trainer import main_stage3, ray_trainer
from verl_omni.trainer.contract_check import check_config
from verl_omni.trainer.contract_env import Report, Settings

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes" / "wnm_3d" / "stage3" / "config"


def test_driver_and_contract_check_resolve_the_same_topology(monkeypatch, tmp_path, capsys):
    env = set_recipe_env(monkeypatch, tmp_path, tmp_path)
    seen = {}

    def fake_run(cfg, snapshot):
        seen["cfg"], seen["snapshot"] = cfg, snapshot
        return 0

    monkeypatch.setattr(ray_trainer, "run", fake_run)
    assert main_stage3.main(["--config-path", str(CONFIG_DIR), "--config-name", "stage3"]) == 0
    # Recipe targets P = 8, M = 8, micro 16 on 3 CPU ranks and 24 rows: q = 3 / gcd(16, 3) = 3, so P = 6
    # (multiples of 3 dividing 24: 3, 6, 12, 24), M = 6, 16 x 6 / 3 = 32 per rank -> micro 16.
    topo = seen["cfg"].topology
    assert (topo.world_size, topo.prompts_per_step, topo.ppo_mini_batch_prompts, topo.micro_batch_rollouts) == (
        3,
        6,
        6,
        16,
    )
    assert seen["snapshot"]["topology"]["prompts_per_step"] == 6
    out = capsys.readouterr().out
    assert "prompt batch P = 6 -> 96 rollouts/step" in out and "prompt batch target 8 adjusted to 6" in out

    report = Report()
    plan = check_config(Settings(ints={"WAM_EXPECTED_TRAIN_SIZE": 24}), env, CONFIG_DIR, report)
    assert plan is not None and report.success, report.failures
    assert plan.resolved["topology"] == seen["snapshot"]["topology"]
    assert plan.topology_text in out


def test_driver_refuses_a_topology_that_cannot_divide(monkeypatch, tmp_path, capsys):
    for k, v in {
        "WNM3D_INITIAL_CHECKPOINT": str(tmp_path),
        "WAM_DATA_CONTRACT_CHECKPOINT": str(tmp_path),
        "WAM_DATA_ROOT": str(tmp_path),
        "WAM_EVENT_VAL_FILE": str(tmp_path / "v.parquet"),
        "WAM_EXPECTED_TRAIN_SIZE": "25",  # 3 ranks need a prompt batch that is a multiple of 3
        "WAM_VAL_MAX_SAMPLES": "4",
        "WAM_OUTPUT_DIR": str(tmp_path / "out"),
        "WAM_GPUS_PER_NODE": "0",
        "WAM_CPU_WORKERS": "3",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ray_trainer, "run", lambda cfg, snapshot: 99)
    assert main_stage3.main(["--config-path", str(CONFIG_DIR), "--config-name", "stage3"]) == 2
    assert "topology cannot divide" in capsys.readouterr().err
