"""launch.sh: refusals (positional overrides, a running Ray runtime) and CPU training, single and two-node.

The training tests need the trainer driver (verl_omni/trainer/main_stage3.py) and take minutes; the
two-node test runs two launch.sh processes on one machine: node 0 on the machine's address, node 1 as a
second raylet announcing 127.0.0.2 (Ray accepts several raylets per host when each has its own IP and temp
dir).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from recipe_test_helpers import REPO, clean_environ, run_script, write_paths_env

from verl_omni.trainer import checkpointing
from verl_omni.trainer.launch_env import processes_mentioning, ray_core_processes, terminate

TOKEN = "STAGE3_CONFIG_CONTRACT_OK"
needs_driver = pytest.mark.skipif(
    not (REPO / "verl_omni" / "trainer" / "main_stage3.py").is_file(),
    reason="trainer driver verl_omni/trainer/main_stage3.py not written yet",
)


@pytest.fixture(autouse=True)
def no_ray_runtime_left_running():
    """launch.sh refuses to start beside a running Ray runtime, so each test waits until the runtimes that earlier
    tests (or their drivers) shut down are gone; on a loaded 2-core machine that can take tens of seconds."""
    deadline = time.time() + 120
    while (left := ray_core_processes()) and time.time() < deadline:
        time.sleep(1)
    assert not left, "Ray processes still running before a launch.sh test: " + ", ".join(
        f"pid {p.pid} {p.component}" for p in left
    )
    yield


def _free_port() -> int:
    # Outside Ray's default worker port range 10002-19999.
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 20000:
            return port
    raise RuntimeError("no free port >= 20000")


def test_launch_refuses_positional_override(tmp_path):
    proc = run_script("launch.sh", tmp_path / "absent.env", "trainer.total_steps=5")
    assert proc.returncode == 2
    assert "Positional Hydra overrides are refused" in proc.stderr and "trainer.total_steps=5" in proc.stderr
    assert "WAM_TOTAL_STEPS" in proc.stderr
    assert TOKEN not in proc.stdout


def test_launch_refuses_running_ray_and_leaves_it_running(stage3_workspace, tmp_path):
    ray_tmp = f"/tmp/wam_test_{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "run"
    start = subprocess.run(
        [
            clean_environ()["WNM_PYTHON"],
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--port",
            str(_free_port()),
            "--temp-dir",
            ray_tmp,
            "--num-cpus",
            "1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=clean_environ({"RAY_USAGE_STATS_ENABLED": "0"}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        ours = [p for p in ray_core_processes() if ray_tmp in p.cmdline]
        assert {p.component for p in ours} == {"gcs_server", "raylet"}
        env_file = write_paths_env(tmp_path / "paths.env", stage3_workspace.paths_env(out_dir))
        proc = run_script("launch.sh", env_file)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert TOKEN in proc.stdout  # the contract check ran first and passed
        assert "a Ray runtime is already running" in proc.stderr and "WAM_REPLACE_EXISTING_RAY=true" in proc.stderr
        for p in ours:
            assert f"pid {p.pid} {p.component}" in proc.stderr
        still = {p.pid for p in ray_core_processes() if ray_tmp in p.cmdline}
        assert still == {p.pid for p in ours}, "launch.sh must not stop a running Ray runtime"
        assert not out_dir.exists(), "nothing may be written before the Ray check passes"
    finally:
        terminate(processes_mentioning([ray_tmp + "/"]))


@needs_driver
def test_launch_trains_two_steps_on_cpu(stage3_workspace, tmp_path):
    out_dir = tmp_path / "run"
    values = stage3_workspace.paths_env(out_dir)
    values.update({"WAM_TOTAL_STEPS": "2", "WAM_SAVE_FREQ": "1", "WAM_RAY_DASHBOARD": "false"})
    proc = run_script("launch.sh", write_paths_env(tmp_path / "paths.env", values), timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert TOKEN in proc.stdout
    assert (out_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    snapshots = list((out_dir / "launch").glob("*/resolved_config.yaml"))
    assert len(snapshots) == 1 and "prompts_per_step: 2" in snapshots[0].read_text()
    assert list((out_dir / "logs").glob("driver_*.log"))
    assert list(out_dir.rglob("events.out.tfevents.*")), "no TensorBoard events under WAM_OUTPUT_DIR"

    # Relaunch checks of validate.sh against the run directory (the same as the driver's, before Ray starts).
    assert (out_dir / "run_provenance.json").is_file()
    env_file = write_paths_env(tmp_path / "paths.env", values)
    proc = run_script("validate.sh", env_file)
    assert proc.returncode == 0 and TOKEN in proc.stdout, proc.stdout + proc.stderr
    assert f"resumes from verified checkpoint {out_dir / 'global_step_2'}" in proc.stdout
    # A longer run needs the explicit override; with it the check passes and says what it accepted.
    proc = run_script("validate.sh", env_file, env={"WAM_TOTAL_STEPS": "3"})
    assert proc.returncode == 1 and TOKEN not in proc.stdout
    assert "setting:trainer.total_steps [may change on resume]: recorded 2, now 3" in proc.stdout
    assert "WAM_RESUME_OVERRIDE=trainer.total_steps bash recipes/wnm_3d/stage3/launch.sh" in proc.stdout
    proc = run_script("validate.sh", env_file, env={"WAM_TOTAL_STEPS": "3", "WAM_RESUME_OVERRIDE": "WAM_TOTAL_STEPS"})
    assert proc.returncode == 0 and TOKEN in proc.stdout, proc.stdout + proc.stderr
    assert "accepted setting:trainer.total_steps: 2 -> 3" in proc.stdout
    # Another validation set (here: the Parquet form of a copy with other recorded arguments) is refused, and
    # launch.sh refuses it too before starting anything.
    import json
    import shutil

    other_val = tmp_path / "val_other"
    shutil.copytree(stage3_workspace.val, other_val)
    manifest = json.loads((other_val / "manifest.json").read_text())
    manifest["args"]["seed_note"] = "edited"
    (other_val / "manifest.json").write_text(json.dumps(manifest))
    proc = run_script("launch.sh", env_file, env={"WAM_EVENT_VAL_FILE": str(other_val / "event_val.parquet")})
    assert proc.returncode == 1 and TOKEN not in proc.stdout
    assert "dataset:data.val_file: recorded" in proc.stdout and "set WAM_OUTPUT_DIR to a new directory" in proc.stdout
    assert "nothing was started" in proc.stderr


@needs_driver
def test_two_node_loopback_cluster_trains_one_step(stage3_workspace, tmp_path):
    out_dir = tmp_path / "run"
    values = stage3_workspace.paths_env(out_dir)
    values.update(
        {
            "WAM_TOTAL_STEPS": "1",
            "WAM_SAVE_FREQ": "1",
            "WAM_CPU_WORKERS": "1",
            "WAM_RAY_DASHBOARD": "false",
            "NNODES": "2",
            "MASTER_ADDR": "127.0.0.1",
            "RAY_PORT": str(_free_port()),
            "WAM_NODE_WAIT_TIMEOUT": "300",
        }
    )
    env_file = write_paths_env(tmp_path / "paths.env", values)
    cmd = ["bash", str(REPO / "recipes" / "wnm_3d" / "stage3" / "launch.sh")]
    logs = [open(tmp_path / f"node{r}.log", "w") for r in (0, 1)]  # noqa: SIM115
    procs = []
    try:
        for rank, extra in ((0, {}), (1, {"WAM_NODE_IP": "127.0.0.2"})):
            env = clean_environ({"WAM_PATHS_ENV": str(env_file), "NODE_RANK": str(rank), **extra})
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[rank], stderr=subprocess.STDOUT))
        rc0 = procs[0].wait(timeout=1200)
        rc1 = procs[1].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
        # launch.sh stops its own raylets; this only cleans up after a failure (same temp-dir rule as launch.sh).
        key = hashlib.sha256(str(out_dir).encode()).hexdigest()[:10]
        terminate(processes_mentioning([f"/tmp/wam_ray_{os.getuid()}_{key}_n"]))
    head_log = Path(tmp_path / "node0.log").read_text()
    node1_log = Path(tmp_path / "node1.log").read_text()
    assert rc0 == 0, head_log[-6000:]
    assert rc1 == 0, node1_log[-3000:]
    assert re.search(r"ray cluster ready: 2 node\(s\):.*127\.0\.0\.2", head_log), head_log[-3000:]
    # Ray prefixes output of actors on another node with their IP: an actor ran on the second "node".
    assert re.search(r"\(ActorRolloutWorker pid=\d+, ip=127\.0\.0\.2\)", head_log), head_log[-3000:]
    assert (out_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "Ray head" in node1_log and "is gone" in node1_log


@needs_driver
@pytest.mark.timeout(900)
def test_sigterm_to_launch_sh_reaches_the_driver_which_saves_its_step(stage3_workspace, tmp_path):
    # A scheduler's preemption signals launch.sh, not the driver. No periodic checkpoint (save freq 0): only a
    # signal passed on to the driver can leave one.
    out_dir = tmp_path / "run"
    values = stage3_workspace.paths_env(out_dir)
    values.update({"WAM_TOTAL_STEPS": "40", "WAM_SAVE_FREQ": "0", "WAM_RAY_DASHBOARD": "false"})
    env_file = write_paths_env(tmp_path / "paths.env", values)
    ray_tmp = f"/tmp/wam_term_{uuid.uuid4().hex[:8]}"
    env = clean_environ({"WAM_PATHS_ENV": str(env_file), "WAM_RAY_TMPDIR": ray_tmp})
    proc = subprocess.Popen(
        ["bash", str(REPO / "recipes" / "wnm_3d" / "stage3" / "launch.sh")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not (out_dir / "metrics.jsonl").is_file():
            time.sleep(0.5)
        assert proc.poll() is None, f"run ended before the signal:\n{proc.stdout.read()[-3000:]}"
        proc.send_signal(signal.SIGTERM)  # launch.sh's own pid, as Kubernetes or scancel would
        log, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        terminate(processes_mentioning([ray_tmp]))
    assert proc.returncode == 143, log[-4000:]
    assert "launch.sh: SIGTERM received; passing SIGTERM to the driver" in log
    steps = [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and 1 <= stopped < 40
    # The step in progress was finished and saved, intact: the checkpoint a relaunch resumes from.
    assert (out_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert checkpointing.choose_resume(out_dir).step == stopped
    assert f"stopped after step {stopped} of 40 on signal {int(signal.SIGTERM)}" in log
    assert "driver exited with code 143" in log
