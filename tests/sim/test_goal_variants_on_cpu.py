"""Counterfactual goal variants: the same driven trajectory, labelled toward other objects of the scene."""

import json

import numpy as np
import pytest

from verl_omni.sim.collector import CollectorConfig, SynthesisConfig, synthesize_scene
from verl_omni.sim.levels import get_level


def _synth(tmp_path, variants):
    level = get_level("two_rooms")
    cfg = SynthesisConfig(num_scenes=1, episodes_per_scene=2, floorplan=level.floorplan(), goal_variants=variants,
                          collector=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m))  # fmt: skip
    root = tmp_path / f"k{variants}"
    (root / "episodes").mkdir(parents=True)
    summary = synthesize_scene(0, 5, cfg, root / "episodes", root / "occ")
    return root, summary, {d.name: json.loads((d / "episode.json").read_text()) for d in (root / "episodes").iterdir()}


def test_variants_share_the_trajectory_and_name_their_own_goal(tmp_path):
    _, s1, base = _synth(tmp_path, 1)
    _, s3, more = _synth(tmp_path, 3)
    assert sorted(base) == ["s0000_e000", "s0000_e001"] and s1["episodes"] == 2
    for eid, rec in base.items():  # K = 1 episodes are unchanged by asking for variants
        assert more[eid] == rec
    variants = {k: v for k, v in more.items() if "_g" in k}
    assert variants and s3["episodes"] == len(more)
    for eid, rec in variants.items():
        orig = more[eid.split("_g")[0]]
        assert rec["poses"] == orig["poses"]  # same states
        assert rec["goal_object"]["name"] != orig["goal_object"]["name"]  # another goal...
        assert all(rec["goal_object"]["name"] in text for text in rec["instructions"])  # ...that its text names
        assert rec["behaviour"] == {"type": "goal_variant", "driven_toward": orig["goal_object"]["name"],
                                    "of_episode": orig["episode_id"]}  # fmt: skip
        # The expert's label from the first state heads for this variant's goal, not the original one.
        q = rec["queries"][0]
        end = np.asarray(q["reference_poses"])[-1, :2]
        start = np.asarray(rec["poses"])[q["t"], :2]
        to_own = np.linalg.norm(end - rec["goal"]) - np.linalg.norm(start - rec["goal"])
        assert to_own < 0  # it gets closer to its own goal


def test_goal_variants_must_be_positive():
    with pytest.raises(ValueError, match="goal_variants"):
        SynthesisConfig(goal_variants=0)
