"""TensorBoard logging of the trainer: scalars, rollout videos and trajectory plots.

Scalars go through ``torch.utils.tensorboard.SummaryWriter``. Videos are written as animated GIF image
summaries, which TensorBoard plays in its Images tab: ``SummaryWriter.add_video`` would need moviepy just
to produce the same GIF, so we encode it with Pillow (already a dependency) instead.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import numpy as np


class TensorBoardLogger:
    """Writes one run's TensorBoard events under ``log_dir`` (only on the driver)."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # purge_step drops events of a killed run beyond the step we resume from, so curves never fork.
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            if value is None:
                continue
            v = float(value)
            if np.isfinite(v):
                self.writer.add_scalar(name, v, global_step=step)

    def log_gif(self, tag: str, frames: np.ndarray, step: int, fps: int = 8) -> None:
        """Logs ``uint8 [T, H, W, 3]`` frames as an animated GIF image summary."""
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"log_gif expects uint8 [T, H, W, 3] frames, got {frames.dtype} {frames.shape}")
        images = [Image.fromarray(f) for f in frames]
        buf = io.BytesIO()
        images[0].save(
            buf, format="GIF", save_all=True, append_images=images[1:], duration=max(1, int(1000 / fps)), loop=0
        )
        t, h, w, _ = frames.shape
        summary = Summary(
            value=[
                Summary.Value(
                    tag=tag, image=Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=buf.getvalue())
                )
            ]
        )
        self.writer._get_file_writer().add_summary(summary, step)

    def log_figure(self, tag: str, figure, step: int) -> None:
        self.writer.add_figure(tag, figure, global_step=step, close=True)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def side_by_side_video(generated: np.ndarray, ground_truth: np.ndarray, scale: int = 2) -> np.ndarray:
    """``uint8 [T, H, W, 3]`` x 2 -> ``uint8 [T, H*scale, (2W + 2)*scale, 3]`` (generated | truth)."""
    t = min(len(generated), len(ground_truth))
    g, r = np.asarray(generated[:t]), np.asarray(ground_truth[:t])
    sep = np.full((t, g.shape[1], 2, 3), 255, np.uint8)
    video = np.concatenate([g, sep, r], axis=2)
    if scale > 1:
        video = video.repeat(scale, axis=1).repeat(scale, axis=2)
    return video


def trajectory_figure(
    occupancy,
    rollout_poses: np.ndarray,
    reference_poses: np.ndarray,
    goal: np.ndarray,
    strata: np.ndarray | None = None,
    title: str = "",
    success_radius: float | None = None,
):
    """A matplotlib figure of sampled trajectories over the occupancy map.

    Args:
        occupancy: ``OccupancyMap`` of the scene.
        rollout_poses: ``[R, T + 1, 3]`` integrated poses of the R rollouts of one prompt.
        reference_poses: ``[T + 1, 3]`` expert reference.
        goal: ``[2]`` goal position.
        strata: ``[R]`` stratum of each rollout (colours), optional.
        title: Figure title.
        success_radius: Drawn around the goal when given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x0, x1, y0, y1 = occupancy.extent
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ax.imshow(occupancy.state, cmap="gray", origin="lower", extent=(x0, x1, y0, y1), vmin=0, vmax=255)
    cmap = plt.get_cmap("tab10")
    for i, poses in enumerate(np.asarray(rollout_poses)):
        c = cmap(int(strata[i]) % 10) if strata is not None else cmap(i % 10)
        ax.plot(poses[:, 0], poses[:, 1], "-", color=c, lw=1.0, alpha=0.8)
    ref = np.asarray(reference_poses)
    ax.plot(ref[:, 0], ref[:, 1], "k--", lw=2.0, label="reference")
    ax.plot(ref[0, 0], ref[0, 1], "go", ms=6, label="start")
    ax.plot(goal[0], goal[1], "r*", ms=12, label="goal")
    if success_radius:
        ax.add_patch(plt.Circle((goal[0], goal[1]), success_radius, color="r", fill=False, lw=1))
    # Zoom on the region the trajectories use, with a margin.
    pts = np.concatenate([np.asarray(rollout_poses)[..., :2].reshape(-1, 2), ref[:, :2], np.asarray(goal)[None]])
    pts = pts[np.isfinite(pts).all(axis=1)]
    if len(pts):
        lo, hi = pts.min(0) - 1.0, pts.max(0) + 1.0
        ax.set_xlim(max(lo[0], x0), min(hi[0], x1))
        ax.set_ylim(max(lo[1], y0), min(hi[1], y1))
    ax.set_title(title, fontsize=8)
    ax.legend(loc="upper right", fontsize=6)
    ax.set_aspect("equal")
    fig.tight_layout()
    return fig
