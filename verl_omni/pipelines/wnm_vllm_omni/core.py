"""The WNM pipeline's work inside a vLLM-Omni worker, free of vllm imports (so it is tested on CPU).

The denoising loop is the shared one: :class:`WNMPipelineCore` samples through a
:class:`~verl_omni.pipelines.wnm_shared.native.NativeRolloutBackend` built over the worker's own DiT, i.e.
through ``wnm_shared``'s request-level RNG (``initial_noise``, ``sde_noise``), window selection
(``SamplerConfig.window``), SDE step and per-layer log-probs (``sde_step``, ``transition_layer_logprob``)
and velocity evaluation (``joint_velocity``). Nothing of the sampler is re-implemented here, so the two
backends give the same samples and log-probs for the same requests by construction; the tests check it.

What this module adds is what vLLM-Omni needs around it: request payloads in, per-request outputs out,
a store of prompt contexts (sent once per ``generate`` call, not once per rollout), a store of finished
outputs (collected by the client through a worker RPC), versioned weight loading and sleep/wake.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from verl_omni.data.actions import ActionLayout, ActionNormalization
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.native import NativeRolloutBackend
from verl_omni.pipelines.wnm_vllm_omni.protocol import ProtocolError, request_from_payload, split_results
from verl_omni.pipelines.wnm_vllm_omni.weight_sync import WeightBucket, WeightReceiver


class WNMPipelineCore:
    """Samples WNM rollouts for vLLM-Omni request payloads.

    Args:
        transformer: The DiT (``WNMTransformer`` signature), already on its device and dtype.
        video_shape: Target video latent shape ``(C, T', h, w)``.
        normalization: The checkpoint's action normalization.
        sampler: Sampler configuration; must equal the trainer's (same schedule, eta, window plan).
        config: Execution configuration of the shared sampler (device, dtype, deterministic, chunk size).
        action_layout: Action layout of the checkpoint.
    """

    def __init__(
        self,
        transformer: nn.Module,
        video_shape: tuple[int, int, int, int],
        normalization: ActionNormalization,
        sampler: SamplerConfig | None = None,
        config: NativeBackendConfig | None = None,
        action_layout: ActionLayout | None = None,
    ) -> None:
        self.sampler_backend = NativeRolloutBackend(
            transformer, video_shape, normalization, sampler, config, action_layout
        )
        self.weights = WeightReceiver(self.transformer)
        self._contexts: dict[str, object] = {}
        self._results: dict[str, dict] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model(cls, model, sampler: SamplerConfig | None = None, config: NativeBackendConfig | None = None):
        """Core over a ``WNMModel``'s transformer, shapes and action normalization."""
        cfg = model.config
        layout = ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks)
        return cls(
            model.transformer, tuple(cfg.target_latent_shape), model.action_normalization, sampler, config, layout
        )

    # ------------------------------------------------------------------------------------ properties
    @property
    def transformer(self) -> nn.Module:
        return self.sampler_backend.transformer

    @property
    def layout(self):
        return self.sampler_backend.layout

    @property
    def sampler(self) -> SamplerConfig:
        return self.sampler_backend.sampler

    @property
    def weight_version(self) -> int:
        return self.weights.version

    # ------------------------------------------------------------------------------------ contexts
    def put_contexts(self, key: str, contexts) -> int:
        """Stores the prompt contexts of one ``generate`` call; requests name them by ``context_key``."""
        with self._lock:
            self._contexts[str(key)] = contexts
            return len(self._contexts)

    def drop_contexts(self, key: str) -> bool:
        with self._lock:
            return self._contexts.pop(str(key), None) is not None

    # ------------------------------------------------------------------------------------ sampling
    def run(self, payloads: Sequence[Mapping]) -> list[dict]:
        """Samples every payload; one output dict per payload, in payload order.

        Requests of a batch may come from different ``generate`` calls: they are grouped by
        (context key, mode) and each group goes through the shared sampler, which makes every request's
        result independent of its batch (bit-identical in deterministic mode).
        """
        if not self.weights.ready:
            raise RuntimeError(f"WNM pipeline cannot sample: {self.weights.status()}")
        if self.sampler_backend.asleep:
            raise RuntimeError("WNM pipeline is asleep; wake it up before sending requests")
        parsed = []
        for p in payloads:
            req = request_from_payload(p)
            want = p.get("expected_weight_version")
            if want is not None and int(want) != self.weights.version:
                raise ProtocolError(
                    f"request {req.request_id} expects weight version {want}, the worker holds {self.weights.version}"
                )
            parsed.append((req, str(p["context_key"]), p.get("mode", "sde")))
        groups: dict[tuple[str, str], list[int]] = {}
        for i, (_, key, mode) in enumerate(parsed):
            groups.setdefault((key, mode), []).append(i)
        outputs: list[dict | None] = [None] * len(parsed)
        for (key, mode), idx in groups.items():
            with self._lock:
                contexts = self._contexts.get(key)
            if contexts is None:
                raise ProtocolError(f"no contexts stored under context_key {key!r} (put_contexts first)")
            results = self.sampler_backend.generate([parsed[i][0] for i in idx], contexts, ode=mode == "ode")
            for i, out in zip(idx, split_results(results, self.layout, self.weights.version), strict=True):
                outputs[i] = out
        return outputs

    def stash(self, outputs: Sequence[dict]) -> None:
        with self._lock:
            for o in outputs:
                self._results[o["request_id"]] = o

    def take_results(self, request_ids: Sequence[str]) -> list[dict]:
        """Removes and returns the stored outputs of ``request_ids`` (error naming the missing ones)."""
        with self._lock:
            missing = [r for r in request_ids if r not in self._results]
            if missing:
                raise KeyError(f"no finished output for requests {missing[:5]} ({len(missing)} missing)")
            return [self._results.pop(r) for r in request_ids]

    # ------------------------------------------------------------------------------------ weights / memory
    def begin_weight_sync(self, version: int, num_buckets: int) -> None:
        self.weights.begin(version, num_buckets)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        self.weights.load(bucket)

    def commit_weight_sync(self, version: int) -> int:
        v = self.weights.commit(version)
        self.sampler_backend.mark_weight_version(v)  # keep the shared sampler's own record in step
        return v

    def sleep(self) -> None:
        self.sampler_backend.sleep()

    def wake_up(self) -> None:
        self.sampler_backend.wake_up()

    def state_dict_names(self) -> list[str]:
        return list(self.transformer.state_dict())

    def dummy_output(self, request_id: str) -> dict:
        """What a vLLM-Omni warm-up ("dummy run") request gets: no sampling, no tensors."""
        return {"request_id": request_id, "dummy": True, "weight_version": self.weights.version}


def make_buckets_plan_for(core: WNMPipelineCore) -> list[tuple[str, torch.Size]]:
    """Names and shapes the worker expects in a weight sync (for a client-side sanity check)."""
    return [(n, t.shape) for n, t in core.transformer.state_dict().items()]
