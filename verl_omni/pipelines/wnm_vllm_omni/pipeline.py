"""The vLLM-Omni diffusion pipeline of the WNM DiT (registered as ``WNMDiTPipeline``, see ``registration.py``).

vLLM-Omni constructs it in each diffusion worker as ``WNMDiTPipeline(od_config=..., prefix=...)``, calls
``load_weights`` through its loader and then ``forward(batch)`` with a ``DiffusionRequestBatch``
(``supports_request_batch``: the scheduler may put up to ``max_num_seqs`` rollouts in one call). Each
request carries our :class:`RolloutRequest` fields in ``sampling_params.extra_args["wnm"]``
(``protocol.py``); the sampling itself is :class:`WNMPipelineCore`, i.e. the shared ``wnm_shared`` sampler.

This module imports vllm_omni only inside ``forward`` (for ``DiffusionOutput``), so the class can be
built and inspected where vllm is not installed. ``od_config`` fields used:

- ``model``: a complete WNM checkpoint directory (``tools/checkpoint``); only its DiT and action
  normalization are loaded here (the frozen encoders stay with the trainer, which sends contexts);
- ``dtype``: DiT compute dtype (the SDE math and log-probs are fp32 regardless);
- ``custom_pipeline_args``: ``{"sampler": {SamplerConfig fields}, "deterministic": bool|None,
  "chunk_size": int|None, "history_attention": "full"|"isolated"|None, "gelu_epilogue": bool|None,
  "norm_rope_kernel": bool|None, "residual_norm_kernel": bool|None,
  "attention_backend": "default"|"cudnn"|"fa4"|None}``; the sampler fields and the history attention must equal
  the trainer's (the client sends them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_vllm_omni.core import WNMPipelineCore
from verl_omni.pipelines.wnm_vllm_omni.protocol import EXTRA_ARGS_KEY, ProtocolError

PIPELINE_ARCH = "WNMDiTPipeline"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def sampler_from_args(args: Mapping | None) -> SamplerConfig:
    fields = dict((args or {}).get("sampler") or {})
    if fields.get("window_range") is not None:
        fields["window_range"] = tuple(fields["window_range"])
    return SamplerConfig(**fields)


def sampler_to_args(sampler: SamplerConfig) -> dict:
    out = dataclasses.asdict(sampler)
    out["window_range"] = list(sampler.window_range)
    return out


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return _DTYPE_NAMES.get(dtype, "float32")
    name = str(dtype).split(".")[-1]
    return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}.get(name, name)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class WNMDiTPipeline(nn.Module):
    """WNM world-action DiT as a vLLM-Omni diffusion pipeline.

    Args:
        od_config: vLLM-Omni's ``OmniDiffusionConfig`` (or any object with ``model``, ``dtype`` and
            ``custom_pipeline_args``).
        prefix: Module prefix given by vLLM-Omni (unused).
        model: A ``WNMModel`` to wrap instead of loading ``od_config.model`` (tests, in-process use).
    """

    supports_request_batch = True

    def __init__(self, *, od_config, prefix: str = "", model=None) -> None:
        super().__init__()
        self.od_config = od_config
        self.prefix = prefix
        args = dict(getattr(od_config, "custom_pipeline_args", None) or {})
        sampler = sampler_from_args(args)
        device = str(args.get("device") or _device())
        config = NativeBackendConfig(
            device=device,
            dtype=_dtype_name(getattr(od_config, "dtype", "float32")),
            deterministic=args.get("deterministic"),
            chunk_size=args.get("chunk_size"),
        )
        if model is None:
            from verl_omni.models.wnm import load_wnm_checkpoint

            if not getattr(od_config, "model", None):
                raise ValueError("WNMDiTPipeline needs od_config.model = a complete WNM checkpoint directory")
            model = load_wnm_checkpoint(od_config.model, device="cpu", dtype=torch.float32)
        # The trainer's model settings (each refuses a bad value by name); None keeps the model's own.
        if args.get("history_attention") is not None:
            model.transformer.set_history_attention(args["history_attention"])
        if args.get("gelu_epilogue") is not None:
            model.transformer.gelu_epilogue = args["gelu_epilogue"]
        if args.get("norm_rope_kernel") is not None:
            model.transformer.norm_rope_kernel = args["norm_rope_kernel"]
        if args.get("residual_norm_kernel") is not None:
            model.transformer.residual_norm_kernel = args["residual_norm_kernel"]
        if args.get("attention_backend") is not None:
            model.transformer.attention_backend = args["attention_backend"]
        self.core = WNMPipelineCore.from_model(model, sampler, config)
        # Registered as a submodule so vLLM-Omni's hooks (sequence parallel plans, offload, sleep mode)
        # find the DiT where they look for it.
        self.transformer = self.core.transformer

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] = ()) -> set[str]:
        """vLLM-Omni loader hook: the DiT was loaded (sha256-verified) from the checkpoint in ``__init__``.

        Tensors offered here (named like ``transformer.<param>`` or ``<param>``) are copied in; the names
        of every DiT tensor are returned as loaded.
        """
        state = self.transformer.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                key = name[len("transformer.") :] if name.startswith("transformer.") else name
                if key in state and tuple(state[key].shape) == tuple(tensor.shape):
                    state[key].copy_(tensor.to(state[key].device, state[key].dtype))
        return {f"transformer.{n}" for n in state}

    # ------------------------------------------------------------------------------------------ forward
    @staticmethod
    def request_payload(req) -> dict | None:
        """Our dict in ``req.sampling_params.extra_args``, or None (e.g. vLLM-Omni's warm-up request)."""
        extra = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
        return extra.get(EXTRA_ARGS_KEY)

    def run_batch(self, requests: list) -> list[dict]:
        """Per-request output dicts for vLLM-Omni requests; stores them for ``wnm_take_results``.

        Warm-up requests (no ``extra_args["wnm"]``) get a dummy output and are not stored.
        """
        payloads, real = [], []
        outs: list[dict | None] = [None] * len(requests)
        for i, req in enumerate(requests):
            p = self.request_payload(req)
            if p is None:
                is_dummy = getattr(req, "is_dummy_run", lambda: False)()
                if not is_dummy:
                    rid = getattr(req, "request_id", "?")
                    raise ProtocolError(f"request {rid} has no sampling_params.extra_args[{EXTRA_ARGS_KEY!r}]")
                outs[i] = self.core.dummy_output(getattr(req, "request_id", "dummy"))
                continue
            payloads.append(p)
            real.append(i)
        if payloads:
            results = self.core.run(payloads)
            self.core.stash(results)
            for i, r in zip(real, results, strict=True):
                outs[i] = r
        return outs

    def forward(self, batch, **kwargs):
        """``DiffusionRequestBatch`` (or one request) -> one ``DiffusionOutput`` per request.

        The tensors stay in the worker (collected with the ``wnm_take_results`` RPC); the output carries
        the request id and weight version, so vLLM-Omni's output formatting never touches them.
        """
        from vllm_omni.diffusion.data import DiffusionOutput

        requests = list(getattr(batch, "requests", None) or [batch])
        try:
            outs = self.run_batch(requests)
        except Exception as e:  # one failing batch must not take the engine down; the client raises it
            return [DiffusionOutput(error=f"WNMDiTPipeline: {type(e).__name__}: {e}") for _ in requests]
        return [
            DiffusionOutput(
                output={"wnm_request_id": o["request_id"], "wnm_weight_version": o["weight_version"]},
            )
            for o in outs
        ]


def get_wnm_post_process_func(od_config):
    """Identity post-process (the outputs are small markers; the tensors are taken by RPC)."""
    del od_config
    return _identity


def _identity(x):
    return x
