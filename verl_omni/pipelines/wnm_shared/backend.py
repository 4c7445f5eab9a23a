"""The rollout backend interface and the results it returns."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, STOP_CHANNEL
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest
from verl_omni.pipelines.wnm_shared.schedule import sigmas_to_timesteps

STOP_THRESHOLD = 0.5  # docs/contracts.md: decoded stop flag = denormalized stop > 0.5
DYAW_CHANNEL = 2


def decode_actions(normalized: torch.Tensor, normalization: ActionNormalization) -> torch.Tensor:
    """Normalized model actions -> metres, radians and stop flags.

    Args:
        normalized: ``[..., 4]`` ``(dx, dy, dyaw, stop)`` in the checkpoint's normalized space.
        normalization: The checkpoint's action normalization.

    Returns:
        ``[..., 4]`` fp32: ``dx, dy`` in metres, ``dyaw`` in radians wrapped to ``(-pi, pi]``, stop in {0, 1}.
    """
    raw = normalization.denormalize(normalized.float())
    dyaw = raw[..., DYAW_CHANNEL]
    wrapped = math.pi - torch.remainder(math.pi - dyaw, 2.0 * math.pi)
    stop = (raw[..., STOP_CHANNEL] > STOP_THRESHOLD).to(raw.dtype)
    return torch.stack([raw[..., 0], raw[..., 1], wrapped, stop], dim=-1)


@dataclass
class RolloutResults:
    """Rollouts of one ``generate`` call, in request order (all tensors on CPU).

    Attributes:
        request_ids: ``R`` request ids.
        requests: The requests themselves.
        actions: ``[R, 32, 4]`` decoded actions (metres, radians, stop flags).
        actions_normalized: ``[R, 32, 4]`` final action latents (normalized space).
        video_latents: ``[R, C, T', h, w]`` final target video latents.
        window_steps: ``[R, W]`` int64 denoising steps of each request's SDE window.
        window_states: ``[R, W + 1, D]`` fp32 joint latents: ``x_i`` before each window step and
            ``x_{i+1}`` after the last (the window is contiguous).
        noise_coefs: ``[R, W]`` float64 ``g_i`` of each window step.
        sigmas: ``[K + 1]`` float64 schedule.
        timesteps: ``[K]`` float64 (``1000 s_i``).
        logprobs: ``[R, W, 9]`` fp32 per-layer log-probs of each window transition.
        context_rows: ``[R]`` int64 rows of the context each request used.
        weight_version: Version of the weights that produced them.
        layer_names: :data:`LAYER_NAMES`.
    """

    request_ids: list[str]
    requests: list[RolloutRequest]
    actions: torch.Tensor
    actions_normalized: torch.Tensor
    video_latents: torch.Tensor
    window_steps: torch.Tensor
    window_states: torch.Tensor
    noise_coefs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    logprobs: torch.Tensor
    context_rows: torch.Tensor
    weight_version: int
    layer_names: tuple[str, ...] = LAYER_NAMES

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def strata(self) -> torch.Tensor:
        return torch.tensor([r.stratum for r in self.requests], dtype=torch.int64)

    @property
    def sample_ids(self) -> list[str]:
        return [r.sample_id for r in self.requests]

    # Fields shared by every rollout of one call (the schedule, the weights), as opposed to per-rollout rows.
    _SHARED = ("sigmas", "timesteps", "weight_version", "layer_names")

    def head(self, n: int) -> RolloutResults:
        """The first ``n`` rollouts (shared fields unchanged)."""
        return RolloutResults(
            **{
                f.name: getattr(self, f.name) if f.name in self._SHARED else getattr(self, f.name)[:n]
                for f in dataclasses.fields(self)
            }
        )

    @classmethod
    def concat(cls, parts: Sequence[RolloutResults], row_offsets: Sequence[int]) -> RolloutResults:
        """Concatenates per-rank results in rank order.

        Args:
            parts: One result per rank, all from the same weight version.
            row_offsets: ``row_offsets[r]``: context rows of the ranks before ``r``; each part's ``context_rows``
                are shifted by it, so they index the concatenation of the ranks' contexts.

        Raises:
            RuntimeError: the parts come from different weight versions.
        """
        versions = {p.weight_version for p in parts}
        if len(versions) != 1:
            raise RuntimeError(f"ranks returned rollouts from different weight versions {sorted(versions)}")
        out = {}
        for f in dataclasses.fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if f.name in cls._SHARED:
                out[f.name] = vals[0]
            elif f.name == "context_rows":
                out[f.name] = torch.cat([v + off for v, off in zip(vals, row_offsets, strict=True)])
            elif f.name in ("request_ids", "requests"):
                out[f.name] = [x for v in vals for x in v]
            else:
                out[f.name] = torch.cat(vals, dim=0)
        return cls(**out)


def results_from_outputs(
    requests: Sequence[RolloutRequest],
    outputs: Sequence[Mapping[str, torch.Tensor]],
    sigmas: torch.Tensor,
    layout,
    normalization: ActionNormalization,
    weight_version: int,
) -> RolloutResults:
    """Per-request sampler outputs, already in request order, -> :class:`RolloutResults`.

    Args:
        requests: ``R`` requests.
        outputs: ``R`` dicts with ``final [D]``, ``window_states [W+1, D]``, ``logprobs [W, 9]``,
            ``window_steps [W]`` and ``noise_coefs [W]``; ``outputs[i]`` belongs to ``requests[i]``.
        sigmas: ``[K + 1]`` schedule the outputs were sampled with.
        layout: The ``JointLayout`` that splits a joint latent into video and actions.
        normalization: The checkpoint's action normalization (for decoding).
        weight_version: Version of the weights that produced the outputs.
    """
    stacked = {k: torch.stack([o[k] for o in outputs]) for k in outputs[0]}
    video, actions_norm = layout.split(stacked.pop("final").float())
    return RolloutResults(
        request_ids=[r.request_id for r in requests],
        requests=list(requests),
        actions=decode_actions(actions_norm, normalization),
        actions_normalized=actions_norm.clone(),
        video_latents=video.clone(),
        window_steps=stacked["window_steps"],
        window_states=stacked["window_states"],
        noise_coefs=stacked["noise_coefs"],
        sigmas=sigmas,
        timesteps=sigmas_to_timesteps(sigmas),
        logprobs=stacked["logprobs"],
        context_rows=torch.tensor([r.context_row for r in requests], dtype=torch.int64),
        weight_version=int(weight_version),
    )


class RolloutBackend(abc.ABC):
    """What the rollout worker calls; implementations: ``native`` (in-process PyTorch, :mod:`.native`) and
    ``vllm_omni`` (:mod:`verl_omni.pipelines.wnm_vllm_omni.backend`)."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[RolloutRequest], contexts, ode: bool = False) -> RolloutResults:
        """Runs the rollouts. ``contexts`` holds one row per prompt; requests point at rows.

        ``ode``: deterministic evaluation (every step an Euler step from the request's initial noise); the
        window tensors come back empty (``W = 0``) and there are no log-probs.
        """

    @abc.abstractmethod
    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Loads new DiT weights (all of them, by parameter name) and records their version."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Releases accelerator memory between rollout phases."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Restores what :meth:`sleep` released."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""
