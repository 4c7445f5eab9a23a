"""The CPU sibling of the GPU benchmark runs end to end at tiny size and reports what it promises."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from stage3_e2e_helpers import REPO, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_stage3_gpu")


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
    # The matmul peak is measured at the start and again at the end, and the report names both.
    assert data["matmul_peak_tflops"] > 0 and data["matmul_peak_tflops_end"] > 0
    assert f"measured again at the end: {data['matmul_peak_tflops_end']:.1f}" in out.read_text()
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
    # The median of three timed steps (the default --train-steps), with their spread.
    assert train["steps_timed"] == 3 and train["seconds_min"] <= train["seconds"] <= train["seconds_max"]
    assert len(train["step_seconds"]) == 3 and train["sm_clock_mhz_after_steps"] == [None] * 3  # no clock on CPU
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


def test_ckpt_blocks_sweep_checkpoints_the_first_blocks_and_goes_on_after_an_oom(bench, tmp_path, monkeypatch):
    """(c) alone at tiny size (4 blocks): one variant per --ckpt-blocks entry; the variant with no checkpointed block
    is made to run out of memory (CPU has no device memory to exhaust) and the next one still runs."""
    from verl_omni.pipelines.wnm_3d.actor import WNMDiffusionActor

    real = WNMDiffusionActor.update_policy
    seen = []

    def update_policy(self, *args, **kwargs):
        flags = tuple(b.activation_checkpointing for b in self.module.blocks)
        seen.append(flags)
        if not any(flags):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WNMDiffusionActor, "update_policy", update_policy)
    with socket.socket() as sock:  # the bench's single-rank gloo group needs a free port
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    out, js = tmp_path / "report.txt", tmp_path / "bench.json"
    rc = bench.main(
        ["--size", "tiny", "--device", "cpu", "--dtype", "float32", "--skip", "a,check,b", "--num-steps", "4",
         "--window-start", "1", "--checkpointing", "on", "--ckpt-micro-batch", "16", "--ckpt-blocks", "all,0,2",
         "--train-steps", "2", "--out", str(out), "--json", str(js)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(js.read_text())["train"]
    got = [(r["ckpt_blocks"], r["num_blocks"], r.get("error")) for r in rows]
    assert got == [(4, 4, None), (0, 4, "OOM"), (2, 4, None)]
    # 3 steps per measured variant (the first and --train-steps 2 timed), the OOM on the first step of its variant.
    assert seen == [(True,) * 4] * 3 + [(False,) * 4] + [(True, True, False, False)] * 3
    all_blocks, _, two = rows
    # Same weights, same rollout, same micro-batches: checkpointing changes what is kept, not the math.
    assert all_blocks["logp_abs_diff_max"] == 0.0 and two["logp_abs_diff_max"] == 0.0
    assert two["grad_norm"] == pytest.approx(all_blocks["grad_norm"], rel=1e-6)
    # The summary table: variant, ckpt (checkpointed / all blocks), seconds or OOM, ...
    table = out.read_text().split("(c) FSDP2 training step")[1].splitlines()
    lines = [line for line in table if line.strip().startswith("eager + act. ckpt")]
    assert [line.split()[4] for line in lines] == ["4/4", "0/4", "2/4"]
    assert lines[1].split()[5] == "OOM" and lines[1].endswith("out of device memory")
    assert float(lines[0].split()[5]) > 0 and float(lines[2].split()[5]) > 0


def test_ckpt_blocks_arguments_are_checked(bench, capsys):
    cases = [
        (["--checkpointing", "on", "--ckpt-blocks", "x"], "--ckpt-blocks: entries must be all or ints >= 0"),
        (["--checkpointing", "on", "--ckpt-blocks", "4,-1"], "--ckpt-blocks: entries must be all or ints >= 0"),
        (["--ckpt-blocks", "2"], "it needs --checkpointing on or both"),
    ]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert bench.parse_args(["--checkpointing", "both", "--ckpt-blocks", "all,3,0"]).ckpt_block_counts == [None, 3, 0]
    # Deeper than the model: refused before anything is measured.
    assert bench.main(["--size", "tiny", "--device", "cpu", "--checkpointing", "on", "--ckpt-blocks", "5"]) == 2
    assert "--ckpt-blocks [5]: size tiny has 4 blocks" in capsys.readouterr().err


def test_memory_budget_variants_are_checked_and_run_after_the_checkpointed_ones(bench, capsys):
    for argv, needle in (
        (["--compile", "--memory-budgets", "1.5"], "--memory-budgets must be in (0, 1)"),
        (["--compile", "--memory-budgets", "x"], "--memory-budgets must be comma-separated numbers"),
        (["--memory-budgets", "0.2"], "--memory-budgets applies to compiled variants: add --compile"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    argv = "--compile --train-variants compiled --checkpointing on --ckpt-blocks all,2 --memory-budgets 0.2,0.35"
    args = bench.parse_args(argv.split())
    variants = bench.train_variants(args)
    V = bench.TrainVariant
    assert variants == [
        V(True, checkpointing=True, ckpt_blocks=None),
        V(True, checkpointing=True, ckpt_blocks=2),
        V(True, memory_budget=0.2),
        V(True, memory_budget=0.35),
    ]
    assert [v.checkpointed_blocks(30) for v in variants] == [30, 2, 0, 0]
    assert [v.name for v in variants] == [
        "compiled + act. ckpt",
        "compiled + act. ckpt",
        "compiled, mem. budget 0.2",
        "compiled, mem. budget 0.35",
    ]
    assert all(v.large_micro_batch for v in variants)
    # Without --checkpointing on, each compile setting first runs without checkpointing, at --micro-batch.
    args = bench.parse_args("--compile --train-variants eager,compiled --checkpointing both --ckpt-blocks 1".split())
    assert bench.train_variants(args) == [V(False), V(False, True, 1), V(True), V(True, True, 1)]
    # --checkpointing none: only the memory-budget variants, which it needs.
    args = bench.parse_args("--compile --train-variants compiled --checkpointing none --memory-budgets 0.2".split())
    assert bench.train_variants(args) == [V(True, memory_budget=0.2)]
    for argv, needle in (
        (["--compile", "--checkpointing", "none"], "--checkpointing none runs only the --memory-budgets variants"),
        (["--train-steps", "0"], "--train-steps must be >= 1"),
        (
            ["--compile", "--checkpointing", "none", "--memory-budgets", "0.2", "--ckpt-blocks", "2"],
            "--ckpt-blocks sweeps the checkpointed variants",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not V(False).large_micro_batch and V(False).name == "eager"


def test_sm_clock_is_none_on_cpu():
    from bench_common import sm_clock_mhz

    assert sm_clock_mhz(torch.device("cpu")) is None
