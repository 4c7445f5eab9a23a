"""The recipe's files: Hydra sources complete and documented, generated config fresh, scripts parse."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml
from recipe_test_helpers import CONFIG_DIR, RECIPE, REPO

from verl_omni.trainer.config import Stage3Config
from verl_omni.trainer.contract_check import compose_recipe
from verl_omni.trainer.locked_recipe import canonical_problems, flatten, locked_constant_problems, locked_constants

KEY_LINE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*:\s*\S")  # a field with a value on the same line


def _schema_fields(cls, prefix=""):
    """Dotted names of every leaf field of the config dataclasses (dict-valued fields are leaves)."""
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += _schema_fields(type(default), path + ".")
        else:
            out.append(path)
    return out


def test_recipe_locked_yaml_is_the_published_one():
    locked = yaml.safe_load((CONFIG_DIR / "locked.yaml").read_text())
    assert locked_constant_problems(locked, str(CONFIG_DIR / "locked.yaml")) == []
    assert flatten(locked) == locked_constants() and canonical_problems() == []


def test_recipe_sets_every_schema_field():
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(compose_recipe(CONFIG_DIR, []), resolve=False)
    keys = set(flatten(tree))
    dict_fields = {"algorithm.layer_weights", "reward.reward_set"}
    covered = keys | {k for k in dict_fields if any(x.startswith(k + ".") for x in keys)}
    missing = [name for name in _schema_fields(Stage3Config) if name not in covered]
    assert missing == []


@pytest.mark.parametrize("name", ["stage3.yaml", "locked.yaml"])
def test_every_yaml_field_has_a_comment_above(name):
    lines = (CONFIG_DIR / name).read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if KEY_LINE.match(line) and not line.lstrip().startswith(("-", "#")):
            prev = lines[i - 1].strip() if i else ""
            if not prev.startswith("#"):
                undocumented.append(f"{name}:{i + 1}: {line.strip()}")
    assert undocumented == []


def test_paths_env_example_documents_every_variable():
    lines = (RECIPE / "paths.env.example").read_text().splitlines()
    names = []
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Z][A-Z0-9_]*)=", line)
        if m:
            names.append(m.group(1))
            assert lines[i - 1].startswith("#"), f"paths.env.example:{i + 1}: {m.group(1)} has no comment above"
    design = [
        "WNM3D_SOURCE_ROOT",
        "WNM3D_INITIAL_CHECKPOINT",
        "WAM_DATA_CONTRACT_CHECKPOINT",
        "WNM_TOKENIZER_SOURCE",
        "WNM_TEXT_ENCODER_SOURCE",
        "WNM_IMAGE_ENCODER_SOURCE",
        "WNM_VAE_SOURCE",
        "WNM_VGGT_SOURCE",
        "WAM_DATA_ROOT",
        "WAM_EVENT_VAL_FILE",
        "WAM_EXPECTED_TRAIN_SIZE",
        "WAM_VAL_MAX_SAMPLES",
        "WAM_OUTPUT_DIR",
        "WAM_REPLACE_EXISTING_RAY",
        "WAM_TOTAL_STEPS",
        "WAM_SAVE_FREQ",
        "WAM_VAL_FREQ",
        "WAM_ROLLOUT_BACKEND",
        "WAM_CPU_WORKERS",
        "WAM_REWARD_WORKERS",
        "WAM_NETWORK_INTERFACE",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "RAY_PORT",
        "NNODES",
        "NODE_RANK",
        "MASTER_ADDR",
        "WAM_RESUME_OVERRIDE",
    ]
    assert [n for n in design if n not in names] == []


def test_paths_env_is_git_ignored():
    proc = subprocess.run(["git", "check-ignore", "-q", "recipes/wnm_3d/stage3/paths.env"], cwd=REPO)
    assert proc.returncode == 0


def test_generated_trainer_config_is_fresh(tmp_path):
    out = tmp_path / "stage3_trainer.yaml"
    proc = subprocess.run(
        ["bash", "scripts/generate_trainer_config.sh", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "WNM_PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    committed = RECIPE / "generated" / "stage3_trainer.yaml"
    assert out.read_text() == committed.read_text(), "stale: run bash scripts/generate_trainer_config.sh"


def test_shell_scripts_parse():
    scripts = sorted(RECIPE.glob("*.sh")) + [REPO / "scripts" / "generate_trainer_config.sh"]
    assert {p.name for p in scripts} >= {"validate.sh", "launch.sh", "_common.sh", "generate_trainer_config.sh"}
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
