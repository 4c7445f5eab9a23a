"""Decoding a row's history and target frames from the referenced source MP4s.

Rows store video paths relative to the collection root recorded in the manifest (``source_root``), so a
dataset keeps working when the collection is mounted elsewhere: pass the new root.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import numpy as np

from verl_omni.data.schema import Stage3Row


def resolve_reference(source_root: str | Path, relative: str) -> Path:
    """Absolute path of a row's video reference.

    Raises:
        ValueError: the reference is absolute or climbs out of the root (a corrupted or hostile row).
    """
    rel = PurePosixPath(relative)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"video reference {relative!r} must be a relative path inside the collection root")
    return Path(source_root) / Path(*rel.parts)


def read_row_frames(row: Stage3Row, source_root: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """History and target frames of a row, decoded by index (seeking, not decoding whole files).

    Args:
        row: A converted row.
        source_root: The collection root the row's video paths are relative to.

    Returns:
        ``(history uint8 [33, H, W, 3], target uint8 [33, H, W, 3])``; clamped history indices repeat the
        first frame.

    Raises:
        verl_omni.data.video.VideoError: a video is missing or a frame cannot be decoded.
    """
    from verl_omni.data.video import read_frames

    history = read_frames(resolve_reference(source_root, row.history_video), np.asarray(row.history_frames))
    target = read_frames(resolve_reference(source_root, row.target_video), np.asarray(row.target_frames))
    return history, target
