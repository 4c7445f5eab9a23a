"""Typed input and output of the reward set.

``RewardBatch`` carries everything a reward module may read for ``N`` rollouts; ``RewardOutput`` carries
one float32 score per rollout for every credit layer (``LAYER_NAMES``), named diagnostics and
per-rollout warnings. Between the driver and the reward workers a shard is a ``RewardBatch``
(:meth:`RewardBatch.select`) and the answer a ``RewardScores``, merged by :meth:`RewardScores.concat`.
Shapes follow ``docs/contracts.md``: 32 action steps ``(dx, dy, dyaw, stop)`` in metres / radians / {0, 1},
poses ``(x, y, yaw)`` in the scene frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verl_omni.data.actions import ACTION_LAYOUT
from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.sim.events import EVENT_NAMES  # noqa: F401 - re-exported: the contract's single list of events


def _float_array(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != shape:
        raise ValueError(f"RewardBatch.{name}: expected shape {list(shape)}, got {list(arr.shape)}")
    return arr


def _str_list(name: str, value: Any, n: int) -> list[str]:
    out = [str(v) for v in value]
    if len(out) != n:
        raise ValueError(f"RewardBatch.{name}: expected {n} entries (one per rollout), got {len(out)}")
    return out


@dataclass
class RewardBatch:
    """Rollouts to score. Non-finite values are allowed (they are scored as invalid, never raised).

    Attributes:
        actions: ``[N, 32, 4]`` decoded actions ``(dx, dy, dyaw, stop)``: metres, metres, radians, stop flag.
        start_pose: ``[N, 3]`` world pose the actions start from.
        reference_poses: ``[N, 33, 3]`` recorded expert poses (the start pose and 32 future poses).
        goal: ``[N, 2]`` world goal position.
        success_radius: ``[N]`` metres.
        events: Per rollout, the event names of its query state (subset of ``EVENT_NAMES``).
        scene_id: Per rollout, the occupancy scene id.
        rollout_id: Per rollout, a unique name used in warnings.
        generated_latents / target_latents: Optional ``[N, ...]`` video latents (numpy or torch).
        generated_frames / target_frames: Optional ``[N, T, H, W, 3]`` pixels, uint8 (0..255) or float (0..1).
    """

    actions: np.ndarray
    start_pose: np.ndarray
    reference_poses: np.ndarray
    goal: np.ndarray
    success_radius: np.ndarray
    events: list[list[str]]
    scene_id: list[str]
    rollout_id: list[str]
    generated_latents: Any = None
    target_latents: Any = None
    generated_frames: Any = None
    target_frames: Any = None

    def __post_init__(self) -> None:
        steps = ACTION_LAYOUT.steps
        actions = np.asarray(self.actions, dtype=np.float64)
        if actions.ndim != 3 or actions.shape[1:] != (steps, 4):
            raise ValueError(f"RewardBatch.actions: expected shape [N, {steps}, 4], got {list(actions.shape)}")
        n = actions.shape[0]
        self.actions = actions
        self.start_pose = _float_array("start_pose", self.start_pose, (n, 3))
        self.reference_poses = _float_array("reference_poses", self.reference_poses, (n, steps + 1, 3))
        self.goal = _float_array("goal", self.goal, (n, 2))
        self.success_radius = _float_array("success_radius", self.success_radius, (n,))
        if len(self.events) != n:
            raise ValueError(f"RewardBatch.events: expected {n} lists (one per rollout), got {len(self.events)}")
        self.events = [[str(e) for e in ev] for ev in self.events]
        self.scene_id = _str_list("scene_id", self.scene_id, n)
        self.rollout_id = _str_list("rollout_id", self.rollout_id, n)
        for a, b in (("generated_latents", "target_latents"), ("generated_frames", "target_frames")):
            ga, tb = getattr(self, a), getattr(self, b)
            if (ga is None) != (tb is None):
                raise ValueError(f"RewardBatch: {a} and {b} must be given together")
            if ga is not None and (tuple(ga.shape) != tuple(tb.shape) or ga.shape[0] != n):
                raise ValueError(
                    f"RewardBatch: {a} {list(ga.shape)} and {b} {list(tb.shape)} must have the same "
                    f"shape with {n} rollouts first"
                )

    @property
    def size(self) -> int:
        return self.actions.shape[0]

    def has_event(self, name: str) -> np.ndarray:
        """``bool [N]``: rollouts whose query state carries event ``name``."""
        return np.array([name in ev for ev in self.events], dtype=bool)

    @classmethod
    def from_rollouts(cls, rows, actions, rollout_ids, generated_latents, target_latents) -> RewardBatch:
        """The batch of N rollouts from the data row each one was sampled for.

        Args:
            rows: N training rows (``start_pose``, ``reference_poses``, ``goal``, ``success_radius``,
                ``events``, ``scene_id``), one per rollout.
            actions: ``[N, 32, 4]`` decoded actions (tensor).
            rollout_ids: N rollout ids.
            generated_latents / target_latents: ``[N, C, T', h, w]`` tensors.
        """
        return cls(
            actions=actions.double().numpy(),
            start_pose=np.stack([r.start_pose for r in rows]),
            reference_poses=np.stack([r.reference_poses for r in rows]),
            goal=np.stack([r.goal for r in rows]),
            success_radius=np.array([r.success_radius for r in rows], dtype=np.float64),
            events=[list(r.events) for r in rows],
            scene_id=[r.scene_id for r in rows],
            rollout_id=list(rollout_ids),
            generated_latents=generated_latents.float().numpy(),
            target_latents=target_latents.float().numpy(),
        )

    def select(self, rows: slice) -> RewardBatch:
        """The rollouts ``rows`` (a contiguous shard for one reward worker); absent optional fields stay None."""
        return RewardBatch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                for f in dataclasses.fields(self)
            }
        )


@dataclass
class RewardOutput:
    """Per-layer scores, diagnostics and warnings for a batch.

    Attributes:
        scores: ``{layer: float32 [N]}`` for every name in ``LAYER_NAMES`` (weighted sum of modules).
        diagnostics: ``{"<module>/<term>": [N] or [N, 4]}`` un-weighted terms, per chunk where ``[N, 4]``.
        warnings: Human-readable problems, each naming the rollout (``rollout <id>: ...``) or ``batch: ...``.
        rollout_id: The batch's rollout ids, in order.
        layer_valid: ``bool [N, 9]`` live layers in ``LAYER_NAMES`` order (chunks after a STOP or a hard
            collision are dead); None means every layer is live.
    """

    scores: dict[str, np.ndarray]
    diagnostics: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    rollout_id: list[str] = field(default_factory=list)
    layer_valid: np.ndarray | None = None

    def valid_matrix(self) -> np.ndarray:
        """``bool [N, len(LAYER_NAMES)]`` live layers (all True when the reward set did not compute them)."""
        if self.layer_valid is None:
            n = len(next(iter(self.scores.values()))) if self.scores else 0
            return np.ones((n, len(LAYER_NAMES)), dtype=bool)
        return np.asarray(self.layer_valid, dtype=bool)

    def as_matrix(self) -> np.ndarray:
        """``float32 [N, len(LAYER_NAMES)]`` scores in ``LAYER_NAMES`` order."""
        return np.stack([self.scores[name] for name in LAYER_NAMES], axis=1).astype(np.float32)


@dataclass
class RewardScores:
    """What one reward worker returns for its shard (:class:`RewardOutput` as a matrix, with its time).

    Attributes:
        scores: ``float32 [N, len(LAYER_NAMES)]`` in ``LAYER_NAMES`` order.
        diagnostics: ``{"<module>/<term>": [N] or [N, 4]}`` as in :class:`RewardOutput`.
        warnings: As in :class:`RewardOutput`.
        score_s: Seconds the worker spent scoring.
    """

    scores: np.ndarray
    diagnostics: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    score_s: float = 0.0

    def __post_init__(self) -> None:
        if self.scores.ndim != 2 or self.scores.shape[1] != len(LAYER_NAMES):
            raise ValueError(f"RewardScores.scores must be [N, {len(LAYER_NAMES)}], got {list(self.scores.shape)}")

    def __len__(self) -> int:
        return self.scores.shape[0]

    @classmethod
    def empty(cls) -> RewardScores:
        """The answer for a shard without rollouts."""
        return cls(np.zeros((0, len(LAYER_NAMES)), np.float32))

    @classmethod
    def from_output(cls, out: RewardOutput, score_s: float) -> RewardScores:
        return cls(out.as_matrix(), out.diagnostics, out.warnings, score_s)

    @classmethod
    def concat(cls, parts: Sequence[RewardScores]) -> RewardScores:
        """Merges the workers' answers in shard order.

        A diagnostic is kept only when every non-empty shard has it; ``score_s`` is the slowest worker's.
        """
        diagnostics: dict[str, np.ndarray] = {}
        for key in parts[0].diagnostics:
            vals = [p.diagnostics.get(key) for p in parts if len(p)]
            if all(v is not None for v in vals):
                diagnostics[key] = np.concatenate(vals)
        return cls(
            scores=np.concatenate([p.scores for p in parts]),
            diagnostics=diagnostics,
            warnings=[w for p in parts for w in p.warnings],
            score_s=float(max(p.score_s for p in parts)),
        )
