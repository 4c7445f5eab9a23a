"""Velocity evaluation shared by the rollout backend and the trainer's log-prob recomputation.

A *velocity function* has the ``WNMTransformer.forward`` signature::

    velocity_fn(target_latents [B, C, T', h, w], actions [B, 32, 4], sigma [B], context) -> (v_video, v_action)

Both the rollout and the trainer go through :func:`joint_velocity`, so given the same weights, inputs and
batch shape they run the same kernels and get the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from verl_omni.pipelines.wnm_shared.layers import JointLayout


class ContextLike(Protocol):
    """What the sampler needs from a prompt context (``WNMContext`` satisfies it)."""

    def select(self, index: torch.Tensor) -> ContextLike: ...

    def to(self, device: Any, dtype: torch.dtype | None = None) -> ContextLike: ...


VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


class NonFiniteError(FloatingPointError):
    """NaN or inf in latents, velocities or log-probs; names the requests and the denoising step."""

    def __init__(self, what: str, request_ids: Sequence[str], denoising_step: int | None) -> None:
        self.what = what
        self.request_ids = list(request_ids)
        self.denoising_step = denoising_step
        at = f" at denoising step {denoising_step}" if denoising_step is not None else ""
        shown = ", ".join(self.request_ids[:8]) + (" ..." if len(self.request_ids) > 8 else "")
        super().__init__(f"non-finite {what}{at} in request(s) {shown} ({len(self.request_ids)} affected)")


def check_finite(t: torch.Tensor, what: str, request_ids: Sequence[str], denoising_step: int | None = None) -> None:
    """Raises :class:`NonFiniteError` if any row of ``t`` (``[B, ...]``) holds NaN or inf."""
    ok = torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
    if not bool(ok.all()):
        bad = torch.nonzero(~ok).squeeze(1).tolist()
        raise NonFiniteError(what, [request_ids[i] for i in bad], denoising_step)


class FiniteChecks:
    """NaN/inf checks of one chunk's tensors, queued on the device and read with one host sync.

    Why not :func:`check_finite` after every step: each such check copies a flag to the host, which waits for the
    step's DiT forward to finish; the next step's kernels are then launched only after the Python in between has
    run, and the CPU work of a window step (its SDE noise) runs while the GPU waits. Queued, the flags cost a
    reduction kernel each and the CPU stays ahead of the GPU. :meth:`raise_first` names the same first failure
    (the earliest check, in the order they were added) as immediate checks would have, after the chunk's steps.
    Non-finite values raise nothing in the steps run meanwhile, so only their time is spent.

    Args:
        request_ids: ``B`` ids, one per row of every checked tensor.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._flags: list[torch.Tensor] = []
        self._labels: list[tuple[str, int | None]] = []

    def add(self, t: torch.Tensor, what: str, denoising_step: int | None = None) -> None:
        """Queues the check of ``t [B, ...]``: per row, whether every value is finite (no host sync)."""
        self._flags.append(torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1))
        self._labels.append((what, denoising_step))

    def raise_first(self) -> None:
        """Reads every queued flag at once and raises :class:`NonFiniteError` for the first failing check."""
        if not self._flags:
            return
        flags = torch.stack(self._flags).cpu()  # [checks, B]: the one sync
        labels = self._labels
        self._flags, self._labels = [], []
        failing = (~flags).any(dim=1).nonzero()
        if len(failing):
            first = int(failing[0, 0])
            bad = torch.nonzero(~flags[first]).squeeze(1).tolist()
            raise NonFiniteError(labels[first][0], [self.request_ids[i] for i in bad], labels[first][1])


def joint_velocity(
    velocity_fn: VelocityFn,
    layout: JointLayout,
    x: torch.Tensor,
    sigma: float,
    context: Any,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Velocity of the joint latent, returned in fp32.

    Args:
        velocity_fn: The DiT (or any function with its signature).
        layout: Joint-latent layout.
        x: ``[B, D]`` fp32 joint latents at noise level ``sigma``.
        sigma: Noise level shared by video and actions of every row.
        context: Context already holding exactly these ``B`` rows, on ``x``'s device.
        dtype: DiT compute dtype; inputs are cast to it, outputs back to fp32.

    Returns:
        ``[B, D]`` fp32 velocity ``eps - x0``.
    """
    video, actions = layout.split(x)
    sig = torch.full((x.shape[0],), float(sigma), dtype=torch.float32, device=x.device)
    v_video, v_actions = velocity_fn(video.to(dtype), actions.to(dtype), sig, context)
    if tuple(v_video.shape) != tuple(video.shape) or tuple(v_actions.shape) != tuple(actions.shape):
        raise ValueError(
            f"velocity function returned shapes {list(v_video.shape)} / {list(v_actions.shape)}, "
            f"expected {list(video.shape)} / {list(actions.shape)}"
        )
    return layout.join(v_video.float(), v_actions.float())


def counted_context(ctx: Any) -> Any:
    """``ctx`` with its attended-token counts read once (``WNMContext.with_attended_range``), so that the several
    forwards of one chunk (its denoising steps, or a window's transitions) do not each wait for the device to count
    them. Context types without the method are returned as they are."""
    with_range = getattr(ctx, "with_attended_range", None)
    return ctx if with_range is None else with_range()


def chunk_slices(n: int, chunk_size: int | None) -> list[slice]:
    """Consecutive slices covering ``range(n)`` of at most ``chunk_size`` (``None`` = one slice)."""
    size = n if chunk_size is None else chunk_size
    return [slice(i, min(i + size, n)) for i in range(0, n, max(size, 1))]
