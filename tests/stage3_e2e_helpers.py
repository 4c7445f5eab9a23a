"""Helpers of the end-to-end CPU tests (building workspaces and trainer configs with the real commands).

``stage3_workspace`` builds a small but complete workspace with the real user commands (synthesize ->
tiny checkpoint -> convert -> sample -> event val); ``trained_run`` trains it for 2 steps through Ray with
2 CPU actor workers and 1 reward worker. Both are built once per test session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """Imports ``scripts/<name>.py``, or the repository file ``name`` when it ends in ``.py``, as a module.

    ``scripts/`` goes on sys.path first, for the scripts' sibling imports. The module is named after the file stem.
    """
    import importlib.util

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    path = REPO / name if name.endswith(".py") else REPO / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses and pickling look their module up by name.
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


TRAIN_SIZE = 8

# Smallest plan that still exercises everything: 1 prompt (16 rollouts over 2 ranks), 3 denoising steps.
SMALLEST_PLAN = {
    "trainer.val_freq": 0,
    "trainer.log_media_freq": 0,
    "topology.prompts_per_step": 1,
    "topology.ppo_mini_batch_prompts": 1,
    "topology.micro_batch_rollouts": 8,
    "rollout.num_steps": 3,
    "rollout.window.range": [0, 2],
    "rollout.window.size": 1,
}


def set_recipe_env(monkeypatch, tmp_path: Path, checkpoint: Path, **extra: str) -> dict:
    """The launch variables of a 3-CPU-worker recipe run on ``tmp_path``, set with ``monkeypatch``."""
    env = {
        "WNM3D_INITIAL_CHECKPOINT": str(checkpoint),
        "WAM_DATA_CONTRACT_CHECKPOINT": str(checkpoint),
        "WAM_DATA_ROOT": str(tmp_path),
        "WAM_EVENT_VAL_FILE": str(tmp_path / "v.parquet"),
        "WAM_EXPECTED_TRAIN_SIZE": "24",
        "WAM_VAL_MAX_SAMPLES": "4",
        "WAM_OUTPUT_DIR": str(tmp_path / "out"),
        "WAM_GPUS_PER_NODE": "0",
        "WAM_CPU_WORKERS": "3",
        **extra,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def run_cli(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a repo command with this interpreter; fails the test with its output when it fails."""
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def build_workspace(
    root: Path,
    *,
    scenes: int = 3,
    episodes: int = 4,
    seed: int = 3,
    train_size: int = TRAIN_SIZE,
    sft_steps: int = 0,
    size: str = "tiny",
    variant: str = "wnm_3d",
    image_size: int = 64,
    workers: int = 1,
    ckpt_overrides: tuple[str, ...] = (),
) -> dict:
    """Synthesized collection + a ``size`` ``variant`` checkpoint + converted/sampled/event-val data under ``root``."""
    ws = {k: root / k for k in ("collection", "scenes", "ckpt", "converted", "train", "eventval")}
    run_cli(
        [
            "tools/data/synthesize_gn0_collection.py",
            "--output-dir",
            str(ws["collection"]),
            "--occupancy-dir",
            str(ws["scenes"]),
            "--num-scenes",
            str(scenes),
            "--episodes-per-scene",
            str(episodes),
            "--seed",
            str(seed),
            "--image-size",
            str(image_size),
            "--workers",
            str(workers),
        ]
    )
    ckpt_args = ["tools/checkpoint/make_tiny_wnm_checkpoint.py", "--output-dir", str(ws["ckpt"]), "--size", size]
    ckpt_args += ["--variant", variant]
    for item in ckpt_overrides:
        ckpt_args += ["--set", item]
    if sft_steps:
        ckpt_args += ["--collection", str(ws["collection"]), "--sft-steps", str(sft_steps)]
    run_cli(ckpt_args)
    run_cli(
        [
            "tools/data/convert_interiorgs_dagger_to_rlhf.py",
            "--input-root",
            str(ws["collection"]),
            "--output-dir",
            str(ws["converted"]),
            "--checkpoint",
            str(ws["ckpt"]),
            "--occupancy-root",
            str(ws["scenes"]),
            "--shard-size",
            "256",
            "--val-fraction",
            "0",
            "--split-seed",
            "42",
            "--workers",
            "1",
            "--worker-prefetch",
            "2",
        ]
    )
    run_cli(
        [
            "tools/data/sample_stage3_train.py",
            "--source-manifest",
            str(ws["converted"] / "manifest.json"),
            "--output-dir",
            str(ws["train"]),
            "--train-size",
            str(train_size),
            "--shard-size",
            "256",
            "--seed",
            "42",
        ]
    )
    run_cli(
        [
            "tools/data/build_vggt_stage3_event_val.py",
            "--input-root",
            str(ws["collection"]),
            "--output-dir",
            str(ws["eventval"]),
            "--checkpoint",
            str(ws["ckpt"]),
            "--exclude-parquet-dir",
            str(ws["train"]),
            "--occupancy-root",
            str(ws["scenes"]),
            "--per-event",
            "1",
            "--workers",
            "1",
        ]
    )
    ws["eventval_file"] = ws["eventval"] / "event_val.parquet"
    ws["train_size"] = train_size
    return ws


def write_trainer_config(path: Path, ws: dict, output_dir: Path, **overrides) -> Path:
    """A small CPU trainer config (the test-sized counterpart of the recipe) as a Hydra YAML file."""
    import yaml

    cfg = {
        "model": {"initial_checkpoint": str(ws["ckpt"]), "data_contract_checkpoint": str(ws["ckpt"])},
        "data": {
            "train_root": str(ws["train"]),
            "val_file": str(ws["eventval_file"]),
            "expected_train_size": ws["train_size"],
            "val_max_samples": 4,
        },
        "rollout": {
            "num_steps": 4,
            "window": {"strategy": "random", "size": 2, "range": [0, 3]},
            "micro_batch_size": 4,
        },
        "algorithm": {"clip_eps": 0.2},
        "topology": {
            "cpu_workers_per_node": 2,
            "prompts_per_step": 2,
            "ppo_mini_batch_prompts": 1,
            "micro_batch_rollouts": 4,
        },
        "reward": {
            "num_workers": 1,
            "reward_set": {
                "rewards": {
                    "navigation": {},
                    "collision": {},
                    "yaw": {},
                    "stop": {},
                    "vision": {},
                    "flow": {"weight": 0.0},
                }
            },
        },
        "trainer": {
            "total_steps": 2,
            "save_freq": 1,
            "val_freq": 2,
            "log_media_freq": 1,
            "output_dir": str(output_dir),
        },
    }
    for dotted, value in overrides.items():
        node = cfg
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
