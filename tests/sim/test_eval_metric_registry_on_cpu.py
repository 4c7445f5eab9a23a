"""The closed-loop metric registry (verl_omni.sim.eval_metrics.METRICS) is the one list every consumer derives from."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from verl_omni.sim import eval_metrics as em
from verl_omni.sim.closed_loop import EpisodeResult

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from study import stats  # noqa: E402

# Fields of an episode record that identify or describe it but are not aggregated metrics.
RECORD_FIELDS = {"episode_id", "scene_id", "policy_calls", "end_reason"}


def _episode_metrics() -> dict:
    blocked = np.array([0, 1, 1, 0, 1, 1, 1, 1], bool)
    r = EpisodeResult("e", "s", False, False, 0.0, 1.0, int(blocked.sum()), True, 1.0, 8, 3, "max_steps",
                      np.zeros((9, 3)), np.zeros((8, 4)), blocked, np.ones(9))  # fmt: skip
    return r.metrics()


def test_episode_record_keys_are_exactly_the_registered_metrics():
    metric_keys = set(_episode_metrics()) - RECORD_FIELDS
    assert metric_keys == set(em.METRIC_SPECS)
    assert len(em.METRIC_SPECS) == len(em.METRICS)  # no name registered twice


def test_derived_lists_follow_the_registry():
    names = [m.name for m in em.METRICS]
    assert set(em.PROPORTION_METRICS) | set(em.MEAN_METRICS) == set(names)
    assert not set(em.PROPORTION_METRICS) & set(em.MEAN_METRICS)
    assert set(em.PROPORTION_METRICS) == {"success", "oracle_success", "collided", "premature_stop"}
    assert set(em.METRIC_LABELS) == set(em.HIGHER_IS_BETTER) == set(names)
    assert set(em.OPTIONAL_METRICS) <= set(names) and set(em.SUMMARY_METRICS) <= set(names)
    with pytest.raises(ValueError, match="aggregate"):
        em.MetricSpec("x", "x", "median", None)


def test_aggregate_covers_every_registered_metric():
    m = _episode_metrics()
    agg = em.aggregate([m, {**m, "episode_id": "f"}])
    assert set(em.METRIC_SPECS) <= set(agg)
    assert all(agg[n]["method"] == "wilson" for n in em.PROPORTION_METRICS)


def test_study_direction_lookup_covers_every_registered_metric():
    for name in em.METRIC_SPECS:
        assert stats.HIGHER_IS_BETTER[name] in (True, False, None)
    assert stats.HIGHER_IS_BETTER["success"] is True and stats.HIGHER_IS_BETTER["spl"] is True
    assert stats.HIGHER_IS_BETTER["collisions"] is False and stats.HIGHER_IS_BETTER["collision_events"] is False
    assert stats.HIGHER_IS_BETTER["premature_stop"] is False and stats.HIGHER_IS_BETTER["path_length"] is None
    assert set(stats.CLOSED_LOOP_METRICS) <= set(em.METRIC_SPECS)
    assert set(stats.BINARY_METRICS) == set(em.PROPORTION_METRICS)


def test_study_comparison_runs_every_summary_metric_in_its_direction():
    """Every rate goes False -> True and every mean up by 1 on every episode: a zero-spread difference of +1, so
    ``improved`` is exactly the registered direction (None where neither is better)."""
    base, after = [], []
    for i in range(4):
        b = {"episode_id": f"e{i}"}
        a = {"episode_id": f"e{i}"}
        for spec in em.METRICS:
            if spec.aggregate == "rate":
                b[spec.name], a[spec.name] = False, True
            else:
                b[spec.name], a[spec.name] = float(i), float(i) + 1.0
        base.append(b)
        after.append(a)
    comp = stats.compare_closed_loop(base, [after])
    assert list(comp) == list(stats.CLOSED_LOOP_METRICS)
    for name, c in comp.items():
        assert c["diff"] == pytest.approx((1.0, 1.0, 1.0))
        assert c["improved"] is em.HIGHER_IS_BETTER[name], name


def test_evaluator_summary_table_lists_every_summary_metric():
    spec = importlib.util.spec_from_file_location("closed_loop_eval_cli", ROOT / "tools/eval/closed_loop_eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    m = _episode_metrics()
    agg = em.aggregate([m, {**m, "episode_id": "f"}])
    table = cli._summary_table([("checkpoint", agg)], None)
    lines = table.splitlines()[1:]
    assert [line.split("  ")[0] for line in lines] == [em.METRIC_LABELS[n] for n in em.SUMMARY_METRICS]


def test_premature_stop_bins_by_hand():
    from verl_omni.sim.eval_metrics import premature_stop_bins

    # One radius for all (0.5 m): premature STOPs ending 0.9 (0.4 beyond), 1.0 (0.5 beyond: the edge belongs to
    # the bin below), 1.6 (1.1 beyond) and 4.0 m (3.5 beyond) from the goal; a success and a timeout do not count.
    eps = [{"episode_id": i, "ne": ne, "premature_stop": prem}
           for i, (ne, prem) in enumerate([(0.9, True), (1.0, True), (1.6, True), (4.0, True), (0.4, False),
                                           (2.0, False)])]  # fmt: skip
    assert premature_stop_bins(eps, 0.5, (0.5, 1.5)) == [2, 1, 1]
    # Per-episode radii: episode 0 with radius 0.7 is 0.2 m beyond, still in the first bin; episode 3 with radius
    # 3.0 is 1.0 beyond, now in the second.
    radii = {0: 0.7, 1: 0.5, 2: 0.5, 3: 3.0, 4: 0.5, 5: 0.5}
    assert premature_stop_bins(eps, radii, (0.5, 1.5)) == [2, 2, 0]
    with pytest.raises(KeyError, match="episode 1"):
        premature_stop_bins(eps, {0: 0.5}, (0.5, 1.5))
    assert em.premature_stop_bin_labels((0.5, 1.5)) == ["0-0.5 m", "0.5-1.5 m", "> 1.5 m"]
