"""Deterministic training subset with at most one row per source episode (pure functions).

Query states and instruction variants of one trajectory are strongly correlated; keeping at most one
row per episode stops them from dominating a prompt batch or crossing the train/held-out boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from verl_omni.data.hashing import stable_unit


class SubsetTooLargeError(ValueError):
    """More rows were requested than there are eligible episodes."""


def sample_one_row_per_episode(
    sample_ids: Sequence[str], episode_ids: Sequence[str], size: int, seed: int
) -> np.ndarray:
    """Chooses ``size`` rows, one each from ``size`` distinct episodes, deterministically for ``seed``.

    Each episode's representative is its row with the smallest ``stable_unit(seed, "row:" + sample_id)``;
    episodes are ranked by ``stable_unit(seed, "episode:" + episode_id)`` and the first ``size`` kept.
    Ties (astronomically unlikely) break by id so the result never depends on input order.

    Args:
        sample_ids: ``[N]`` unique row ids.
        episode_ids: ``[N]`` source episode of each row.
        size: Rows wanted (>= 1).
        seed: Sampling seed.

    Returns:
        ``int64 [size]`` row positions, ordered by ``sample_id``.

    Raises:
        SubsetTooLargeError: ``size`` exceeds the number of distinct episodes.
        ValueError: bad size, mismatched lengths or duplicate sample ids.
    """
    if len(sample_ids) != len(episode_ids):
        raise ValueError(f"sample_ids ({len(sample_ids)}) and episode_ids ({len(episode_ids)}) differ in length")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample_ids are not unique")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    best: dict[str, tuple[float, str, int]] = {}
    for i, (sid, eid) in enumerate(zip(sample_ids, episode_ids)):
        key = (stable_unit(seed, "row:" + sid), sid, i)
        if eid not in best or key < best[eid]:
            best[eid] = key
    if size > len(best):
        raise SubsetTooLargeError(
            f"requested {size} rows but only {len(best)} source episodes are eligible (at most one row per episode)"
        )
    ranked = sorted(best, key=lambda e: (stable_unit(seed, "episode:" + e), e))[:size]
    chosen = [best[e] for e in ranked]
    chosen.sort(key=lambda k: k[1])
    return np.asarray([k[2] for k in chosen], dtype=np.int64)
