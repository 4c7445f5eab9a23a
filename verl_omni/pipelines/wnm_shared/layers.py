"""The joint-latent layout and the table of credit layers (docs/contracts.md "Layers").

The joint latent of one rollout is a flat fp32 vector ``[D]`` = the flattened target video latents
``[C, T', h, w]`` (row-major) followed by the flattened normalized actions ``[steps, channels]`` (row-major,
channels ``dx, dy, dyaw, stop``). Every dimension belongs to exactly one credit layer:

- ``visual``: every video-latent dimension;
- ``nav_k``: ``dx, dy, dyaw`` of the steps of chunk ``k`` (steps ``8(k-1) .. 8k-1``);
- ``stop_k``: the ``stop`` channel of the steps of chunk ``k``.

Rewards, advantages, log-probs and losses are all keyed by :data:`LAYER_NAMES`, in this order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from verl_omni.contracts import LAYER_NAMES, NUM_CHUNKS
from verl_omni.data.actions import ActionLayout

NUM_LAYERS = len(LAYER_NAMES)
# Column groups of a ``[N, 9]`` layer table (rewards, advantages), by name rather than by position.
VISUAL_LAYER = LAYER_NAMES.index("visual")
NAV_LAYERS: tuple[int, ...] = tuple(i for i, name in enumerate(LAYER_NAMES) if name.startswith("nav_"))
STOP_LAYERS: tuple[int, ...] = tuple(i for i, name in enumerate(LAYER_NAMES) if name.startswith("stop_"))
# Channel positions inside one action step; the contract fixes dx, dy, dyaw, stop.
NAV_CHANNELS: tuple[int, ...] = (0, 1, 2)
STOP_CHANNEL = 3


class LayerLayoutError(ValueError):
    """A request, result or reward table whose layer layout differs from :data:`LAYER_NAMES`."""


def check_layer_names(names, where: str) -> None:
    """Refuses any layer list other than :data:`LAYER_NAMES` (same names, same order).

    Args:
        names: Sequence of layer names offered by a caller.
        where: What is being checked, for the error message.

    Raises:
        LayerLayoutError: naming ``where`` and both layouts.
    """
    if tuple(names) != LAYER_NAMES:
        raise LayerLayoutError(f"{where}: unknown layer layout {list(names)}; this build expects {list(LAYER_NAMES)}")


@dataclass(frozen=True)
class JointLayout:
    """Shapes of the two parts of the joint latent.

    Attributes:
        video_shape: Target video latent shape ``(C, T', h, w)`` of one sample.
        actions: Action layout (32 steps x 4 channels in 4 chunks).
    """

    video_shape: tuple[int, int, int, int]
    actions: ActionLayout = field(default_factory=ActionLayout)

    def __post_init__(self) -> None:
        shape = tuple(int(v) for v in self.video_shape)
        if len(shape) != 4 or any(v <= 0 for v in shape):
            raise ValueError(f"JointLayout.video_shape must be 4 positive ints (C, T', h, w), got {self.video_shape}")
        object.__setattr__(self, "video_shape", shape)
        if self.actions.chunks != NUM_CHUNKS:
            raise LayerLayoutError(
                f"JointLayout.actions.chunks is {self.actions.chunks}; the layer table has {NUM_CHUNKS} nav/stop chunks"
            )

    @property
    def video_numel(self) -> int:
        return math.prod(self.video_shape)

    @property
    def action_numel(self) -> int:
        return self.actions.steps * self.actions.num_channels

    @property
    def numel(self) -> int:
        """``D``, the length of the flat joint latent."""
        return self.video_numel + self.action_numel

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Splits ``[B, D]`` into video ``[B, C, T', h, w]`` and actions ``[B, steps, channels]`` (views)."""
        if joint.ndim != 2 or joint.shape[1] != self.numel:
            raise ValueError(f"joint latent must be [B, {self.numel}], got {list(joint.shape)}")
        b = joint.shape[0]
        video = joint[:, : self.video_numel].reshape(b, *self.video_shape)
        actions = joint[:, self.video_numel :].reshape(b, self.actions.steps, self.actions.num_channels)
        return video, actions

    def join(self, video: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split`: ``[B, C, T', h, w]`` + ``[B, steps, channels]`` -> ``[B, D]``."""
        b = video.shape[0]
        if tuple(video.shape[1:]) != self.video_shape:
            raise ValueError(
                f"video latents must be [B, {', '.join(map(str, self.video_shape))}], got {list(video.shape)}"
            )
        if tuple(actions.shape) != (b, self.actions.steps, self.actions.num_channels):
            raise ValueError(
                f"actions must be [{b}, {self.actions.steps}, {self.actions.num_channels}], got {list(actions.shape)}"
            )
        return torch.cat([video.reshape(b, -1), actions.reshape(b, -1)], dim=1)


class LayerTable:
    """Maps each credit layer to its indices in the flat joint latent.

    Args:
        layout: The joint-latent layout.

    Attributes:
        layout: The layout the table was built for.
        names: :data:`LAYER_NAMES`.
        layer_of_dim: ``[D]`` int64, the layer id of each joint-latent dimension.
        counts: ``[9]`` int64, number of dimensions per layer.
    """

    def __init__(self, layout: JointLayout) -> None:
        self.layout = layout
        self.names = LAYER_NAMES
        acts = layout.actions
        layer_of_action = torch.empty(acts.steps, acts.num_channels, dtype=torch.int64)
        for step in range(acts.steps):
            chunk = acts.chunk_of_step(step)  # 0-based
            layer_of_action[step, list(NAV_CHANNELS)] = 1 + chunk
            layer_of_action[step, STOP_CHANNEL] = 1 + NUM_CHUNKS + chunk
        self.layer_of_dim = torch.cat([torch.zeros(layout.video_numel, dtype=torch.int64), layer_of_action.reshape(-1)])
        self.counts = torch.bincount(self.layer_of_dim, minlength=NUM_LAYERS)
        self._indices = tuple(torch.nonzero(self.layer_of_dim == g).squeeze(1) for g in range(NUM_LAYERS))

    def indices(self, name: str) -> torch.Tensor:
        """Sorted int64 indices ``[n_g]`` of layer ``name`` in the joint latent."""
        try:
            return self._indices[self.names.index(name)]
        except ValueError:
            raise LayerLayoutError(f"unknown layer {name!r}; layers are {list(self.names)}") from None

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of ``values`` over each layer's dimensions.

        The reduction runs row by row on tensors of shape ``[D]``: torch's CPU sum over a long axis splits
        the work differently for one row than for many, which changes the last bit; reducing each row on
        its own keeps the result independent of how many rows travel together.

        Args:
            values: ``[B, D]`` per-dimension values (e.g. Gaussian log-densities), any float dtype.

        Returns:
            ``[B, 9]`` per-layer means, same dtype as ``values``.
        """
        if values.ndim != 2 or values.shape[1] != self.layout.numel:
            raise ValueError(f"reduce_mean expects [B, {self.layout.numel}], got {list(values.shape)}")
        dv = self.layout.video_numel
        acts = self.layout.actions
        rows = []
        for row in values.unbind(0):
            visual = row[:dv].sum()
            grid = row[dv:].reshape(NUM_CHUNKS, acts.steps_per_chunk, acts.num_channels)
            nav = grid[:, :, list(NAV_CHANNELS)].reshape(NUM_CHUNKS, -1).sum(-1)
            stop = grid[:, :, STOP_CHANNEL].sum(-1)
            rows.append(torch.cat([visual.reshape(1), nav, stop]))
        sums = torch.stack(rows)
        return sums / self.counts.to(device=values.device, dtype=values.dtype)
