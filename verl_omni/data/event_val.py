"""Event-balanced held-out selection (pure functions).

Rows are bucketed by the four events; each bucket receives up to ``per_event`` rows. A row may carry
several events but is used for one bucket only, and a query state (episode, t) contributes at most one
row (its instruction variants are near-duplicates). Within a bucket, rows from episodes that have been
used fewer times come first, so the set spreads over as many trajectories as the candidates allow;
scarce events are filled first so common ones cannot take their only candidates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from verl_omni.data.hashing import stable_unit
from verl_omni.data.schema import EVENT_NAMES


@dataclass(frozen=True)
class EventSelection:
    """Result of :func:`select_event_balanced`.

    Attributes:
        selected: Event -> selected row positions (sorted by sample id).
        candidates: Event -> eligible rows carrying the event (before de-duplication).
        short: Event -> rows selected, for events with fewer than ``per_event`` rows.
    """

    selected: dict[str, list[int]]
    candidates: dict[str, int]
    short: dict[str, int]

    @property
    def all_rows(self) -> list[int]:
        return sorted(i for rows in self.selected.values() for i in rows)


def select_event_balanced(
    sample_ids: Sequence[str],
    episode_ids: Sequence[str],
    query_ts: Sequence[int],
    events: Sequence[Collection[str]],
    per_event: int,
    seed: int,
    excluded_episodes: Collection[str] = (),
) -> EventSelection:
    """Selects up to ``per_event`` rows for each event from episodes not in ``excluded_episodes``.

    Args:
        sample_ids: ``[N]`` unique row ids.
        episode_ids: ``[N]`` source episode per row.
        query_ts: ``[N]`` query state per row.
        events: ``[N]`` event names per row.
        per_event: Rows wanted per event (>= 1).
        seed: Tie-breaking/shuffling seed.
        excluded_episodes: Episodes that must not appear (e.g. the training sample's).

    Returns:
        The selection; ``short`` lists events that could not be filled.
    """
    n = len(sample_ids)
    if not (len(episode_ids) == len(query_ts) == len(events) == n):
        raise ValueError("sample_ids, episode_ids, query_ts and events must have equal lengths")
    if per_event < 1:
        raise ValueError(f"per_event must be >= 1, got {per_event}")
    excluded = set(excluded_episodes)
    eligible = [i for i in range(n) if episode_ids[i] not in excluded]
    by_event = {e: [i for i in eligible if e in events[i]] for e in EVENT_NAMES}
    order = sorted(EVENT_NAMES, key=lambda e: (len(by_event[e]), EVENT_NAMES.index(e)))
    used_states: set[tuple[str, int]] = set()
    episode_use: Counter[str] = Counter()
    selected: dict[str, list[int]] = {}
    for event in order:
        pool = sorted(by_event[event], key=lambda i: (stable_unit(seed, f"{event}:{sample_ids[i]}"), sample_ids[i]))
        chosen: list[int] = []
        # Round r admits rows whose episode has been used exactly r times; equivalent to a greedy pick by
        # (episode use count, hash) but linear per round.
        round_ = 0
        while len(chosen) < per_event:
            progressed, remaining = False, False
            for i in pool:
                if len(chosen) >= per_event:
                    break
                state = (episode_ids[i], int(query_ts[i]))
                if state in used_states:
                    continue
                remaining = True
                if episode_use[episode_ids[i]] != round_:
                    continue
                chosen.append(i)
                used_states.add(state)
                episode_use[episode_ids[i]] += 1
                progressed = True
            if not remaining:
                break
            if not progressed:
                round_ += 1
        selected[event] = sorted(chosen, key=lambda i: sample_ids[i])
    selected = {e: selected[e] for e in EVENT_NAMES}
    short = {e: len(rows) for e, rows in selected.items() if len(rows) < per_event}
    return EventSelection(selected=selected, candidates={e: len(by_event[e]) for e in EVENT_NAMES}, short=short)
