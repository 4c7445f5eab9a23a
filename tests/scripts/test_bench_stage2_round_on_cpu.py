"""scripts/bench_stage2_round.py at its smallest: one real train_stage2.py round, its table and its JSON."""

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_stage2_round.py"


def _main(argv):
    module = runpy.run_path(str(SCRIPT), run_name="bench_stage2_round")
    return module["main"](argv)


def test_one_round_is_timed_and_reported(tmp_path, capsys):
    work = tmp_path / "bench"
    argv = ["--workdir", str(work), "--device", "cpu", "--workers", "1", "--scenes", "1", "--steps", "3",
            "--batch-size", "2", "--variants", "eager-fp32", "--set", "num_layers=1"]  # fmt: skip
    assert _main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((work / "bench_stage2_round.json").read_text())["results"]["eager-fp32"]
    # Three steps: too few to split off the first 20, so the steady rate is the whole loop's.
    assert result["steps"] == 3 and result["warmup_steps"] == 0
    assert result["steady_ms_per_step"] == pytest.approx(1000 * result["steps_s"] / 3)
    assert result["heldout_loss"] > 0
    summary = json.loads((work / "eager-fp32" / "summary.json").read_text())
    assert summary["arguments"]["sft_autocast"] == "none" and summary["arguments"]["compile_blocks"] == "False"
    assert "| eager-fp32 |" in out
    # A folder that already holds rounds is refused: its rounds would be reused, not timed.
    with pytest.raises(SystemExit):
        _main(argv)
    assert "not empty" in capsys.readouterr().err


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _main(["--workdir", str(tmp_path / "w"), "--steps", "0"])
    assert "--steps" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_collection_that_cannot_be_made_is_reported_without_rounds(tmp_path, capsys):
    work = tmp_path / "bad"
    assert _main(["--workdir", str(work), "--device", "cpu", "--workers", "1", "--scenes", "1",
                  "--set", "no_such_field=1"]) == 2  # fmt: skip
    assert "no_such_field" in capsys.readouterr().err
    assert not (work / "eager-bf16").exists() and not (work / "bench_stage2_round.json").exists()
