"""Closed-loop DAgger collection: the mixing draw, relabelling, and the written collection."""

import json
from pathlib import Path

import numpy as np
import pytest

from verl_omni.sim.closed_loop import PolicyQuery
from verl_omni.sim.collector import CollectorConfig, SynthesisConfig
from verl_omni.sim.dagger import MixedPolicy, beta_schedule, collect_dagger_round
from verl_omni.sim.levels import get_level
from verl_omni.sim.reference_policies import ExpertPolicy, StopPolicy


def _q(eid, k):
    return PolicyQuery(eid, 0, k, "go", np.zeros(3), np.zeros(2), "s")


def test_beta_schedule_halves():
    assert beta_schedule(3, 0.5, 0.5) == [0.5, 0.25, 0.125]
    with pytest.raises(ValueError):
        beta_schedule(0)


def test_mixing_draw_is_keyed_and_has_the_right_rate():
    mixed = MixedPolicy(StopPolicy(), ExpertPolicy({}), beta=0.3, seed=5)
    draws = [mixed.follows_expert(_q(f"e{i}", k)) for i in range(50) for k in range(20)]
    # 1000 Bernoulli(0.3) draws: mean 0.3, std 0.0145; 5 std either side.
    assert 0.3 - 0.0725 < np.mean(draws) < 0.3 + 0.0725
    assert draws == [mixed.follows_expert(_q(f"e{i}", k)) for i in range(50) for k in range(20)]  # reproducible
    assert all(MixedPolicy(StopPolicy(), ExpertPolicy({}), 1.0, 0).follows_expert(_q("a", k)) for k in range(5))
    assert not any(MixedPolicy(StopPolicy(), ExpertPolicy({}), 0.0, 0).follows_expert(_q("a", k)) for k in range(5))


@pytest.fixture(scope="module")
def stop_round(tmp_path_factory):
    """A round where the learner stops at once (beta 0): every episode is one premature STOP."""
    root = tmp_path_factory.mktemp("dagger")
    level = get_level("one_room")
    cfg = SynthesisConfig(num_scenes=1, episodes_per_scene=2, floorplan=level.floorplan(),
                          collector=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m))  # fmt: skip
    (root / "c" / "episodes").mkdir(parents=True)
    summary = collect_dagger_round(StopPolicy, cfg, 3, 0.0, root / "c" / "episodes", root / "occ", progress=False)
    return root, summary


def test_relabelled_premature_stop_teaches_to_go_on(stop_round):
    root, summary = stop_round
    assert summary["episodes"] == 2 and summary["expert_call_share"] == 0.0
    assert summary["learner_only_success_rate"] == 0.0
    for ep_dir in sorted((root / "c" / "episodes").iterdir()):
        rec = json.loads((ep_dir / "episode.json").read_text())
        assert len(rec["poses"]) == 1  # the learner stopped where it started
        assert rec["behaviour"] == {"type": "dagger", "beta": 0.0, "expert_calls": 0, "learner_calls": 1,
                                    "success": False, "end_reason": "stop", "blocked_steps": []}  # fmt: skip
        (q,) = rec["queries"]
        # The expert's label from the start pose moves (>= 3 m from the goal) and does not stop at once.
        assert q["reference_stop"][0] == 0
        moved = np.linalg.norm(np.diff(np.asarray(q["reference_poses"])[:, :2], axis=0), axis=1).sum()
        assert moved > 1.0
        assert (ep_dir / "rgb.mp4").is_file() and (ep_dir / q["reference_video"]).is_file()
    assert (root / "occ" / "s0000" / "occupancy.png").is_file()


def test_expert_round_reaches_the_goal_and_loads_for_sft(tmp_path):
    from verl_omni.models.wnm.sft import load_expert_examples
    from verl_omni.sim.collector import COLLECTION_FORMAT

    level = get_level("one_room")
    cfg = SynthesisConfig(num_scenes=1, episodes_per_scene=2, floorplan=level.floorplan(),
                          collector=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m))  # fmt: skip
    (tmp_path / "c" / "episodes").mkdir(parents=True)
    # beta 1: the expert drives every call; the learner (a stop policy) is never asked.
    summary = collect_dagger_round(StopPolicy, cfg, 3, 1.0, tmp_path / "c" / "episodes", tmp_path / "o",
                                   progress=False)  # fmt: skip
    assert summary["behaviour_success_rate"] == 1.0 and summary["expert_call_share"] == 1.0
    meta = cfg.collection_meta(3)
    assert meta["format"] == COLLECTION_FORMAT
    (tmp_path / "c" / "collection.json").write_text(json.dumps(meta))
    examples = load_expert_examples(Path(tmp_path / "c"), 33, (64, 64), progress=False)
    assert len(examples) == summary["queries"] and examples[0].history.shape == (33, 64, 64, 3)


def test_contacts_the_learner_drives_into_are_labelled_with_a_way_out(tmp_path):
    """A learner that drives straight on (beta 0) ends pressed against a wall; every one of those states is queried.

    With seed 3 the learner reaches a pose 0.2-0.25 m from a wall after 2 steps and stays there
    (its next steps are refused): the robot's 0.2 m disc is clear, but the expert's thin band (0.25 m) is not.
    Those states used to be dropped as unplannable (only frame 0 was queried); now each is labelled.
    """
    from verl_omni.data.occupancy import OccupancyMap
    from verl_omni.sim.reference_policies import StraightPolicy

    level = get_level("one_room")
    cfg = SynthesisConfig(num_scenes=1, episodes_per_scene=1, floorplan=level.floorplan(),
                          collector=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m))  # fmt: skip
    (tmp_path / "c" / "episodes").mkdir(parents=True)
    summary = collect_dagger_round(StraightPolicy, cfg, 3, 0.0, tmp_path / "c" / "episodes", tmp_path / "o",
                                   progress=False, max_steps=16)  # fmt: skip
    rec = json.loads((tmp_path / "c" / "episodes" / "s0000_d000" / "episode.json").read_text())
    occ = OccupancyMap.load(tmp_path / "o" / rec["scene_id"])
    poses = np.asarray(rec["poses"])
    clearance = occ.clearance_at(poses[:, :2])
    contact = np.nonzero((clearance >= 0.2) & (clearance < 0.25))[0]
    assert contact.tolist() == list(range(2, 17))  # pressed against the wall from step 2 on
    queried = {q["t"]: q for q in rec["queries"]}
    # Frame 2 was reached by a move; every later frame follows a refused step, a close call to be queried.
    assert set(range(3, 17)) <= set(queried)
    # The record keeps the refused steps (step i moves frame i to i + 1), and the summary counts the close calls.
    assert rec["behaviour"]["blocked_steps"] == list(range(2, 16))
    assert summary["close_calls"] == summary["close_calls_labelled"] == 14
    for t in range(3, 17):
        ref = np.asarray(queried[t]["reference_poses"])
        moves = np.nonzero(np.linalg.norm(np.diff(ref[:, :2], axis=0), axis=1) > 1e-9)[0]
        first = ref[moves[0] + 1, :2]
        assert occ.clearance_at(first) > clearance[t]  # the expert's first move backs away from the wall
        # and no pose of its way out comes closer to anything than the robot already was (so none is in contact)
        assert (occ.clearance_at(ref[:, :2]) >= clearance[t] - 1e-6).all()
