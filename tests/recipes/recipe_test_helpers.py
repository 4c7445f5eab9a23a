"""Helpers of the recipe tests: workspace paths, clean script environments, script runners."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "wnm_3d" / "stage3"
CONFIG_DIR = RECIPE / "config"
# Variables the scripts read; stripped from the test process environment so only the test's values count.
SCRIPT_VARS = (
    "WAM_",
    "WNM3D_",
    "WNM_TOKENIZER",
    "WNM_TEXT",
    "WNM_IMAGE",
    "WNM_VAE",
    "WNM_VGGT",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "RAY_PORT",
    "RAY_ADDRESS",
    "NCCL_",
    "GLOO_",
)
TRAIN_SIZE = 2
VAL_ROWS = 4


@dataclass(frozen=True)
class Workspace:
    """Paths of the synthesized workspace."""

    root: Path
    gn0: Path
    occupancy: Path
    checkpoint: Path
    converted: Path
    train: Path
    val: Path

    def paths_env(self, output_dir: Path) -> dict[str, str]:
        """A complete, valid set of paths.env values for this workspace."""
        return {
            "WNM3D_INITIAL_CHECKPOINT": str(self.checkpoint),
            "WAM_DATA_CONTRACT_CHECKPOINT": str(self.checkpoint),
            "WAM_DATA_ROOT": str(self.train),
            "WAM_EVENT_VAL_FILE": str(self.val),
            "WAM_EXPECTED_TRAIN_SIZE": str(TRAIN_SIZE),
            "WAM_VAL_MAX_SAMPLES": str(VAL_ROWS),
            "WAM_OUTPUT_DIR": str(output_dir),
            "WAM_CPU_WORKERS": "2",
            "WAM_GPUS_PER_NODE": "0",
            "WAM_TOTAL_STEPS": "2",
            "WAM_SAVE_FREQ": "1",
            "WAM_VAL_FREQ": "0",
        }


def clean_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process environment without any recipe variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRIPT_VARS)}
    env["WNM_PYTHON"] = sys.executable
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def write_paths_env(path: Path, values: dict[str, str | None]) -> Path:
    """Writes a paths.env with ``values`` (None values are left out)."""
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items() if v is not None))
    return path


def run_script(
    script: str | Path, paths_env: Path | None, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Runs ``bash <recipe>/<script>`` with a clean environment pointing WAM_PATHS_ENV at ``paths_env``."""
    extra = dict(env or {})
    if paths_env is not None:
        extra["WAM_PATHS_ENV"] = str(paths_env)
    path = Path(script) if Path(script).is_absolute() else RECIPE / script
    return subprocess.run(
        ["bash", str(path), *args], cwd=REPO, env=clean_environ(extra), capture_output=True, text=True, timeout=timeout
    )


def copy_recipe(dest_root: Path) -> Path:
    """Copies recipes/wnm_3d/stage3 to ``dest_root/recipes/wnm_3d/stage3`` (for edits a test must not make
    in the repository) and returns the copy's directory."""
    dest = dest_root / "recipes" / "wnm_3d" / "stage3"
    shutil.copytree(RECIPE, dest, ignore=shutil.ignore_patterns("paths.env"))
    return dest
