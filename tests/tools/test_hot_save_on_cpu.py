"""tools/checkpoint/hot_save_verl_fsdp.py: the preflight checks, and a snapshot of a live CPU training run.

The live run is the real trainer (``python -m verl_omni.trainer.main_stage3``, 2 CPU actor ranks) attached
to a Ray head this module starts under its own temp dir, so the tool can reach it through RAY_ADDRESS; only
the processes naming that temp dir are stopped at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from stage3_e2e_helpers import write_trainer_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "checkpoint" / "hot_save_verl_fsdp.py"
EXPORT = REPO / "tools" / "checkpoint" / "export_wnm_checkpoint.py"


def _tool():
    spec = importlib.util.spec_from_file_location("hot_save_verl_fsdp", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


# ----- preflight checks ---------------------------------------------------------------------------------
def test_driver_check_probes_local_pids_and_reports_remote_ones():
    mod, host = _tool(), socket.gethostname()
    alive = mod.check_driver_alive({"driver_pid": os.getpid(), "driver_host": host}, host)
    assert alive.ok is True and f"pid {os.getpid()}" in alive.detail
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = mod.check_driver_alive({"driver_pid": gone.pid, "driver_host": host}, host)
    assert dead.ok is False and "not running" in dead.detail
    remote = mod.check_driver_alive({"driver_pid": 1, "driver_host": "node-7"}, host)
    assert remote.ok is None and "node-7" in remote.detail
    assert mod.check_driver_alive({"driver_host": host}, host).ok is False


def test_worker_check_compares_only_when_asked():
    mod = _tool()
    assert mod.check_workers({"world_size": 8}, 8).ok is True
    wrong = mod.check_workers({"world_size": 8}, 16)
    assert wrong.ok is False and "8 actor worker(s), --expected-workers is 16" in wrong.detail
    assert mod.check_workers({"world_size": 8}, None).ok is None


def test_destination_check_refuses_existing_partial_and_too_little_space(tmp_path):
    mod = _tool()
    free = shutil.disk_usage(tmp_path).free
    dest = tmp_path / "snap" / "a"
    assert mod.check_destination(dest, 1000, 1.1).ok is True  # missing parents are fine (the driver creates them)
    short = mod.check_destination(dest, free, 1.5)
    assert short.ok is False and "GiB free" in short.detail
    dest.parent.mkdir()
    (dest.parent / "a.partial").mkdir()
    assert "a.partial exists" in mod.check_destination(dest, 1000, 1.1).detail
    dest.mkdir()
    assert "already exists" in mod.check_destination(dest, 1000, 1.1).detail


def test_unreachable_ray_address_fails_fast_and_writes_nothing(tmp_path):
    dest = tmp_path / "snap"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--destination", str(dest), "--ray-address", f"127.0.0.1:{_free_port()}"]
        + ["--execute"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[FAIL] ray" in proc.stdout and "nothing answers at 127.0.0.1:" in proc.stdout
    assert "set --ray-address (or RAY_ADDRESS)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ----- live run -----------------------------------------------------------------------------------------
def _free_port() -> int:
    # Outside Ray's default worker port range 10002-19999.
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))  # all interfaces: the Ray head listens on all of them
            port = s.getsockname()[1]
        if port >= 20000:
            return port
    raise RuntimeError("no free port >= 20000")


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "WAM_"))}
    # One explicit auth mode for the head, the driver and the tool (a ~/.ray/auth_token would otherwise turn
    # token authentication on for some of them only).
    env.update(
        {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    )
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def live_run(stage3_workspace, tmp_path_factory):
    """A training run in progress (many steps; stopped at teardown) with its Ray address and namespace."""
    from verl_omni.trainer.launch_env import processes_mentioning, terminate

    root = tmp_path_factory.mktemp("hot_save_run")
    # Short: Ray's socket paths under the temp dir must fit in 107 bytes.
    ray_tmp = f"/tmp/wnmhs_{uuid.uuid4().hex[:8]}"
    port = _free_port()
    address = f"127.0.0.1:{port}"  # Ray maps a loopback address to this node's IP; the GCS listens on both
    namespace = f"wnm_hot_save_test_{uuid.uuid4().hex[:6]}"
    cfg_dir, out = root / "config", root / "out"
    overrides = {"trainer.total_steps": 200, "trainer.save_freq": 1, "trainer.val_freq": 0, "trainer.log_media_freq": 0}
    write_trainer_config(cfg_dir / "live.yaml", stage3_workspace, out, **overrides)
    log_path = root / "driver.log"
    driver = None
    try:
        start = subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port)]
            + ["--temp-dir", ray_tmp, "--num-cpus", "4"]
            + ["--include-dashboard=false", "--disable-usage-stats"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert start.returncode == 0, start.stdout + start.stderr
        with open(log_path, "w") as log:
            driver = subprocess.Popen(
                [sys.executable, "-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir)]
                + ["--config-name", "live"],
                cwd=REPO,
                env=_env({"RAY_ADDRESS": address, "WAM_RAY_NAMESPACE": namespace}),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 600
        while "[stage3] step 1:" not in log_path.read_text():  # the control actor exists before step 1 starts
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"live run did not reach step 1 (rc {driver.poll()}):\n{log_path.read_text()[-4000:]}")
            time.sleep(1.0)
        yield {
            "address": address,
            "namespace": namespace,
            "output_dir": out,
            "driver": driver,
            "log": log_path,
            "base": Path(stage3_workspace["ckpt"]),
        }
    finally:
        if driver is not None and driver.poll() is None:
            driver.terminate()  # SIGTERM: the driver disconnects from Ray in its finally block
            try:
                driver.wait(60)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(30)
        terminate(processes_mentioning([ray_tmp + "/"]))
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _hot_save(live: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = _env({"RAY_ADDRESS": live["address"], "WAM_RAY_NAMESPACE": live["namespace"]})
    return subprocess.run(
        [sys.executable, str(TOOL), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_preflight_reports_the_run_and_writes_nothing(live_run, tmp_path):
    dest = tmp_path / "snapshots" / "now"
    proc = _hot_save(live_run, "--destination", str(dest), "--expected-workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preflight OK; nothing written" in proc.stdout
    assert f"[ok  ] driver       pid {live_run['driver'].pid} on {socket.gethostname()} is alive" in proc.stdout
    assert "[ok  ] workers      2 actor worker(s), as expected" in proc.stdout
    assert f"control actor wnm_stage3_control found in namespace {live_run['namespace']!r}" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_failed_preflight_exits_2_and_execute_requests_nothing(live_run, tmp_path):
    dest = tmp_path / "snap"
    wrong_workers = _hot_save(live_run, "--destination", str(dest), "--expected-workers", "3", "--execute")
    assert wrong_workers.returncode == 2, wrong_workers.stdout + wrong_workers.stderr
    assert "[FAIL] workers      run has 2 actor worker(s), --expected-workers is 3" in wrong_workers.stdout
    assert "nothing requested" in wrong_workers.stderr

    taken = tmp_path / "taken"
    taken.mkdir()
    exists = _hot_save(live_run, "--destination", str(taken), "--execute")
    assert exists.returncode == 2 and f"{taken} already exists" in exists.stdout

    wrong_ns = _hot_save(live_run, "--destination", str(dest), "--namespace", "no_such_run")
    assert wrong_ns.returncode == 2
    assert f"runs found in namespace(s) [{live_run['namespace']!r}]" in wrong_ns.stdout

    time.sleep(0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and list(taken.iterdir()) == []
    assert not any(p.name.startswith("snap") for p in tmp_path.iterdir())


def _full_state(actor_dir: Path, tmp: Path) -> dict:
    """Model + optimizer of an actor checkpoint via torch's own DCP -> torch.save converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{actor_dir.parent.name}.pt"
    dcp_to_torch_save(str(actor_dir), str(target))
    return torch.load(target, weights_only=False)


def _assert_same(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def test_execute_writes_a_consistent_snapshot_that_exports_and_loads(live_run, tmp_path):
    from verl_omni.models.wnm import check_contract_compatibility, load_wnm_checkpoint

    dest = tmp_path / "snap"
    proc = _hot_save(live_run, "--destination", str(dest), "--expected-workers", "2", "--execute", "--timeout", "240")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert live_run["driver"].poll() is None, "hot save must not stop training"
    state = json.loads((dest / "trainer_state.json").read_text())
    step = state["step"]
    assert state["hot_save"] is True and step >= 1
    assert f"snapshot of step {step} written to {dest}" in proc.stdout
    assert (dest / "actor" / ".metadata").is_file() and (dest / "actor" / "extra_state_rank_1.pt").is_file()

    # Taken at the same step boundary as the run's own checkpoint of that step: identical model and optimizer.
    regular = live_run["output_dir"] / f"global_step_{step}"
    _assert_same(_full_state(dest / "actor", tmp_path), _full_state(regular / "actor", tmp_path))

    out = tmp_path / "exported"
    export = subprocess.run(
        [sys.executable, str(EXPORT), "--base-vln", str(live_run["base"]), "--actor-checkpoint", str(dest)]
        + ["--output-dir", str(out), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stdout + export.stderr
    load_wnm_checkpoint(out)  # verifies every sha256 and builds the whole model
    assert check_contract_compatibility(out, live_run["base"]).ok
    prov = json.loads((out / "checkpoint_manifest.json").read_text())["provenance"]
    assert prov["hot_save"] is True and prov["step"] == step
    assert Path(prov["run_output_dir"]) == live_run["output_dir"].resolve()
