"""End-to-end trainer on CPU through Ray: 2 actor workers (gloo, FSDP2) and 1 reward worker.

- a 2-step run writes checkpoints and TensorBoard scalars, the first mini-batch's ratio is exactly 1 and
  the parameters changed;
- a run killed with SIGKILL after step 2 and resumed reaches step 4 with the same metrics as an
  uninterrupted 4-step run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from stage3_e2e_helpers import REPO, SMALLEST_PLAN, run_cli, write_trainer_config

REQUIRED_TAGS = [
    *(
        f"reward/{layer}/{stat}"
        for layer in ("visual", "nav_1", "nav_4", "stop_1", "stop_4")
        for stat in ("mean", "std")
    ),
    "advantages/std/nav_1",
    "actor/ratio_mean/nav_1",
    "actor/ratio_min/stop_1",
    "actor/ratio_max/visual",
    "actor/clip_fraction",
    "actor/approx_kl",
    "actor/grad_norm",
    "actor/lr",
    "actor/logp_abs_diff_first_minibatch",
    "val/all/nav_total",
    "timing/rollout_s",
    "timing/reward_s",
    "timing/update_s",
    "perf/rollouts_per_s",
    "memory/update_peak_gb",
]


def _metrics(out: Path) -> dict[int, dict]:
    return {json.loads(line)["step"]: json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()}


def test_two_steps_write_checkpoints_metrics_and_change_parameters(trained_run):
    out = trained_run["output_dir"]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for step in (1, 2):
        actor = out / f"global_step_{step}" / "actor"
        assert (actor / ".metadata").is_file()
        assert sorted(p.name for p in actor.glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert (actor / "extra_state_rank_0.pt").is_file() and (actor / "extra_state_rank_1.pt").is_file()
        state = json.loads((out / f"global_step_{step}" / "trainer_state.json").read_text())
        assert state["step"] == step and state["data_position"]["position"] == 2 * step
    assert not list(out.glob("*.partial"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    missing = [t for t in REQUIRED_TAGS if t not in tags]
    assert not missing, f"TensorBoard lacks {missing}"
    assert {"media/generated_vs_truth", "media/trajectories"} <= set(ea.Tags()["images"])

    m = _metrics(out)
    # Before the first optimizer step the recomputed log-probs equal the rollout's bit for bit (fp32, CPU).
    assert m[1]["actor/logp_abs_diff_first_minibatch"] == 0.0
    assert m[1]["actor/ratio_min/nav_1"] <= 1.0 <= m[1]["actor/ratio_max/nav_1"]
    assert "timing/update_s" in m[2] and "step-time table" in trained_run["stdout"]

    # Parameters changed: the step-2 actor weights differ from the initial checkpoint's transformer.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: F401

    from verl_omni.models.wnm import load_wnm_checkpoint

    base = load_wnm_checkpoint(trained_run["workspace"]["ckpt"]).transformer.state_dict()
    trained = {k: torch.empty_like(v) for k, v in base.items()}
    dcp.load({"model": trained}, checkpoint_id=str(out / "global_step_2" / "actor"), no_dist=True)
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"


def test_recomputed_old_logprobs_cover_each_rollout_once_and_match(stage3_workspace, tmp_path):
    # 1 prompt = 16 rollouts over 2 ranks, 2 PPO epochs: old log-probs are recomputed once per rollout (16, not
    # 2 x 16), and on CPU in fp32 with the rollout's chunking they equal the rollout's bit for bit.
    over = {
        **SMALLEST_PLAN,
        "trainer.total_steps": 1,
        "trainer.save_freq": 0,
        "algorithm.recompute_old_logp": True,
        "algorithm.ppo_epochs": 2,
    }
    write_trainer_config(tmp_path / "cfg" / "run.yaml", stage3_workspace, tmp_path / "out", **over)
    run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(tmp_path / "cfg"), "--config-name", "run"],
        timeout=900,
    )
    m = _metrics(tmp_path / "out")[1]
    assert m["actor/old_logp_recomputed_rollouts"] == 16.0
    assert m["actor/logp_abs_diff_rollout_vs_recomputed"] == 0.0
    assert m["actor/logp_abs_diff_first_minibatch"] == 0.0


def test_fp8_rollout_trains_with_recomputed_old_logprobs(stage3_workspace, tmp_path):
    # rollout.fp8 samples with the FP8 copy (torch._scaled_mm runs on CPU too) and re-quantizes it from the FSDP
    # shards before step 2's rollout. Its own log-probs differ from the fp32 policy's, the recomputed ones are
    # what the ratio uses, so the first mini-batch's ratio is exact again.
    over = {
        **SMALLEST_PLAN,
        "trainer.total_steps": 2,
        "trainer.save_freq": 0,
        "rollout.fp8": True,
        "algorithm.recompute_old_logp": True,
    }
    write_trainer_config(tmp_path / "cfg" / "run.yaml", stage3_workspace, tmp_path / "out", **over)
    run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(tmp_path / "cfg"), "--config-name", "run"],
        timeout=900,
    )
    metrics = _metrics(tmp_path / "out")
    for step in (1, 2):
        m = metrics[step]
        assert m["actor/old_logp_recomputed_rollouts"] == 16.0
        assert m["actor/logp_abs_diff_rollout_vs_recomputed"] > 0.0  # FP8 sampling is not the fp32 policy
        assert m["actor/logp_abs_diff_first_minibatch"] == 0.0


def _start(cfg_dir: Path, ray_tmp: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "WAM_RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _kill_everything(proc: subprocess.Popen, ray_tmp: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    # Ray's own daemons run in sessions of their own; find them by our private temp dir and kill them too.
    subprocess.run(["pkill", "-9", "-f", ray_tmp], check=False)


@pytest.mark.timeout(1500)
def test_kill_and_resume_matches_uninterrupted_run(stage3_workspace, tmp_path):
    over = {**SMALLEST_PLAN, "trainer.total_steps": 4, "trainer.save_freq": 1}
    full_cfg = tmp_path / "full"
    write_trainer_config(full_cfg / "run.yaml", stage3_workspace, tmp_path / "full_out", **over)
    run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(full_cfg), "--config-name", "run"], timeout=1200
    )
    reference = _metrics(tmp_path / "full_out")
    assert sorted(reference) == [1, 2, 3, 4]

    cut_cfg = tmp_path / "cut"
    out = tmp_path / "cut_out"
    write_trainer_config(cut_cfg / "run.yaml", stage3_workspace, out, **over)
    ray_tmp = f"/tmp/wnm_kill_{os.getpid()}"
    proc = _start(cut_cfg, ray_tmp)
    deadline = time.time() + 900
    pointer = out / "latest_checkpointed_iteration.txt"
    try:
        while time.time() < deadline and proc.poll() is None:
            if pointer.is_file() and pointer.read_text().strip() == "2":
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stdout.read()[-3000:]}"
    finally:
        _kill_everything(proc, ray_tmp)
    assert pointer.read_text().strip() in ("2", "3")
    killed_at = int(pointer.read_text())

    run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(cut_cfg), "--config-name", "run"], timeout=1200
    )
    resumed = _metrics(out)
    assert sorted(resumed) == [1, 2, 3, 4] and pointer.read_text().strip() == "4"
    compared = 0
    for step in range(killed_at + 1, 5):
        for key, value in reference[step].items():
            if key.startswith(("timing/", "perf/", "memory/")) or key == "step":
                continue
            np.testing.assert_allclose(resumed[step][key], value, rtol=0, atol=0, err_msg=f"step {step} {key}")
            compared += 1
    assert compared > 50


@pytest.mark.timeout(900)
def test_dead_actor_worker_stops_the_run_naming_the_last_checkpoint(stage3_workspace, tmp_path):
    # SIGKILL one actor rank after the step-1 checkpoint: the driver must stop with exit code 3 and tell the
    # user which checkpoint is complete and how to resume, instead of hanging or training on.
    over = {**SMALLEST_PLAN, "trainer.total_steps": 50, "trainer.save_freq": 1}
    cfg = tmp_path / "cfg"
    out = tmp_path / "out"
    write_trainer_config(cfg / "run.yaml", stage3_workspace, out, **over)
    ray_tmp = f"/tmp/wnm_dead_{os.getpid()}"
    proc = _start(cfg, ray_tmp)
    pointer = out / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not pointer.is_file():
            time.sleep(0.5)
        assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()[-3000:]}"
        pids = json.loads((out / "worker_pids.json").read_text())
        assert len(pids["actor_ranks"]) == 2 and pids["driver"] != pids["actor_ranks"][0]
        os.kill(pids["actor_ranks"][1], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=300)
    finally:
        _kill_everything(proc, ray_tmp)
    assert proc.returncode == 3, stdout[-3000:]
    latest = int(pointer.read_text())
    assert latest < 50
    assert "ERROR: a worker failed" in stdout
    assert f"last complete checkpoint: {out / f'global_step_{latest}'}" in stdout
    assert "run the same launch command again to resume" in stdout


def _relaunch(cfg_dir: Path, extra_env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WAM_RESUME_OVERRIDE")}
    env.update({"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **(extra_env or {})})
    return subprocess.run(
        [sys.executable, "-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _copy_run(trained_run, dest: Path) -> Path:
    import shutil

    shutil.copytree(trained_run["output_dir"], dest, ignore=shutil.ignore_patterns("ray_address.txt"))
    return dest


@pytest.mark.timeout(900)
def test_damaged_newest_checkpoint_falls_back_and_nonfinite_updates_stop_naming_the_good_one(trained_run, tmp_path):
    # A copy of the 2-step run with one shard of global_step_2 cut short, relaunched with non-finite gradients
    # injected into every update and algorithm.max_nonfinite_updates lowered to 1 (an explicit, logged override):
    # the driver must skip the damaged step 2 loudly, resume from step 1, stop after step 2's non-finite
    # updates with exit 4, and name global_step_1 (intact) as the last good checkpoint, never global_step_2.
    from verl_omni.trainer import checkpointing

    out = _copy_run(trained_run, tmp_path / "out")
    shard = out / "global_step_2" / "actor" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    cfg = tmp_path / "cfg"
    write_trainer_config(cfg / "run.yaml", trained_run["workspace"], out, **{"algorithm.max_nonfinite_updates": 1})
    proc = _relaunch(
        cfg,
        {
            "WAM_RESUME_OVERRIDE": "algorithm.max_nonfinite_updates",
            "WAM_RAY_WORKER_SETUP_HOOK": "nonfinite_grad_hook.install",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-6000:]
    assert "WARNING: the newest checkpoint(s) are damaged and are NOT used" in text
    assert f"{shard}: {size // 2} bytes, the manifest records {size} (truncated or replaced)" in text
    assert f"resumed from {out / 'global_step_1'} (step 1)" in text
    assert "WAM_RESUME_OVERRIDE: accepted setting:algorithm.max_nonfinite_updates: 3 -> 1" in text
    m = _metrics(out)
    assert sorted(m) == [1, 2]  # step 2 trained again, nothing after it
    skipped = int(m[2]["actor/skipped_nonfinite_updates"])
    # 2 prompts per step, 1 prompt per mini-batch, 1 PPO epoch: 2 updates, each non-finite (unless skipped as a
    # zero-signal mini-batch, which never reaches the optimizer).
    assert skipped + int(m[2]["advantages/skipped_minibatches"]) == 2 and skipped >= 1
    assert f"stopping: {skipped} updates had a NaN/inf loss or gradient (algorithm.max_nonfinite_updates=1)" in text
    assert f"the last good checkpoint is {out / 'global_step_1'};" in text
    assert f"checkpoint is {out / 'global_step_2'}" not in text
    assert checkpointing.verify_checkpoint(out / "global_step_1") == []
    assert checkpointing.verify_checkpoint(out / "global_step_2") != []  # untouched: nothing saved after the stop
    assert (out / checkpointing.POINTER).read_text().strip() == "2"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    fallback = ea.Scalars("checkpoint/resume_fallback")
    assert [(e.step, e.value) for e in fallback] == [(1, 1.0)]


def test_relaunch_onto_other_data_validation_set_or_constants_is_refused_before_ray(trained_run, tmp_path):
    ws = trained_run["workspace"]
    out = _copy_run(trained_run, tmp_path / "out")
    other_train = tmp_path / "train_seed7"
    run_cli(
        [
            "tools/data/sample_stage3_train.py",
            "--source-manifest",
            str(ws["converted"] / "manifest.json"),
            "--output-dir",
            str(other_train),
            "--train-size",
            str(ws["train_size"]),
            "--shard-size",
            "256",
            "--seed",
            "7",
        ]
    )
    other_val = tmp_path / "eventval_copy"
    import shutil

    # Another validation set: a copy whose manifest records other tool arguments (another content identity).
    shutil.copytree(ws["eventval"], other_val)
    manifest = json.loads((other_val / "manifest.json").read_text())
    manifest["args"]["per_event"] = "edited"  # any content change gives another identity
    (other_val / "manifest.json").write_text(json.dumps(manifest))
    cfg = tmp_path / "cfg"
    changed = {**ws, "train": other_train, "eventval_file": other_val / "event_val.parquet"}
    write_trainer_config(cfg / "run.yaml", changed, out, **{"rollout.eta": 0.5})
    proc = _relaunch(cfg, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    assert f"{out} was started with other inputs; refusing to resume onto them (3 item(s))" in text
    assert 'dataset:data.train_root: recorded "train_subset:' in text
    assert 'dataset:data.val_file: recorded "event_val:' in text
    assert "locked:rollout.eta: recorded 0.7, now 0.5" in text
    assert "set WAM_OUTPUT_DIR to a new directory" in text and "WAM_RESUME_OVERRIDE" in text
    assert "actor ranks" not in text and "resumed from" not in text  # refused before Ray and workers

    write_trainer_config(cfg / "run.yaml", ws, out, **{"trainer.total_steps": 3})
    proc = _relaunch(cfg, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    assert "setting:trainer.total_steps [may change on resume]: recorded 2, now 3" in text
    assert "WAM_RESUME_OVERRIDE=trainer.total_steps bash recipes/wnm_3d/stage3/launch.sh" in text
