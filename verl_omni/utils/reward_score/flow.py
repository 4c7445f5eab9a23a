"""Flow reward (layer ``visual``, weight 0 in the official recipe): generated motion vs generated actions.

Dense optical flow (OpenCV Farneback, imported lazily; ``opencv-python`` must be installed when the weight
is > 0, checked at construction) between consecutive generated frames ``t -> t + 1`` (``generated_frames``
``[N, 33, H, W, 3]``: frame 0 at the start pose, frame ``j + 1`` after step ``j``) is compared with the
ego-motion of scored step ``j`` (``dyaw_j`` and forward translation ``fwd_j``, the step's displacement
projected on the heading; both 0 after the end step). With image width ``W``, focal length
``f = (W / 2) / tan(hfov / 2)`` pixels, per-step flow ``(u, v)`` and image centre ``(cx, cy)``:

* **rotation**: ``rot_j = |median(u) - f tan(dyaw_j)| / W``. Turning left (dyaw > 0) moves the scene
  right in the image (u > 0); translation parallax is roughly symmetric, so the median isolates rotation.
* **translation**: ``rad_j = mean over pixels p != centre of ((u_p - median(u), v_p) . (p - c) / |p - c|)``
  (pixels; > 0 means the view expands), ``trans_j = max(-sign(fwd_j) * rad_j, 0) / W`` when
  ``|fwd_j| >= min_motion_m``, else 0: driving forward must not make the view contract and vice versa.

Per chunk ``k``: ``flow_k = (1/8) * sum over its steps of (rotation_weight * rot_j + translation_weight *
trans_j)``; ``visual = -(1/4) * sum_k flow_k``. Diagnostics (``[N, 4]``): ``rotation`` and
``translation`` (chunk means of ``rot_j`` and ``trans_j``, fractions of the image width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from verl_omni.data.actions import wrap_angle
from verl_omni.utils.reward_score.registry import (
    ModuleResult,
    RewardModule,
    RewardModuleConfig,
    check_non_negative,
    check_positive,
    register_reward,
)
from verl_omni.utils.reward_score.trajectory import (
    CHUNK_STEPS,
    STEPS,
    GeometryConfig,
    RolloutGeometry,
    chunk_sum,
)
from verl_omni.utils.reward_score.types import RewardBatch


@dataclass(frozen=True)
class FlowConfig(RewardModuleConfig):
    """Options of the ``flow`` reward (see module docstring)."""

    weight: float = 0.0
    hfov_deg: float = 90.0
    rotation_weight: float = 1.0
    translation_weight: float = 1.0
    min_motion_m: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("flow", "hfov_deg", self.hfov_deg)
        if self.hfov_deg >= 180:
            raise ValueError(f"flow.hfov_deg must be < 180, got {self.hfov_deg}")
        for name in ("rotation_weight", "translation_weight", "min_motion_m"):
            check_non_negative("flow", name, getattr(self, name))


def ego_motion(scored_poses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[N, 33, 3]`` scored poses -> ``(fwd [N, 32] metres, dyaw [N, 32] radians)`` per step."""
    prev, nxt = scored_poses[:, :-1], scored_poses[:, 1:]
    delta = nxt[..., :2] - prev[..., :2]
    fwd = np.cos(prev[..., 2]) * delta[..., 0] + np.sin(prev[..., 2]) * delta[..., 1]
    return fwd, wrap_angle(nxt[..., 2] - prev[..., 2])


def flow_motion_errors(
    flow: np.ndarray, fwd: np.ndarray, dyaw: np.ndarray, hfov_rad: float, min_motion_m: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-step rotation and translation inconsistencies.

    Args:
        flow: ``[N, S, H, W, 2]`` optical flow (pixels, ``u`` along columns, ``v`` along rows).
        fwd: ``[N, S]`` forward translation per step (metres).
        dyaw: ``[N, S]`` heading change per step (radians).
        hfov_rad: Horizontal field of view.
        min_motion_m: Smallest translation whose direction is checked.

    Returns:
        ``(rot [N, S], trans [N, S])`` fractions of the image width (>= 0).
    """
    h, w = flow.shape[2], flow.shape[3]
    focal = 0.5 * w / math.tan(0.5 * hfov_rad)
    u, v = flow[..., 0], flow[..., 1]
    u_med = np.median(u.reshape(*u.shape[:2], -1), axis=-1)  # [N, S]
    # Rotations beyond ~80 degrees per step have no meaningful image shift; clip before tan.
    expected = focal * np.tan(np.clip(dyaw, -1.4, 1.4))
    rot = np.abs(u_med - expected) / w
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    rx, ry = xs - 0.5 * (w - 1), ys - 0.5 * (h - 1)
    norm = np.hypot(rx, ry)
    keep = norm > 1e-9
    ux, uy = np.where(keep, rx / np.where(keep, norm, 1.0), 0.0), np.where(keep, ry / np.where(keep, norm, 1.0), 0.0)
    radial = ((u - u_med[..., None, None]) * ux + v * uy).sum(axis=(-2, -1)) / keep.sum()
    trans = np.where(np.abs(fwd) >= min_motion_m, np.maximum(-np.sign(fwd) * radial, 0.0), 0.0) / w
    return rot, trans


def farneback_flow(frames: np.ndarray) -> np.ndarray:
    """``[N, T, H, W, 3]`` uint8 frames -> ``[N, T-1, H, W, 2]`` float32 Farneback flow (needs OpenCV)."""
    import cv2  # optional dependency, only needed when the flow reward is enabled

    n, t = frames.shape[:2]
    out = np.empty((n, t - 1, frames.shape[2], frames.shape[3], 2), dtype=np.float32)
    for i in range(n):  # OpenCV works on one image pair at a time
        gray = [cv2.cvtColor(np.ascontiguousarray(f), cv2.COLOR_RGB2GRAY) for f in frames[i]]
        for j in range(t - 1):
            out[i, j] = cv2.calcOpticalFlowFarneback(gray[j], gray[j + 1], None, 0.5, 3, 15, 3, 5, 1.2, 0)
    return out


def _frames_uint8(frames) -> np.ndarray:
    arr = frames.detach().cpu().numpy() if hasattr(frames, "detach") else np.asarray(frames)
    if arr.dtype != np.uint8:
        arr = np.clip(np.nan_to_num(arr.astype(np.float64)) * 255.0, 0, 255).round().astype(np.uint8)
    return arr


@register_reward("flow")
class FlowReward(RewardModule):
    config_class = FlowConfig
    layers = ("visual",)

    def __init__(self, config: FlowConfig, geometry_config: GeometryConfig) -> None:
        super().__init__(config, geometry_config)
        if config.weight > 0:
            try:
                import cv2  # noqa: F401
            except ImportError as e:
                raise ValueError(
                    "reward 'flow' has weight > 0 but OpenCV is not installed: install "
                    "opencv-python-headless or set rewards.flow.weight to 0"
                ) from e

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: FlowConfig = self.config  # type: ignore[assignment]
        n = batch.size
        frames = batch.generated_frames
        if frames is None or frames.shape[1] != STEPS + 1:
            got = "missing" if frames is None else f"shape {list(frames.shape)}"
            return ModuleResult(
                scores={"visual": np.zeros(n)},
                warnings=[
                    f"batch: flow reward needs generated_frames [N, {STEPS + 1}, H, W, 3], "
                    f"got {got}; flow scores set to 0 for all {n} rollouts"
                ],
            )
        fwd, dyaw = ego_motion(geometry.scored_poses)
        flow = farneback_flow(_frames_uint8(frames))
        rot, trans = flow_motion_errors(flow, fwd, dyaw, math.radians(cfg.hfov_deg), cfg.min_motion_m)
        rotation, translation = chunk_sum(rot) / CHUNK_STEPS, chunk_sum(trans) / CHUNK_STEPS
        per_chunk = cfg.rotation_weight * rotation + cfg.translation_weight * translation
        return ModuleResult(
            scores={"visual": -per_chunk.mean(axis=1)}, diagnostics={"rotation": rotation, "translation": translation}
        )
