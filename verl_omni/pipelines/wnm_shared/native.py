"""The ``native`` rollout backend: in-process, batched PyTorch generation (interface: :mod:`.backend`).

The DiT runs in the configured dtype (bf16 on GPU); the SDE math and log-probs run in fp32. Requests
that share a window run in lockstep, in chunks of ``NativeBackendConfig.effective_chunk_size``.

Determinism: torch's CPU kernels (GEMM blocking, long reductions split across threads) may round
differently for a batch of one than for a batch of sixteen. In deterministic mode (the CPU default)
every request is therefore evaluated on its own, so its tensors have the same shapes, hence the same
kernels and bits, whatever batch it arrived in. On GPU the default batches everything for throughput;
results then agree with the per-request ones to bf16 tolerance, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from verl_omni.data.actions import ActionLayout, ActionNormalization
from verl_omni.pipelines.wnm_shared.backend import RolloutBackend, RolloutResults, results_from_outputs
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.layers import NUM_LAYERS, JointLayout, LayerTable
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest
from verl_omni.pipelines.wnm_shared.rng import initial_noise, sde_noise
from verl_omni.pipelines.wnm_shared.sde import euler_step, sde_step, transition_layer_logprob
from verl_omni.pipelines.wnm_shared.velocity import (
    FiniteChecks,
    NonFiniteError,
    chunk_slices,
    counted_context,
    joint_velocity,
)


def context_rows_count(contexts) -> int | None:
    """Number of rows of a ``WNMContext``-like object, if it exposes ``encoder_tokens``."""
    tokens = getattr(contexts, "encoder_tokens", None)
    return int(tokens.shape[0]) if isinstance(tokens, torch.Tensor) else None


def validate_requests(requests: Sequence[RolloutRequest], sampler: SamplerConfig, num_rows: int | None) -> None:
    """Refuses empty batches, duplicate ids, foreign step counts and out-of-range context rows."""
    if not requests:
        raise ValueError("generate: empty request list")
    seen: set[str] = set()
    for r in requests:
        if not isinstance(r, RolloutRequest):
            raise TypeError(f"generate: expected RolloutRequest, got {type(r).__name__}")
        if r.request_id in seen:
            raise ValueError(f"generate: duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)
        if r.num_steps is not None and r.num_steps != sampler.num_steps:
            raise ValueError(
                f"request {r.request_id}: asks for {r.num_steps} denoising steps, the sampler runs {sampler.num_steps}"
            )
        if num_rows is not None and r.context_row >= num_rows:
            raise IndexError(f"request {r.request_id}: context_row {r.context_row} but the context has {num_rows} rows")


class NativeRolloutBackend(RolloutBackend):
    """In-process rollout backend.

    Args:
        transformer: Velocity module with the ``WNMTransformer.forward`` signature.
        video_shape: Target video latent shape ``(C, T', h, w)``.
        normalization: The checkpoint's action normalization (for decoding).
        sampler: Sampler configuration.
        config: Execution configuration.
        action_layout: Action layout (32 steps x 4 channels, 4 chunks).
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
        self.sampler = sampler or SamplerConfig()
        self.config = config or NativeBackendConfig()
        self.layout = JointLayout(video_shape, action_layout or ActionLayout())
        self.table = LayerTable(self.layout)
        self.normalization = normalization
        self.device = torch.device(self.config.device)
        self.transformer = transformer.to(device=self.device, dtype=self.config.torch_dtype).eval()
        self._version = 0
        self._asleep = False

    @classmethod
    def from_model(cls, model, sampler: SamplerConfig | None = None, config: NativeBackendConfig | None = None):
        """Builds the backend around a ``WNMModel`` (its transformer, shapes and action normalization)."""
        cfg = model.config
        layout = ActionLayout(steps=cfg.action_steps, chunks=cfg.action_chunks)
        if layout.num_channels != cfg.action_channels:
            raise ValueError(f"model action_channels {cfg.action_channels} != {layout.num_channels} of the contract")
        return cls(
            model.transformer, tuple(cfg.target_latent_shape), model.action_normalization, sampler, config, layout
        )

    # ----------------------------------------------------------------------------------------- interface
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake_up`."""
        return self._asleep

    def mark_weight_version(self, version: int) -> None:
        """Records that the module's weights are now ``version`` without copying anything.

        For the colocated case, where the backend runs the very module the actor just updated in place.
        """
        self._version = int(version)

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copies a full set of DiT parameters/buffers into the backend's transformer."""
        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        state = self.transformer.state_dict()
        unknown = sorted(set(items) - set(state))
        missing = sorted(set(state) - set(items))
        if unknown or missing:
            raise KeyError(
                f"update_weights(version={version}): unknown names {unknown[:5]}, missing names {missing[:5]}"
            )
        for name, tensor in items.items():
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {list(tensor.shape)}, expected {list(state[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in items.items():
                state[name].copy_(tensor)
        self._version = int(version)

    def sleep(self) -> None:
        """Moves the DiT to CPU and frees cached accelerator memory."""
        if self.device.type != "cpu":
            self.transformer.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self) -> None:
        self.transformer.to(self.device)
        self._asleep = False

    # ----------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest], contexts, ode: bool = False) -> RolloutResults:
        """Samples every request; results in request order.

        Args:
            requests: ``R`` requests (may mix prompts, strata, branches).
            contexts: ``WNMContext``-like with one row per prompt (``request.context_row`` indexes it).
            ode: Deterministic evaluation: every step is an Euler step (eta = 0) from the request's initial
                noise; the window tensors come back empty (``W = 0``) and there are no log-probs.
        """
        if self._asleep:
            raise RuntimeError("generate called while the native backend is asleep; call wake_up() first")
        validate_requests(requests, self.sampler, context_rows_count(contexts))
        sigmas = self.sampler.sigmas()
        ctx = contexts.to(self.device, self.config.torch_dtype)
        if getattr(self.transformer, "history_attention", "full") == "isolated" and ctx.history_kv is None:
            ctx = self._with_history_kv(ctx)
        windows = [() if ode else self.sampler.window(r.seed, r.step) for r in requests]
        # Requests sharing a window run in lockstep; in a training step there is one window.
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, w in enumerate(windows):
            groups.setdefault(w, []).append(i)
        per_request: list[dict | None] = [None] * len(requests)
        for window, idx in groups.items():
            # Steps before the window are deterministic Euler steps from x_0: rollouts that share x_0 (the
            # branches of a stratum) and a context row are identical there, so each distinct trajectory is
            # computed once and the branches fork at the window. In ODE mode that holds for all K steps.
            first_sde = window[0] if window else self.sampler.num_steps
            starts = self._shared_prefix([requests[i] for i in idx], ctx, sigmas, first_sde)
            for sl in chunk_slices(len(idx), self.config.effective_chunk_size):
                chunk = [requests[i] for i in idx[sl]]
                x = torch.stack([starts[j] for j in range(sl.start, sl.stop)])
                outs = self._denoise(chunk, ctx, sigmas, window, x, first_sde)
                for i, out in zip(idx[sl], outs, strict=True):
                    per_request[i] = out
        return results_from_outputs(requests, per_request, sigmas, self.layout, self.normalization, self._version)

    def _with_history_kv(self, ctx):
        """Computes an ``isolated`` model's history keys/values once per prompt row for all its rollouts.

        In deterministic mode each row is computed on its own (batch of one), like everything else there.
        """
        if not self.config.deterministic:
            return ctx.with_history_kv(self.transformer.history_kv(ctx))
        rows = [self.transformer.history_kv(ctx.select(torch.tensor([i]))) for i in range(ctx.batch_size)]
        kv = tuple(
            (torch.cat([r[b][0] for r in rows]), torch.cat([r[b][1] for r in rows])) for b in range(len(rows[0]))
        )
        return ctx.with_history_kv(kv)

    def _prefix_key(self, r: RolloutRequest) -> tuple:
        """Requests with equal keys start from the same ``x_0`` with the same context row."""
        branch = None if self.sampler.shared_initial_noise else r.branch
        return (r.seed, r.step, r.sample_id, r.stratum, branch, r.context_row)

    def _initial_noise(self, r: RolloutRequest) -> torch.Tensor:
        branch = None if self.sampler.shared_initial_noise else r.branch
        return initial_noise(r.seed, r.step, r.sample_id, r.stratum, self.layout.numel, branch)

    def _shared_prefix(
        self, requests: list[RolloutRequest], ctx, sigmas: torch.Tensor, first_sde: int
    ) -> list[torch.Tensor]:
        """``x`` entering step ``first_sde`` for every request, computing each distinct prefix once.

        Args:
            requests: Requests of one window group.
            ctx: Contexts on the backend's device.
            sigmas: ``[K + 1]`` schedule.
            first_sde: First SDE step (``K`` in ODE mode); steps ``[0, first_sde)`` are Euler.

        Returns:
            ``R`` tensors ``[D]`` fp32 on the backend's device, in request order. With
            ``NativeBackendConfig.share_prefix`` off every request gets its own prefix (for benchmarks).
        """
        keys = [self._prefix_key(r) if self.config.share_prefix else i for i, r in enumerate(requests)]
        unique: dict = {}
        for r, k in zip(requests, keys, strict=True):
            unique.setdefault(k, r)
        reps = list(unique.values())
        states: list[torch.Tensor] = []
        for sl in chunk_slices(len(reps), self.config.effective_chunk_size):
            chunk = reps[sl]
            x = torch.stack([self._initial_noise(r) for r in chunk]).to(self.device)
            try:
                x = self._euler_steps(chunk, ctx, sigmas, x, 0, first_sde)
            except NonFiniteError as e:
                # Name every request that shares a failing prefix, not just the one that computed it.
                bad = {k for k, r in unique.items() if r.request_id in set(e.request_ids)}
                affected = [r.request_id for r, k in zip(requests, keys, strict=True) if k in bad]
                raise NonFiniteError(e.what, affected, e.denoising_step) from e
            states.extend(x.unbind(0))
        by_key = dict(zip(unique, states, strict=True))
        return [by_key[k] for k in keys]

    def _euler_steps(self, chunk, ctx, sigmas: torch.Tensor, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Deterministic Euler steps ``[start, stop)`` for one chunk."""
        if stop <= start:
            return x
        ids = [r.request_id for r in chunk]
        rows = torch.tensor([r.context_row for r in chunk], dtype=torch.int64, device=self.device)
        chunk_ctx = counted_context(ctx.select(rows))
        checks = FiniteChecks(ids)
        for i in range(start, stop):
            s, s_next = float(sigmas[i]), float(sigmas[i + 1])
            v = joint_velocity(self.transformer, self.layout, x, s, chunk_ctx, self.config.torch_dtype)
            if self.config.check_finite:
                checks.add(v, "velocity", i)
            x = euler_step(x, v, s, s_next)
            if self.config.check_finite:
                checks.add(x, "latents", i)
        checks.raise_first()
        return x

    def _denoise(
        self,
        chunk: list[RolloutRequest],
        ctx,
        sigmas: torch.Tensor,
        window: tuple[int, ...],
        x: torch.Tensor,
        start: int,
    ) -> list[dict]:
        """Runs steps ``[start, K)`` for one chunk of requests sharing ``window``; per-request CPU outputs.

        Args:
            x: ``[B, D]`` fp32 latents entering step ``start`` (the shared prefix's result).
        """
        ids = [r.request_id for r in chunk]
        dev, numel = self.device, self.layout.numel
        rows = torch.tensor([r.context_row for r in chunk], dtype=torch.int64, device=dev)
        chunk_ctx = counted_context(ctx.select(rows))
        checks = FiniteChecks(ids)
        states, logps, coefs = [], [], []
        for i in range(start, self.sampler.num_steps):
            s, s_next = float(sigmas[i]), float(sigmas[i + 1])
            v = joint_velocity(self.transformer, self.layout, x, s, chunk_ctx, self.config.torch_dtype)
            if self.config.check_finite:
                checks.add(v, "velocity", i)
            if i in window:
                g = self.sampler.noise_coefficient(sigmas, i)
                noise = torch.stack(
                    [sde_noise(r.seed, r.step, r.sample_id, r.stratum, r.branch, i, numel) for r in chunk]
                ).to(dev)
                states.append(x)
                x_next, _ = sde_step(x, v, noise, s, s_next, g)
                logps.append(transition_layer_logprob(x, v, x_next, s, s_next, g, self.table))
                coefs.append(g)
                if i == window[-1]:
                    states.append(x_next)
            else:
                x_next = euler_step(x, v, s, s_next)
            if self.config.check_finite:
                checks.add(x_next, "latents", i)
            x = x_next
        b = len(chunk)
        if logps and self.config.check_finite:
            checks.add(torch.stack(logps, 1), "log-probs", None)
        checks.raise_first()
        if logps:
            states_t = torch.stack(states, 1).cpu()
            logps_t = torch.stack(logps, 1).cpu()
        else:  # ODE: no SDE window
            states_t = torch.zeros(b, 0, numel)
            logps_t = torch.zeros(b, 0, NUM_LAYERS)
        final = x.cpu()
        steps_t = torch.tensor(window, dtype=torch.int64)
        coefs_t = torch.tensor(coefs, dtype=torch.float64)
        return [
            {
                "final": final[j],
                "window_states": states_t[j],
                "logprobs": logps_t[j],
                "window_steps": steps_t,
                "noise_coefs": coefs_t,
            }
            for j in range(len(chunk))
        ]
