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
from stage3_e2e_helpers import REPO, run_cli, write_trainer_config

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
