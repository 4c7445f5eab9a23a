"""tools/eval/stop_probe.py end to end on the real tiny checkpoint (make_tiny_wnm_checkpoint, no SFT)."""

import json

import pytest
from stage3_e2e_helpers import load_script

FAST = ["--synthesize", "1", "--episodes", "1", "--max-steps", "6", "--num-steps", "2", "--seed", "4", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    maker = load_script("tools/checkpoint/make_tiny_wnm_checkpoint.py")
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert maker.main(["--output-dir", str(out), "--no-progress"]) == 0
    return out


def test_same_checkpoint_twice_answers_alike_and_outputs_are_never_overwritten(tiny_checkpoint, tmp_path, capsys):
    tool = load_script("tools/eval/stop_probe.py")
    out = tmp_path / "probe"
    args = ["--checkpoint", str(tiny_checkpoint), str(tiny_checkpoint), *FAST, "--output-dir", str(out)]
    assert tool.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "wnm-stop-probe/1"
    labels = list(report["checkpoints"])
    assert labels == ["tiny (1)", "tiny (2)"]
    calls = report["calls"]
    first = [c for c in calls if c["checkpoint"] == labels[0]]
    second = [c for c in calls if c["checkpoint"] == labels[1]]
    assert first and len(first) == len(second)
    # Same weights, same states, same noise keys: the same answer at every call, so every paired difference is 0.
    strip = [{k: v for k, v in c.items() if k != "checkpoint"} for c in first]
    assert strip == [{k: v for k, v in c.items() if k != "checkpoint"} for c in second]
    for rate in ("asked", "ends_here"):
        assert all(row["difference"] == 0.0 or row["calls"] == 0 for row in report["summary"]["paired"][rate])
    assert all(c["gate_allows"] is None for c in calls)  # no --stop-gate
    assert "paired, tiny (2) - tiny (1)" in (out / "summary.md").read_text()
    assert "report.json" in capsys.readouterr().out
    before = (out / "report.json").read_bytes()
    assert tool.run_cli(tool.main, args) != 0
    assert (out / "report.json").read_bytes() == before
    assert "never overwritten" in capsys.readouterr().err


def test_stop_gate_on_a_checkpoint_without_one_is_refused_by_name(tiny_checkpoint, tmp_path, capsys):
    tool = load_script("tools/eval/stop_probe.py")
    args = ["--checkpoint", str(tiny_checkpoint), "--stop-gate", *FAST, "--output-dir", str(tmp_path / "p")]
    assert tool.run_cli(tool.main, args) != 0
    assert "stop_gate" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
