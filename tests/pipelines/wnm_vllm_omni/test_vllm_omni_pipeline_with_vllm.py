"""The registered pipeline with vLLM-Omni's own classes (needs the vllm-omni extra; run by
scripts/check_vllm_omni.sh, skipped elsewhere). CPU is enough: these tests construct vLLM-Omni's request,
batch and output types and its registry, not its CUDA engine."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_omni")

from vllm_omni.diffusion.data import DiffusionOutput  # noqa: E402
from vllm_omni.diffusion.registry import DiffusionModelRegistry  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402

from verl_omni.models.wnm import WNMConfig, build_wnm_model  # noqa: E402
from verl_omni.pipelines.wnm_shared import (  # noqa: E402
    NativeBackendConfig,
    NativeRolloutBackend,
    SamplerConfig,
    stratified_requests,
)
from verl_omni.pipelines.wnm_vllm_omni.pipeline import PIPELINE_ARCH, WNMDiTPipeline, sampler_to_args  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.protocol import assemble_results, request_payload  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.registration import register  # noqa: E402
from verl_omni.pipelines.wnm_vllm_omni.worker_ext import WNMWorkerExtension  # noqa: E402

SAMPLER = SamplerConfig(num_steps=3, window_strategy="fixed", window_start=0, window_size=2)


def test_entry_point_plugin_registers_the_pipeline():
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()  # what every vLLM-Omni process does at start
    assert DiffusionModelRegistry._try_load_model_cls(PIPELINE_ARCH) is WNMDiTPipeline
    assert register() is True


def test_forward_on_vllm_omni_batch_matches_native():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    h, w = model.config.image_size
    frames = torch.randint(0, 256, (1, 33, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ctx = model.encode_context(frames, ["go to the door"])
    od = SimpleNamespace(
        model=None, dtype=torch.float32, custom_pipeline_args={"sampler": sampler_to_args(SAMPLER), "device": "cpu"}
    )
    pipe = WNMDiTPipeline(od_config=od, model=model)
    worker = type("Worker", (WNMWorkerExtension,), {})()
    worker.model_runner = SimpleNamespace(pipeline=pipe)
    requests = stratified_requests(["p0"], run_seed=3, step=1, num_strata=1, num_branches=2)
    worker.wnm_put_contexts("k", ctx)
    batch = DiffusionRequestBatch(
        requests=[
            OmniDiffusionRequest(
                prompt="wnm",
                sampling_params=OmniDiffusionSamplingParams(extra_args={"wnm": request_payload(r, "k")}),
                request_id=r.request_id,
            )
            for r in requests
        ]
    )
    outs = pipe.forward(batch)
    assert [type(o) for o in outs] == [DiffusionOutput, DiffusionOutput] and all(o.error is None for o in outs)
    assert [o.output["wnm_request_id"] for o in outs] == [r.request_id for r in requests]
    taken = worker.wnm_take_results([r.request_id for r in requests])
    got = assemble_results(requests, taken, SAMPLER.sigmas(), pipe.core.layout, model.action_normalization)
    ref = NativeRolloutBackend.from_model(model, SAMPLER, NativeBackendConfig()).generate(requests, ctx)
    for name in ("actions", "video_latents", "window_states", "logprobs"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # A request without our fields is an error output, not an engine crash.
    bad = OmniDiffusionRequest(prompt="x", sampling_params=OmniDiffusionSamplingParams(), request_id="r1")
    assert "extra_args" in pipe.forward(DiffusionRequestBatch(requests=[bad]))[0].error
