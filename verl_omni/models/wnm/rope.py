"""3D rotary positions for the joint [history video | target video | action] sequence.

Wan's ``WanRotaryPosEmbed`` only produces integer (t, h, w) positions of one video grid, read from a table.
Our sequence also holds one token per action step, whose natural time position lies *between* latent frames
(step k moves the robot from target frame k to k + 1, i.e. it ends at latent time (k + 1) / temporal). So this
helper computes the same cos/sin features from arbitrary (possibly fractional) positions. For integer
positions the numbers are those of ``WanRotaryPosEmbed`` (same axis split, same frequencies, float64 math),
which keeps a Wan-initialised video part behaving exactly as in Wan.
"""

from __future__ import annotations

import torch


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head's dims over (t, h, w): h and w get 2 * (head_dim // 6) each, t the rest."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def rope_from_positions(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary features for tokens at given 3D positions.

    Args:
        positions: ``[S, 3]`` (t, h, w) positions, float (fractions allowed).
        head_dim: Attention head dim.
        theta: RoPE base.

    Returns:
        ``(cos, sin)``, each ``[1, S, 1, head_dim]`` float32, in the interleaved layout Wan's attention
        processor expects (each frequency repeated twice).
    """
    pos = positions.to(torch.float64)
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(rope_axis_dims(head_dim)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim))
        angles = pos[:, axis, None] * inv_freq[None, :]  # [S, dim/2]
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1))
    cos = torch.cat(cos_parts, dim=1).float()[None, :, None, :]
    sin = torch.cat(sin_parts, dim=1).float()[None, :, None, :]
    return cos, sin


def video_positions(t0: int, frames: int, height: int, width: int) -> torch.Tensor:
    """``[frames * height * width, 3]`` integer grid positions in (t, h, w) raster order, time offset ``t0``."""
    t = torch.arange(t0, t0 + frames, dtype=torch.float64)
    h = torch.arange(height, dtype=torch.float64)
    w = torch.arange(width, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1)
    return grid.reshape(-1, 3)


def action_positions(t0: int, steps: int, temporal_compression: int) -> torch.Tensor:
    """``[steps, 3]`` positions of action tokens: step k at latent time ``t0 + (k + 1) / temporal``.

    Target latent frame 0 holds raw frame 0 (the current view); latent frame j >= 1 covers raw frames
    ``4j-3 .. 4j``. Step k ends at raw frame k + 1, so its latent time is (k + 1) / 4. Actions have no image
    extent: h = w = 0 leaves those rotary dims unrotated.
    """
    t = t0 + (torch.arange(steps, dtype=torch.float64) + 1.0) / temporal_compression
    zeros = torch.zeros_like(t)
    return torch.stack([t, zeros, zeros], dim=-1)


def joint_sequence_rope(
    history_grid: tuple[int, int, int],
    target_grid: tuple[int, int, int],
    action_steps: int,
    temporal_compression: int,
    head_dim: int,
    theta: float = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary features for [history video, target video, actions].

    Args:
        history_grid / target_grid: post-patch ``(frames, h, w)`` of each clip; the target's frames follow
            the history's in time, as if both were one video.
        action_steps: Number of action tokens.
        temporal_compression: Raw frames per latent frame.
        head_dim: Attention head dim.
        theta: RoPE base.

    Returns:
        ``(cos, sin)`` each ``[1, S, 1, head_dim]`` with ``S = prod(history) + prod(target) + action_steps``.
    """
    th = history_grid[0]
    pos = torch.cat(
        [
            video_positions(0, *history_grid),
            video_positions(th, *target_grid),
            action_positions(th, action_steps, temporal_compression),
        ]
    )
    return rope_from_positions(pos, head_dim, theta)
