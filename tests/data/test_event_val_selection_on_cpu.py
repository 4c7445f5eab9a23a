"""Event-balanced selection: per-event counts, exclusions, distinct query states, short events."""

from __future__ import annotations

from verl_omni.data.event_val import select_event_balanced
from verl_omni.data.schema import EVENT_NAMES

CP, PS, RS, NG = EVENT_NAMES


def _rows(spec):
    """spec: list of (episode, t, variants, events) -> parallel lists."""
    sids, eids, ts, evs = [], [], [], []
    for ep, t, variants, events in spec:
        for k in range(variants):
            sids.append(f"{ep}/t{t:06d}/i{k:03d}")
            eids.append(ep)
            ts.append(t)
            evs.append(tuple(events))
    return sids, eids, ts, evs


def test_balanced_selection_without_excluded_episodes_or_repeated_states():
    spec = [(f"e{i}", t, 2, [EVENT_NAMES[(i + t) % 4]] + ([RS] if t == 2 else [])) for i in range(6) for t in (0, 1, 2)]
    sids, eids, ts, evs = _rows(spec)
    sel = select_event_balanced(sids, eids, ts, evs, per_event=2, seed=1, excluded_episodes={"e0", "e3"})
    assert sel.short == {}
    assert all(len(v) == 2 for v in sel.selected.values())
    chosen = sel.all_rows
    assert len(chosen) == 8 and len(set(chosen)) == 8
    assert not {eids[i] for i in chosen} & {"e0", "e3"}
    assert len({(eids[i], ts[i]) for i in chosen}) == 8  # one variant per query state
    for event, rows in sel.selected.items():
        assert all(event in evs[i] for i in rows)
    again = select_event_balanced(sids, eids, ts, evs, per_event=2, seed=1, excluded_episodes={"e0", "e3"})
    assert again.selected == sel.selected


def test_rows_spread_over_episodes_before_reusing_one():
    spec = [(f"e{i}", t, 1, [CP]) for i in range(3) for t in range(4)]
    sids, eids, ts, evs = _rows(spec)
    sel = select_event_balanced(sids, eids, ts, evs, per_event=3, seed=7)
    assert sorted(eids[i] for i in sel.selected[CP]) == ["e0", "e1", "e2"]
    sel = select_event_balanced(sids, eids, ts, evs, per_event=5, seed=7)
    assert sorted(eids[i] for i in sel.selected[CP]).count("e0") <= 2


def test_scarce_event_is_filled_first():
    # e1/t1 is the only near-goal candidate and also a collision precursor: it must serve the scarce event.
    spec = [("e1", 1, 1, [CP, NG]), ("e2", 1, 1, [CP]), ("e3", 1, 1, [PS]), ("e4", 1, 1, [RS])]
    sids, eids, ts, evs = _rows(spec)
    sel = select_event_balanced(sids, eids, ts, evs, per_event=1, seed=0)
    assert sel.short == {}
    assert [eids[i] for i in sel.selected[NG]] == ["e1"] and [eids[i] for i in sel.selected[CP]] == ["e2"]


def test_short_events_are_reported_with_counts():
    spec = [("e1", 1, 2, [CP]), ("e2", 1, 1, [CP, RS]), ("e3", 4, 1, [RS])]
    sids, eids, ts, evs = _rows(spec)
    sel = select_event_balanced(sids, eids, ts, evs, per_event=2, seed=0, excluded_episodes={"e3"})
    assert sel.candidates == {CP: 3, PS: 0, RS: 1, NG: 0}
    # RS (1 candidate) goes first and takes e2/t1; CP then has only e1/t1 left (one state, two variants).
    assert sel.short == {CP: 1, PS: 0, RS: 1, NG: 0}
