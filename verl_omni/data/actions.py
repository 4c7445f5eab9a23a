"""Navigation action layout, pose <-> action conversion and action normalization.

Units and frames are fixed in ``docs/contracts.md``: an action step ``(dx, dy, dyaw, stop)`` moves the
robot from pose ``k`` to pose ``k + 1`` and is expressed in the robot frame of pose ``k``. The first step
with a set stop flag ends the episode; the robot does not move at or after it.

All functions are pure numpy and vectorized over any leading batch dimensions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ACTION_CHANNELS: tuple[str, ...] = ("dx", "dy", "dyaw", "stop")
NORMALIZATION_VERSION = 1


@dataclass(frozen=True)
class ActionLayout:
    """Shape of the action part of the joint latent.

    Attributes:
        steps: Action steps per sample (32).
        channels: Channel names, in order.
        chunks: Number of equal chunks the steps split into (4 chunks of 8 steps).
    """

    steps: int = 32
    channels: tuple[str, ...] = ACTION_CHANNELS
    chunks: int = 4

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.chunks <= 0 or self.steps % self.chunks:
            raise ValueError(
                f"ActionLayout: steps ({self.steps}) must be a positive multiple of chunks ({self.chunks})"
            )
        if tuple(self.channels) != ACTION_CHANNELS:
            raise ValueError(f"ActionLayout: channels must be {ACTION_CHANNELS}, got {self.channels}")

    @property
    def num_channels(self) -> int:
        return len(self.channels)

    @property
    def steps_per_chunk(self) -> int:
        return self.steps // self.chunks

    def chunk_of_step(self, step: int) -> int:
        """0-based chunk index of a 0-based step."""
        return step // self.steps_per_chunk

    def to_dict(self) -> dict:
        return {"steps": self.steps, "channels": list(self.channels), "chunks": self.chunks}


ACTION_LAYOUT = ActionLayout()


def wrap_angle(angle: np.ndarray | float) -> np.ndarray:
    """Wraps angles to ``(-pi, pi]``."""
    a = np.asarray(angle, dtype=np.float64)
    wrapped = np.mod(a + math.pi, 2.0 * math.pi) - math.pi
    # np.mod maps +pi to -pi; the contract's interval is closed at +pi.
    return np.where(wrapped == -math.pi, math.pi, wrapped)


def poses_to_actions(poses: np.ndarray, stop: np.ndarray | None = None) -> np.ndarray:
    """Converts a pose sequence into action steps in the robot frame of each previous pose.

    Args:
        poses: ``[..., T + 1, 3]`` poses (x, y, yaw) in the world frame.
        stop: ``[..., T]`` stop flags (0/1); zeros when omitted.

    Returns:
        ``[..., T, 4]`` float64 actions ``(dx, dy, dyaw, stop)``.
    """
    poses = np.asarray(poses, dtype=np.float64)
    if poses.shape[-1] != 3 or poses.shape[-2] < 2:
        raise ValueError(f"poses must have shape [..., T+1, 3] with T >= 1, got {poses.shape}")
    prev, nxt = poses[..., :-1, :], poses[..., 1:, :]
    dxw = nxt[..., 0] - prev[..., 0]
    dyw = nxt[..., 1] - prev[..., 1]
    c, s = np.cos(prev[..., 2]), np.sin(prev[..., 2])
    out = np.empty(prev.shape[:-1] + (4,), dtype=np.float64)
    out[..., 0] = c * dxw + s * dyw
    out[..., 1] = -s * dxw + c * dyw
    out[..., 2] = wrap_angle(nxt[..., 2] - prev[..., 2])
    if stop is None:
        out[..., 3] = 0.0
    else:
        stop = np.asarray(stop, dtype=np.float64)
        if stop.shape != out.shape[:-1]:
            raise ValueError(f"stop must have shape {out.shape[:-1]}, got {stop.shape}")
        out[..., 3] = stop
    return out


def first_stop_index(stop_flags: np.ndarray) -> np.ndarray:
    """Index of the first set stop flag along the last axis, or ``T`` when none is set.

    Args:
        stop_flags: ``[..., T]`` booleans (or 0/1).

    Returns:
        ``[...]`` int64 indices in ``[0, T]``.
    """
    flags = np.asarray(stop_flags).astype(bool)
    t = flags.shape[-1]
    any_stop = flags.any(axis=-1)
    return np.where(any_stop, flags.argmax(axis=-1), t).astype(np.int64)


def integrate_actions(start_pose: np.ndarray, actions: np.ndarray, stop_threshold: float = 0.5) -> np.ndarray:
    """Integrates action steps from a start pose, honouring the first-STOP rule.

    Args:
        start_pose: ``[..., 3]`` world pose.
        actions: ``[..., T, 4]`` decoded actions (metres, radians, stop flag).
        stop_threshold: A step whose stop channel exceeds this is a STOP.

    Returns:
        ``[..., T + 1, 3]`` float64 poses; entry 0 is the start pose. From the first STOP step on the
        pose stays where it was.
    """
    start_pose = np.asarray(start_pose, dtype=np.float64)
    actions = np.asarray(actions, dtype=np.float64)
    if actions.shape[-1] != 4 or start_pose.shape[-1] != 3 or actions.shape[:-2] != start_pose.shape[:-1]:
        raise ValueError(
            f"integrate_actions: start_pose [..., 3] and actions [..., T, 4] disagree: "
            f"{start_pose.shape} vs {actions.shape}"
        )
    t = actions.shape[-2]
    stop_at = first_stop_index(actions[..., 3] > stop_threshold)
    moving = np.arange(t) < stop_at[..., None]  # [..., T]
    poses = np.empty(actions.shape[:-1] + (3,), dtype=np.float64)
    poses = np.concatenate([start_pose[..., None, :], poses], axis=-2)
    # A sequential scan over T (32) steps; each step is vectorized over the batch.
    for k in range(t):
        x, y, yaw = poses[..., k, 0], poses[..., k, 1], poses[..., k, 2]
        m = moving[..., k]
        dx = np.where(m, actions[..., k, 0], 0.0)
        dy = np.where(m, actions[..., k, 1], 0.0)
        dyaw = np.where(m, actions[..., k, 2], 0.0)
        c, s = np.cos(yaw), np.sin(yaw)
        poses[..., k + 1, 0] = x + c * dx - s * dy
        poses[..., k + 1, 1] = y + s * dx + c * dy
        poses[..., k + 1, 2] = wrap_angle(yaw + dyaw)
    return poses


@dataclass(frozen=True)
class ActionNormalization:
    """Per-channel affine normalization of actions: ``normalized = (raw - mean) / std``.

    This is the content of a checkpoint's ``action_normalization.json``; the checkpoint always defines it.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: tuple[str, ...] = ACTION_CHANNELS
    version: int = NORMALIZATION_VERSION
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))
        object.__setattr__(self, "channels", tuple(self.channels))
        n = len(self.channels)
        if tuple(self.channels) != ACTION_CHANNELS:
            raise ValueError(
                f"action_normalization: channels must be {list(ACTION_CHANNELS)}, got {list(self.channels)}"
            )
        if len(self.mean) != n or len(self.std) != n:
            raise ValueError(
                f"action_normalization: mean and std need {n} entries, got {len(self.mean)} and {len(self.std)}"
            )
        if not all(math.isfinite(v) for v in self.mean + self.std):
            raise ValueError("action_normalization: mean/std must be finite")
        if any(v <= 0 for v in self.std):
            raise ValueError(f"action_normalization: every std must be > 0, got {list(self.std)}")
        if self.version != NORMALIZATION_VERSION:
            raise ValueError(
                f"action_normalization: unsupported version {self.version} (expected {NORMALIZATION_VERSION})"
            )

    @classmethod
    def identity(cls) -> ActionNormalization:
        return cls(mean=(0.0,) * 4, std=(1.0,) * 4)

    @classmethod
    def from_actions(cls, actions: np.ndarray, min_std: float = 1e-3) -> ActionNormalization:
        """Fits mean/std per channel from ``[..., 4]`` raw actions (std floored at ``min_std``).

        The stop channel is kept un-normalized (mean 0, std 1) so that the decoded flag threshold 0.5 keeps
        its meaning and a policy cannot satisfy it by a shift of the statistics.
        """
        a = np.asarray(actions, dtype=np.float64).reshape(-1, 4)
        if a.shape[0] == 0 or not np.isfinite(a).all():
            raise ValueError("ActionNormalization.from_actions needs a non-empty, finite action array")
        mean = a.mean(axis=0)
        std = np.maximum(a.std(axis=0), min_std)
        mean[3], std[3] = 0.0, 1.0
        return cls(mean=tuple(mean), std=tuple(std))

    def normalize(self, actions):
        """Raw -> normalized; works on numpy arrays and torch tensors of shape ``[..., 4]``."""
        mean, std = self._like(actions)
        return (actions - mean) / std

    def denormalize(self, actions):
        """Normalized -> raw; works on numpy arrays and torch tensors of shape ``[..., 4]``."""
        mean, std = self._like(actions)
        return actions * std + mean

    def _like(self, x):
        if isinstance(x, np.ndarray):
            return np.asarray(self.mean, dtype=x.dtype), np.asarray(self.std, dtype=x.dtype)
        import torch  # local: keeps this module usable without touching torch for numpy callers

        if isinstance(x, torch.Tensor):
            return (
                torch.tensor(self.mean, dtype=x.dtype, device=x.device),
                torch.tensor(self.std, dtype=x.dtype, device=x.device),
            )
        raise TypeError(f"expected numpy array or torch tensor, got {type(x).__name__}")

    def to_dict(self) -> dict:
        d = {"version": self.version, "channels": list(self.channels), "mean": list(self.mean), "std": list(self.std)}
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "action_normalization") -> ActionNormalization:
        missing = [k for k in ("channels", "mean", "std") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        extra = {k: v for k, v in d.items() if k not in ("version", "channels", "mean", "std")}
        try:
            return cls(mean=d["mean"], std=d["std"], channels=d["channels"], version=d.get("version", 1), extra=extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> ActionNormalization:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{path}: action normalization file not found") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(d, source=str(path))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
