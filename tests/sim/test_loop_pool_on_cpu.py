"""Closed-loop episodes over a process pool give the single-process loop's results, in spec order."""

import functools

import pytest

from verl_omni.sim.closed_loop import run_closed_loop
from verl_omni.sim.collector import CollectorConfig
from verl_omni.sim.heldout import sample_episode_specs, synthesize_heldout_scenes
from verl_omni.sim.levels import get_level
from verl_omni.sim.loop_pool import chunk_specs, run_closed_loop_pool
from verl_omni.sim.reference_policies import make_scripted_policy


@pytest.fixture(scope="module")
def episodes():
    level = get_level("one_room")
    plans = {p.scene_id: p for p in synthesize_heldout_scenes(2, 7, level.floorplan())}
    specs = sample_episode_specs(list(plans.values()), 5, 7, CollectorConfig(min_goal_distance_m=3.0))
    return plans, specs


def test_chunks_cover_every_spec_once_in_order():
    specs = list(range(7))
    chunks = chunk_specs(specs, workers=2)  # about 2 chunks per worker
    assert [x for c in chunks for x in c] == specs and len(chunks) == 4 and max(map(len, chunks)) == 2
    assert chunk_specs(specs[:1], workers=8) == [[0]]


@pytest.mark.parametrize("name", ["goal_bearing", "expert"])
def test_pool_equals_single_process_loop(episodes, name):
    plans, specs = episodes
    single = run_closed_loop(make_scripted_policy(name, plans), plans, specs, progress=False)
    pooled, info = run_closed_loop_pool(functools.partial(make_scripted_policy, name, plans), plans, specs,
                                        workers=2, progress=False)  # fmt: skip
    assert info == {}  # scripted policies keep no per-episode bookkeeping
    assert [r.episode_id for r in pooled] == [s.episode_id for s in specs]
    assert [r.metrics() for r in pooled] == [r.metrics() for r in single]


def test_pool_collects_episode_info(episodes):
    from verl_omni.sim.dagger import build_mixed_policy

    plans, specs = episodes
    planner = CollectorConfig().planner
    factory = functools.partial(build_mixed_policy, functools.partial(make_scripted_policy, "stop", plans), plans,
                                1.0, 0, planner, (64, 64))  # fmt: skip
    results, info = run_closed_loop_pool(factory, plans, specs, workers=2, progress=False)
    assert sorted(info) == sorted(s.episode_id for s in specs)
    # beta 1: every call followed the expert, so the stop policy was never asked and the expert succeeded.
    assert all(v["learner_calls"] == 0 and v["expert_calls"] == r.policy_calls for v, r in zip(
        (info[r.episode_id] for r in results), results, strict=True))  # fmt: skip
    assert all(r.success for r in results)


def test_one_worker_reuses_the_policy_already_built():
    from verl_omni.sim.loop_pool import reuse_when_in_process

    built = object()
    assert reuse_when_in_process(dict, built, workers=1)() is built  # nothing is loaded a second time
    assert reuse_when_in_process(dict, built, workers=2) is dict  # each worker builds its own copy
