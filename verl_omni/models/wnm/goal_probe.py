"""Auxiliary Stage-II targets: where is the named goal, seen from the robot? (SFT only; never saved.)

The action loss alone tells the model what the expert did, and in the synthetic data most of that can be read
from the views without the instruction (measured: every Stage-II checkpoint so far ignores it). Auxiliary
goal-direction targets are a standard aid in embodied navigation: a small head on the DiT's action tokens
predicts the goal's bearing (cos, sin) and distance in the robot frame, which the model can only know by finding
the named object in its views. The target comes from the episode record (query pose and goal point), the head
lives only during SFT (the checkpoint and Stage III never see it), and its gradient flows into the DiT through
the action tokens' last hidden state.

Measured: the goal point's bearing is a weak grounding target, because in many states the goal is in none of
the policy's views and its direction cannot be known. :class:`ObjectViewProbe` asks a question that the current
view and the instruction always answer: is the *named* object drawn in the current frame, and at what bearing?
The answer is a deterministic function of the inputs the policy has (the simulator records it per query state,
``goal_object_bearing``), so the head's gradient asks for exactly the text-to-view grounding the policy lacks.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DISTANCE_SCALE_M = 4.0  # distances are regressed as d / 4 m so that the three targets have similar ranges


def goal_polar(pose: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """``float32 [3]``: ``(cos b, sin b, d / DISTANCE_SCALE_M)`` of the goal in the robot frame.

    Args:
        pose: ``[3]`` world pose ``(x, y, yaw)``.
        goal: ``[2]`` world goal point.
    """
    dx, dy = float(goal[0] - pose[0]), float(goal[1] - pose[1])
    bearing = math.atan2(dy, dx) - float(pose[2])
    return np.array([math.cos(bearing), math.sin(bearing), math.hypot(dx, dy) / DISTANCE_SCALE_M], np.float32)


def object_view_target(bearing: float, distance: float) -> np.ndarray:
    """``float32 [4]``: ``(in view, cos b, sin b, d / DISTANCE_SCALE_M)`` of the goal object in the current frame
    (``d``: metres to its nearest drawn point); ``(0, 1, 0, 0)`` when it is not drawn (``bearing`` NaN), the other
    terms are then ignored by :meth:`ObjectViewProbe.loss`. The distance is what tells STOP: the expert stops
    beside the object."""
    if math.isnan(bearing):
        return np.array([0.0, 1.0, 0.0, 0.0], np.float32)
    return np.array([1.0, math.cos(bearing), math.sin(bearing), distance / DISTANCE_SCALE_M], np.float32)


class GoalProbe(nn.Module):
    """Head predicting :func:`goal_polar` from the mean of the action tokens' final hidden states.

    Args:
        dim: DiT width D.
    """

    outputs = 3

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, self.outputs))
        self._hidden: torch.Tensor | None = None

    @contextlib.contextmanager
    def attached(self, transformer: nn.Module):
        """Records the action tokens' hidden state ``[B, 32, D]`` (the input of ``action_norm_out``) while open."""

        def keep(_module, inputs):
            self._hidden = inputs[0]

        handle = transformer.action_norm_out.register_forward_pre_hook(keep)
        try:
            yield self
        finally:
            handle.remove()
            self._hidden = None

    def predict(self) -> torch.Tensor:
        """``[B, 3]`` prediction from the last recorded forward.

        Raises:
            RuntimeError: no forward ran while attached.
        """
        if self._hidden is None:
            raise RuntimeError("GoalProbe: no transformer forward was recorded (use `with probe.attached(...)`)")
        return self.net(self._hidden.float().mean(1))

    def loss(self, target: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Mean squared error of the last recorded forward against ``target [B, 3]``.

        Args:
            target: ``[B, 3]`` :func:`goal_polar` targets.
            rows: Optional bool ``[B]``: only these rows count (none selected gives a zero that still backpropagates).
        """
        pred = self.predict()
        target = target.to(pred.device, pred.dtype)
        if rows is None:
            return F.mse_loss(pred, target)
        keep = rows.to(pred.device)[:, None].to(pred.dtype)
        return ((pred - target).square() * keep).sum() / (keep.sum() * pred.shape[1]).clamp_min(1.0)


class ObjectViewProbe(GoalProbe):
    """Head predicting :func:`object_view_target`: a visibility logit, the object's bearing ``(cos, sin)`` and its
    scaled distance."""

    outputs = 4

    def loss(self, target: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Binary cross-entropy of visibility plus the squared bearing and distance errors on the rows where the
        object is drawn.

        Args:
            target: ``[B, 4]`` :func:`object_view_target` targets.
            rows: Unused (every row's current view answers the question); kept for the common signature.
        """
        pred = self.predict()
        target = target.to(pred.device, pred.dtype)
        visible = target[:, 0]
        seen = F.binary_cross_entropy_with_logits(pred[:, 0], visible)
        where = (pred[:, 1:] - target[:, 1:]).square().sum(1) * visible
        return seen + where.sum() / visible.sum().clamp_min(1.0)


def bearing_error_deg(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[B]`` absolute angle in degrees between the bearings ``(cos, sin)`` of ``pred`` and ``target [B, >=2]``."""
    diff = torch.atan2(pred[:, 1], pred[:, 0]) - torch.atan2(target[:, 1], target[:, 0])
    return torch.rad2deg(torch.atan2(torch.sin(diff), torch.cos(diff)).abs())
