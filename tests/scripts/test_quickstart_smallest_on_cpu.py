"""The quickstart at its smallest settings, end to end: every artifact its summary names must exist."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)
def test_quickstart_smallest_runs_every_user_command(tmp_path):
    ws = tmp_path / "qs"
    env = {**os.environ, "WNM_WORKSPACE": str(ws)}
    proc = subprocess.run(
        ["bash", "scripts/quickstart.sh", "--smallest"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1700
    )
    assert proc.returncode == 0, f"quickstart failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    out = proc.stdout
    assert "STAGE3_CONFIG_CONTRACT_OK" in out and "quickstart finished" in out
    for rel in (
        "collection/collection.json",
        "scenes",
        "stage2/checkpoint_manifest.json",
        "train/manifest.json",
        "eventval/manifest.json",
        "paths.env",
        "stage3/latest_checkpointed_iteration.txt",
        "stage3/global_step_1/actor/.metadata",
        "stage3/metrics.jsonl",
        "stage3/tensorboard",
        "stage3_export/checkpoint_manifest.json",
        "eval/report.json",
        "eval/trajectories.png",
    ):
        assert (ws / rel).exists(), f"quickstart did not produce {rel}"
    report = json.loads((ws / "eval" / "report.json").read_text())
    # Stage II and Stage III, and the goal-bearing reference on the same episodes of the one-room level.
    assert set(report["runs"]) == {"checkpoint", "compare", "policy:goal_bearing"}
    assert report["settings"]["level"] == "one_room"
    assert report["settings"]["closed_loop"]["execute_steps"] == 3  # replanning every 3 steps, as Stage II is evaluated
    assert "Geodesic progress:" in out and "goal_bearing" in out.split("Geodesic progress:")[1].splitlines()[0]
    # Running it again without --force must refuse and leave the workspace alone.
    again = subprocess.run(
        ["bash", "scripts/quickstart.sh", "--smallest"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    assert (ws / "eval" / "report.json").is_file()
