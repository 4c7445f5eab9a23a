"""The CPU sibling of the GPU benchmark runs end to end at tiny size and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys

from stage3_e2e_helpers import REPO


def test_bench_stage3_cpu_reports_forward_numerics_group_and_train(tmp_path):
    out = tmp_path / "report.txt"
    js = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_stage3_cpu.py", "--batches", "2", "--iters", "1", "--warmup", "0",
         "--out", str(out), "--json", str(js)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(js.read_text())
    assert [r["model"] for r in data["forward"]] == ["diffusers eager", "WNM eager"]
    assert data["forward"][0]["x_diffusers_eager"] == 1.0
    # fp32 eager against an fp32 copy of the same weights: identical.
    assert data["numerics"]["velocity_rel_err_eager"] == 0.0
    assert data["numerics"]["ode_action_max_abs_eager"] == 0.0
    # K = 10, window from step 3: without sharing 16 x 10 DiT rows; with it 4 strata x 3 + 16 x 7.
    rows = {r["variant"]: r["dit_rows"] for r in data["group"]}
    assert rows == {"eager, no prefix sharing": 160, "eager": 124}
    (train,) = data["train"]
    # The product's actor at the rollout's shapes: ratio exactly 1 before the step.
    assert train["transitions"] == 32 and train["logp_abs_diff_max"] == 0.0
    assert "(c) FSDP2 training step" in out.read_text()


def test_bench_stage3_refuses_bad_arguments(tmp_path):
    cases = [(["--batches", "x"], "--batches"), (["--skip", "z"], "--skip")]
    cases.append((["--window-start", "9"], "--window-start"))
    for bad, needle in cases:
        proc = subprocess.run(
            [sys.executable, "scripts/bench_stage3_cpu.py", *bad], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    taken = tmp_path / "taken.txt"
    taken.write_text("keep")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_stage3_cpu.py", "--out", str(taken)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "already exists" in proc.stderr and taken.read_text() == "keep"
