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


def test_scene_whose_variant_crossed_the_furniture_margin_is_synthesized(tmp_path):
    # one_room, collection seed 0, scene 135: a variant's goal was reachable from the start but not from a later
    # pose on the planner's map, which aborted the whole 200-scene collection. Every variant pose must reach.
    level = get_level("one_room")
    cfg = SynthesisConfig(num_scenes=200, episodes_per_scene=4, floorplan=level.floorplan(), goal_variants=3,
                          collector=CollectorConfig(min_goal_distance_m=level.min_goal_distance_m))  # fmt: skip
    (tmp_path / "episodes").mkdir()
    summary = synthesize_scene(135, 0, cfg, tmp_path / "episodes", tmp_path / "occ")
    assert summary["episodes"] > 4  # the driven episodes and at least one variant


def test_unreachable_query_states_are_not_labelled():
    from verl_omni.sim.collector import collect_episode, goal_candidates, label_episode
    from verl_omni.sim.floorplan import generate_floor_plan
    from verl_omni.sim.planner import ExpertPlanner
    from verl_omni.sim.render import Renderer

    level = get_level("one_room")
    cc = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m)
    plan = generate_floor_plan(level.floorplan(), np.random.default_rng(3), scene_id="s0000")
    occ = plan.occupancy()
    seed_goal = next(
        c[0] for f in plan.furniture if len(c := goal_candidates(plan, f.index, cc.planner, cc.goal_object_distance_m))
    )
    base = ExpertPlanner(occ, seed_goal, cc.planner)
    renderer = Renderer(plan, cc.camera)
    ep = collect_episode(plan, renderer, base, "s0000_e000", cc, np.random.default_rng(4))
    rec = ep.record
    planner = base.retarget(np.asarray(rec["goal"]))
    poses = np.array(rec["poses"], dtype=np.float64)
    t_bad = cc.query_stride  # a stride query state, labelled in the original episode
    assert t_bad in [q["t"] for q in rec["queries"]]
    # Move that state onto a cell the planner cannot leave (inside an obstacle's robot-radius margin).
    grid = np.stack(np.meshgrid(np.arange(0.1, 6.0, 0.05), np.arange(0.1, 5.0, 0.05)), -1).reshape(-1, 2)
    blocked = grid[~planner.reachable(grid)]
    rows, cols = occ.world_to_grid(blocked)
    inside = (rows >= 0) & (rows < occ.shape[0]) & (cols >= 0) & (cols < occ.shape[1])
    poses[t_bad, :2] = blocked[inside][0]
    relabelled = label_episode(plan, renderer, planner, "s0000_e000", next(
        f.index for f in plan.furniture if f.name == rec["goal_object"]["name"]), rec["instructions"], poses, [],
        bool(rec["policy_stopped"]), cc)  # fmt: skip
    times = [q["t"] for q in relabelled.record["queries"]]
    assert t_bad not in times and 0 in times  # the rest of the trajectory is still labelled
