"""A configured ``model.variant`` that is not the initial checkpoint's is refused by the driver (before Ray and
before anything is written) and by the contract check, naming both values, the file and the config field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from stage3_e2e_helpers import set_recipe_env

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMModel, save_wnm_checkpoint
from verl_omni.trainer.config import ConfigError, trainer_config_from_dict
from verl_omni.trainer.contract_check import check_config
from verl_omni.trainer.contract_env import Report, Settings
from verl_omni.trainer.ray_trainer import Stage3Trainer

torch.set_num_threads(1)
CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes" / "wnm_3d" / "stage3" / "config"
NORM = ActionNormalization(mean=(0.0, 0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0, 1.0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for variant in ("wnm_3d", "wnm_2d"):
        torch.manual_seed(0)
        model = WNMModel(WNMConfig.from_size("tiny", variant=variant, num_layers=1), NORM)
        out[variant] = save_wnm_checkpoint(model, root / variant, {"run": "test"})
    return out


def _config(ckpt: Path, out: Path, variant: str):
    return trainer_config_from_dict(
        {
            "model": {"initial_checkpoint": str(ckpt), "data_contract_checkpoint": str(ckpt), "variant": variant},
            "data": {"train_root": str(out.parent / "no_data"), "expected_train_size": 8},
            "trainer": {"output_dir": str(out)},
            "topology": {
                "cpu_workers_per_node": 2,
                "prompts_per_step": 2,
                "ppo_mini_batch_prompts": 1,
                "micro_batch_rollouts": 4,
            },
        }
    )


@pytest.mark.parametrize(("configured", "found"), [("wnm_3d", "wnm_2d"), ("wnm_2d", "wnm_3d")])
def test_driver_refuses_a_checkpoint_of_the_other_variant_before_anything_runs(
    checkpoints, tmp_path, configured, found
):
    import ray

    out = tmp_path / "out"
    trainer = Stage3Trainer(_config(checkpoints[found], out, configured))
    with pytest.raises(ConfigError) as e:
        trainer.fit()
    assert str(e.value) == (
        f"model.variant is {configured!r} but the checkpoint {checkpoints[found] / 'config.json'} has "
        f"model_config.variant {found!r}: set model.variant: {found} to train this checkpoint, or start from a "
        f"{configured} checkpoint"
    )
    assert not out.exists() and not ray.is_initialized()  # nothing written, no Ray started


def test_contract_check_refuses_a_wnm_2d_checkpoint_for_the_wnm_3d_recipe(checkpoints, monkeypatch, tmp_path):
    ckpt = checkpoints["wnm_2d"]
    env = set_recipe_env(monkeypatch, tmp_path, ckpt)
    report = Report()
    settings = Settings(paths={"WNM3D_INITIAL_CHECKPOINT": ckpt}, ints={"WAM_EXPECTED_TRAIN_SIZE": 24})
    assert check_config(settings, env, CONFIG_DIR, report) is None
    locked = CONFIG_DIR / "locked.yaml"
    assert report.failures == [
        (
            "WNM3D_INITIAL_CHECKPOINT",
            f"WNM3D_INITIAL_CHECKPOINT={ckpt}: model.variant (in {locked}) is 'wnm_3d' but the checkpoint "
            f"{ckpt / 'config.json'} has model_config.variant 'wnm_2d': recipe wnm-3d-stage3-navigation-grpo-r1 "
            "trains wnm_3d checkpoints; start from a wnm_3d checkpoint",
        )
    ]


def test_contract_check_accepts_a_wnm_3d_checkpoint_for_the_wnm_3d_recipe(checkpoints, monkeypatch, tmp_path):
    ckpt = checkpoints["wnm_3d"]
    env = set_recipe_env(monkeypatch, tmp_path, ckpt)
    report = Report()
    settings = Settings(paths={"WNM3D_INITIAL_CHECKPOINT": ckpt}, ints={"WAM_EXPECTED_TRAIN_SIZE": 24})
    assert check_config(settings, env, CONFIG_DIR, report) is not None and report.success, report.failures
    assert "variant: the initial checkpoint is a wnm_3d checkpoint (model.variant)" in report.passed
