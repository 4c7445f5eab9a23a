"""Training subset: one row per episode, deterministic for a seed, refuses impossible sizes."""

from __future__ import annotations

import hashlib

import pytest

from verl_omni.data.sampling import SubsetTooLargeError, sample_one_row_per_episode


def _ids():
    # 5 episodes with 1..5 rows each (query t, variant k).
    rows = [(f"e{e}", f"e{e}/t{t:06d}/i{k:03d}") for e in range(5) for t in range(e + 1) for k in range(1 + e % 2)]
    return [s for _, s in rows], [e for e, _ in rows]


def _unit(seed, key):
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{key}".encode()).digest()[:8], "big") / 2.0**64


def test_at_most_one_row_per_episode_and_exact_size():
    sids, eids = _ids()
    for size in (1, 3, 5):
        idx = sample_one_row_per_episode(sids, eids, size, seed=3)
        assert len(idx) == size and len({eids[i] for i in idx}) == size
        assert [sids[i] for i in idx] == sorted(sids[i] for i in idx)


def test_choice_follows_the_documented_hash_rule():
    sids, eids = _ids()
    idx = sample_one_row_per_episode(sids, eids, 2, seed=11)
    # Independent recomputation: rank episodes by hash, pick each one's min-hash row.
    episodes = sorted(set(eids), key=lambda e: _unit(11, "episode:" + e))[:2]
    expected = sorted(
        min((s for s, e in zip(sids, eids) if e == ep), key=lambda s: _unit(11, "row:" + s)) for ep in episodes
    )
    assert [sids[i] for i in idx] == expected


def test_deterministic_independent_of_input_order_and_seed_sensitive():
    sids, eids = _ids()
    a = [sids[i] for i in sample_one_row_per_episode(sids, eids, 3, seed=5)]
    perm = list(reversed(range(len(sids))))
    rs, re_ = [sids[i] for i in perm], [eids[i] for i in perm]
    b = [rs[i] for i in sample_one_row_per_episode(rs, re_, 3, seed=5)]
    assert a == b
    picks = {tuple(sids[i] for i in sample_one_row_per_episode(sids, eids, 3, seed=s)) for s in range(8)}
    assert len(picks) > 1


def test_refuses_more_rows_than_episodes():
    sids, eids = _ids()
    with pytest.raises(SubsetTooLargeError, match="only 5 source episodes"):
        sample_one_row_per_episode(sids, eids, 6, seed=0)
    with pytest.raises(ValueError, match="not unique"):
        sample_one_row_per_episode(["a", "a"], ["e", "f"], 1, seed=0)


def test_event_share_takes_its_quota_from_event_rows_first_by_hand():
    sids, eids = _ids()
    # Event rows: the t=1 rows of episodes e1..e4 (episode e0 has none).
    has = ["/t000001/" in s for s in sids]
    idx = sample_one_row_per_episode(sids, eids, 4, seed=11, row_has_event=has, event_share=0.5)
    # Independent recomputation: round(0.5 * 4) = 2 episodes with an event row, by episode hash, each with its
    # min-hash event row; then 2 more episodes of the rest by hash, each with its min-hash row of any kind.
    with_event = sorted({e for e, h in zip(eids, has) if h}, key=lambda e: _unit(11, "episode:" + e))[:2]
    rest = [e for e in sorted(set(eids), key=lambda e: _unit(11, "episode:" + e)) if e not in with_event][:2]

    def best(ep, only_event):
        rows = [s for s, e, h in zip(sids, eids, has) if e == ep and (h or not only_event)]
        return min(rows, key=lambda s: _unit(11, "row:" + s))

    expected = sorted([best(e, True) for e in with_event] + [best(e, False) for e in rest])
    assert [sids[i] for i in idx] == expected
    assert len({eids[i] for i in idx}) == 4


def test_event_share_zero_is_the_plain_rule_and_a_short_supply_is_filled():
    sids, eids = _ids()
    has = ["/t000001/" in s for s in sids]
    plain = sample_one_row_per_episode(sids, eids, 3, seed=2)
    assert list(sample_one_row_per_episode(sids, eids, 3, seed=2, row_has_event=has, event_share=0.0)) == list(plain)
    # Share 1 of 5 rows: only 4 episodes have an event row; the fifth row comes from e0 by the plain rule.
    idx = sample_one_row_per_episode(sids, eids, 5, seed=2, row_has_event=has, event_share=1.0)
    assert sum(has[i] for i in idx) == 4 and {eids[i] for i in idx} == set(eids)
    with pytest.raises(ValueError, match="row_has_event"):
        sample_one_row_per_episode(sids, eids, 3, seed=2, event_share=0.5)
    with pytest.raises(ValueError, match="event_share"):
        sample_one_row_per_episode(sids, eids, 3, seed=2, row_has_event=has, event_share=1.5)
