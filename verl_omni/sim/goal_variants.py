"""Counterfactual goals: a driven trajectory relabelled toward other objects of its scene."""

from __future__ import annotations

import numpy as np

from verl_omni.sim.collector import CollectorConfig, Episode, label_episode
from verl_omni.sim.floorplan import FloorPlan
from verl_omni.sim.goals import goal_candidates, nearest_goal, unique_objects
from verl_omni.sim.instructions import make_instructions
from verl_omni.sim.planner import ExpertPlanner
from verl_omni.sim.render import Renderer

GOAL_VARIANT_STREAM = 0x676F616C  # separates the variants' draws from the episode's own (K = 1 stays unchanged)


def goal_variant_episodes(
    plan: FloorPlan,
    renderer: Renderer,
    base_planner: ExpertPlanner,
    episode: Episode,
    variants: int,
    cfg: CollectorConfig,
    seed_key: list[int],
) -> list[Episode]:
    """The same driven trajectory relabelled toward other goal objects of the scene (counterfactual goals).

    Why: in a driven episode the history frames alone identify the episode, and so its goal; a learner can
    fit the expert's actions from the views and never read the instruction (measured: swapping instructions
    changed nothing). The same states labelled toward several goals, each with its own instruction, make the
    instruction the only way to tell the labels apart. Each variant is a complete episode
    ``<episode_id>_g<k>`` whose record names the goal it is labelled for; ``behaviour`` says that the robot was
    driven toward the original goal.

    Args:
        plan / renderer / base_planner: The scene, its renderer and its base planner.
        episode: The driven episode (its poses and goal).
        variants: Extra goals (0 gives none); fewer when the scene has fewer other nameable objects.
        cfg: Collection settings.
        seed_key: Entropy of the variants' draws (objects, goal points, instruction templates).

    Returns:
        Up to ``variants`` episodes.
    """
    rec = episode.record
    poses = np.asarray(rec["poses"])
    own = next(f.index for f in plan.furniture if f.name == rec["goal_object"]["name"])
    others = [i for i in unique_objects(plan) if i != own]
    rng = np.random.default_rng(np.random.SeedSequence([*seed_key, GOAL_VARIANT_STREAM]))
    out = []
    for obj_index in rng.permutation(others)[:variants]:
        obj = plan.furniture[int(obj_index)]
        cands = goal_candidates(plan, obj.index, cfg.planner, cfg.goal_object_distance_m)
        if len(cands) == 0:
            continue
        pick = cands[int(rng.integers(len(cands)))]  # drawn in both modes, so the rng stream stays the same
        if cfg.goal_point == "nearest":  # the object's point nearest to where the driven episode started
            pick, dist = nearest_goal(plan.occupancy(), cands, poses[0, :2])
            if not np.isfinite(dist):
                continue
        planner = base_planner.retarget(pick)
        # Every visited pose must reach the new goal on the planner's own (inflated) map, not only the start on
        # the bare map: a pose behind furniture for this goal cannot be labelled (measured: one scene in 200
        # of one_room seed 0 aborted a whole collection).
        if not planner.reachable(poses[:, :2]).all():
            continue
        instructions = make_instructions(plan.rooms[obj.room].kind, obj.name, len(rec["instructions"]), rng)
        info = {"type": "goal_variant", "driven_toward": rec["goal_object"]["name"], "of_episode": rec["episode_id"]}
        eid = f"{rec['episode_id']}_g{len(out) + 1}"
        stopped = bool(rec["policy_stopped"])
        out.append(label_episode(plan, renderer, planner, eid, obj.index, instructions, poses, [], stopped, cfg,
                                 policy_info=info, frames=episode.frames))  # fmt: skip
    return out
