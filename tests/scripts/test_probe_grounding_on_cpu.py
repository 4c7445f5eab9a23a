"""scripts/probe_grounding.py: the scene split by hand, and two arms end to end at the smallest size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from probe_grounding import split_by_scene  # noqa: E402


def test_split_by_scene_keeps_each_house_on_one_side():
    ids = ["s0000_e000", "s0000_e000_g1", "s0000_e001", "s0001_e000", "s0001_e000_g2", "s0002_e000"]
    train, held = split_by_scene(ids, 0.34, seed=0)
    assert sorted(train + held) == sorted(ids)
    held_scenes = {e.split("_")[0] for e in held}
    assert len(held_scenes) == 1  # round(0.34 * 3) = 1 house held out
    assert not held_scenes & {e.split("_")[0] for e in train}
    with pytest.raises(ValueError, match=">= 2 scenes"):
        split_by_scene(["s0000_e000", "s0000_e001"], 0.5, seed=0)


def test_two_arms_share_data_and_report_grounding(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts/probe_grounding.py"), "--workdir", str(tmp_path), "--arms", "plain",
           "gated", "--scenes", "3", "--episodes-per-scene", "1", "--heldout-scenes", "0.34", "--steps", "2",
           "--batch-size", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = {arm: json.loads((tmp_path / f"grounding_{arm}.json").read_text()) for arm in ("plain", "gated")}
    assert reports["gated"]["config_overrides"] == {"text_gated_context": True}
    for r in reports.values():
        assert r["train_states"] > 0 and r["heldout_states"] > 0
        gd = r["goal_direction"]
        assert gd["gap"] == pytest.approx(gd["bearing_error_deg_swapped"] - gd["bearing_error_deg"])
        assert 0 <= gd["constant"] <= 180
    assert "| plain |" in proc.stdout and "| gated |" in proc.stdout
    # The encoded rows are cached: a rerun encodes nothing.
    proc = subprocess.run(cmd[:5] + ["plain"] + cmd[7:], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reusing" in proc.stdout and "rows (" not in proc.stdout
