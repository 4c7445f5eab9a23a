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
    sample_ids: Sequence[str],
    episode_ids: Sequence[str],
    size: int,
    seed: int,
    row_has_event: Sequence[bool] | None = None,
    event_share: float = 0.0,
) -> np.ndarray:
    """Chooses ``size`` rows, one each from ``size`` distinct episodes, deterministically for ``seed``.

    Each episode's representative is its row with the smallest ``stable_unit(seed, "row:" + sample_id)``;
    episodes are ranked by ``stable_unit(seed, "episode:" + episode_id)`` and the first ``size`` kept.
    Ties (astronomically unlikely) break by id so the result never depends on input order.

    With ``event_share > 0``, ``round(event_share * size)`` of the rows (or as many as there are episodes with
    such a row) are first taken from the episodes that have a row with the event (``row_has_event``), each
    represented by its event row of smallest hash, in episode-hash order; the rest are filled by the rule above
    from the other episodes. Why: the query states a run needs most can be rare in a collection (a robot at a
    wall is a few states of an episode), and one uniformly chosen row per episode then almost never picks them.

    Args:
        sample_ids: ``[N]`` unique row ids.
        episode_ids: ``[N]`` source episode of each row.
        size: Rows wanted (>= 1).
        seed: Sampling seed.
        row_has_event: ``[N]`` whether each row carries the preferred event (needed when ``event_share > 0``).
        event_share: Share of the subset taken from rows with the event, in [0, 1] (0: the plain rule).

    Returns:
        ``int64 [size]`` row positions, ordered by ``sample_id``.

    Raises:
        SubsetTooLargeError: ``size`` exceeds the number of distinct episodes.
        ValueError: bad size or share, mismatched lengths or duplicate sample ids.
    """
    if len(sample_ids) != len(episode_ids):
        raise ValueError(f"sample_ids ({len(sample_ids)}) and episode_ids ({len(episode_ids)}) differ in length")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample_ids are not unique")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0.0 <= event_share <= 1.0:
        raise ValueError(f"event_share must be in [0, 1], got {event_share}")
    if event_share > 0 and (row_has_event is None or len(row_has_event) != len(sample_ids)):
        raise ValueError("event_share > 0 needs row_has_event with one flag per row")
    best: dict[str, tuple[float, str, int]] = {}
    best_event: dict[str, tuple[float, str, int]] = {}
    for i, (sid, eid) in enumerate(zip(sample_ids, episode_ids)):
        key = (stable_unit(seed, "row:" + sid), sid, i)
        if eid not in best or key < best[eid]:
            best[eid] = key
        if event_share > 0 and row_has_event[i] and (eid not in best_event or key < best_event[eid]):
            best_event[eid] = key
    if size > len(best):
        raise SubsetTooLargeError(
            f"requested {size} rows but only {len(best)} source episodes are eligible (at most one row per episode)"
        )

    def rank(episodes) -> list[str]:
        return sorted(episodes, key=lambda e: (stable_unit(seed, "episode:" + e), e))

    quota = round(event_share * size) if event_share > 0 else 0
    preferred = rank(best_event)[:quota]
    taken = set(preferred)
    rest = [e for e in rank(best) if e not in taken][: size - len(preferred)]
    chosen = [best_event[e] for e in preferred] + [best[e] for e in rest]
    chosen.sort(key=lambda k: k[1])
    return np.asarray([k[2] for k in chosen], dtype=np.int64)
