"""What crosses the vLLM-Omni boundary: request fields in, per-request rollout tensors out (no vllm import).

A :class:`RolloutRequest` travels as a plain dict in ``sampling_params.extra_args["wnm"]`` of a vLLM-Omni
diffusion request; the prompt context rows travel once per ``generate`` call under a ``context_key``
(worker RPC, see ``worker_ext.py``), not once per rollout. Each request comes back as a dict of CPU
tensors, and :func:`assemble_results` stacks them into the same :class:`RolloutResults` that the
``native`` backend returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.pipelines.wnm_shared.backend import RolloutResults, results_from_outputs
from verl_omni.pipelines.wnm_shared.layers import NUM_LAYERS, JointLayout
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest

WIRE_VERSION = 1
EXTRA_ARGS_KEY = "wnm"
MODES = ("sde", "ode")
OUTPUT_KEYS = ("final", "window_states", "logprobs", "window_steps", "noise_coefs")


class ProtocolError(ValueError):
    """A request or result dict that does not follow this module's wire format."""


def request_payload(
    request: RolloutRequest, context_key: str, mode: str = "sde", expected_weight_version: int | None = None
) -> dict:
    """The ``extra_args["wnm"]`` dict of one rollout request."""
    if mode not in MODES:
        raise ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
    return {
        "wire": WIRE_VERSION,
        "request_id": request.request_id,
        "sample_id": request.sample_id,
        "stratum": request.stratum,
        "branch": request.branch,
        "step": request.step,
        "seed": request.seed,
        "context_row": request.context_row,
        "num_steps": request.num_steps,
        "layer_names": list(request.layer_names) if request.layer_names is not None else None,
        "context_key": str(context_key),
        "mode": mode,
        "expected_weight_version": expected_weight_version,
    }


def request_from_payload(payload: Mapping) -> RolloutRequest:
    """Inverse of :func:`request_payload` (validates through ``RolloutRequest`` itself)."""
    if not isinstance(payload, Mapping):
        raise ProtocolError(f"expected a dict under extra_args[{EXTRA_ARGS_KEY!r}], got {type(payload).__name__}")
    if payload.get("wire") != WIRE_VERSION:
        raise ProtocolError(f"wire version {payload.get('wire')!r} != {WIRE_VERSION} (client and worker differ)")
    missing = [
        k for k in ("request_id", "sample_id", "stratum", "branch", "step", "seed", "context_key") if k not in payload
    ]
    if missing:
        raise ProtocolError(f"request payload lacks {missing}")
    names = payload.get("layer_names")
    return RolloutRequest(
        sample_id=payload["sample_id"],
        stratum=payload["stratum"],
        branch=payload["branch"],
        step=payload["step"],
        seed=payload["seed"],
        context_row=payload.get("context_row", 0),
        request_id=payload["request_id"],
        num_steps=payload.get("num_steps"),
        layer_names=tuple(names) if names is not None else None,
    )


def split_results(results: RolloutResults, layout: JointLayout, weight_version: int) -> list[dict]:
    """One output dict per request of ``results`` (CPU tensors, each request's own copy)."""
    final = layout.join(results.video_latents.float(), results.actions_normalized.float())
    return [
        {
            "request_id": rid,
            "final": final[j].clone(),
            "window_states": results.window_states[j].clone(),
            "logprobs": results.logprobs[j].clone(),
            "window_steps": results.window_steps[j].clone(),
            "noise_coefs": results.noise_coefs[j].clone(),
            "weight_version": int(weight_version),
        }
        for j, rid in enumerate(results.request_ids)
    ]


def assemble_results(
    requests: Sequence[RolloutRequest],
    outputs: Sequence[Mapping],
    sigmas: torch.Tensor,
    layout: JointLayout,
    normalization: ActionNormalization,
) -> RolloutResults:
    """Per-request output dicts (any order) -> :class:`RolloutResults` in request order.

    Refuses missing, duplicate or foreign request ids, malformed tensors, and outputs produced by
    different weight versions (one ``generate`` call must be on one policy).
    """
    by_id: dict[str, Mapping] = {}
    for out in outputs:
        rid = out.get("request_id")
        if rid in by_id:
            raise ProtocolError(f"duplicate output for request {rid!r}")
        by_id[rid] = out
    wanted = [r.request_id for r in requests]
    missing = [rid for rid in wanted if rid not in by_id]
    extra = sorted(set(by_id) - set(wanted))
    if missing or extra:
        raise ProtocolError(f"outputs do not match requests: missing {missing[:5]}, unexpected {extra[:5]}")
    ordered = [by_id[rid] for rid in wanted]
    versions = {int(o["weight_version"]) for o in ordered}
    if len(versions) != 1:
        raise ProtocolError(f"one generate call got outputs of several weight versions {sorted(versions)}")
    numel = layout.numel
    for o in ordered:
        if tuple(o["final"].shape) != (numel,):
            raise ProtocolError(f"request {o['request_id']}: final latent shape {list(o['final'].shape)} != [{numel}]")
        w = int(o["window_steps"].shape[0])
        if tuple(o["logprobs"].shape) != (w, NUM_LAYERS) or tuple(o["window_states"].shape) != (
            (w + 1, numel) if w else (0, numel)
        ):
            raise ProtocolError(
                f"request {o['request_id']}: window tensors {list(o['window_states'].shape)} / "
                f"{list(o['logprobs'].shape)} do not fit a window of {w} steps"
            )
    return results_from_outputs(
        requests, [{k: o[k] for k in OUTPUT_KEYS} for o in ordered], sigmas, layout, normalization, versions.pop()
    )
