"""Held-out scenes and evaluation episodes for the closed-loop evaluator.

Scenes come from disk (folders written by ``tools/data/synthesize_gn0_collection.py --occupancy-dir``, which
carry the simulator's semantics so they can be rendered) or are generated fresh. Fresh scenes draw from
``SeedSequence([seed, HELDOUT_STREAM, index])``: a different seed stream than the collection synthesizer's
``SeedSequence([seed, index])``, so a held-out scene never repeats a training scene of the same seed. They are
named ``h0000, h0001, ...`` (training scenes are ``s0000, ...``).

Episodes are spread round-robin over the scenes; episode ``k`` draws its goal object, goal point, start pose,
instruction and noise seed from ``SeedSequence([seed, HELDOUT_STREAM, EPISODE_STREAM, k])`` with the
collector's own task sampler, so an episode list is a pure function of (scenes, count, seed, config).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from verl_omni.sim.closed_loop import EpisodeSpec
from verl_omni.sim.collector import CollectorConfig
from verl_omni.sim.floorplan import FloorPlan, FloorPlanConfig, FloorPlanError, generate_floor_plan
from verl_omni.sim.goals import SceneError, check_plan_has_goals, goal_candidates, sample_task
from verl_omni.sim.instructions import make_instructions
from verl_omni.sim.planner import ExpertPlanner, PlanningError

HELDOUT_STREAM = 0x45564131  # entropy word that separates evaluation draws from the synthesizer's
EPISODE_STREAM = 1


def find_scene_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Scene folders named by ``paths``: a folder holding ``occupancy.png`` is a scene, any other folder
    contributes its sub-folders that hold one (an ``--occupancy-dir`` root).

    Raises:
        FileNotFoundError: a path is missing or holds no scene.
    """
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise FileNotFoundError(f"--scenes {p}: not a directory")
        if (p / "occupancy.png").is_file():
            found.append(p)
            continue
        subs = sorted(d for d in p.iterdir() if d.is_dir() and (d / "occupancy.png").is_file())
        if not subs:
            raise FileNotFoundError(
                f"--scenes {p}: neither a scene (occupancy.png) nor a folder of scenes; pass a scene folder written "
                "by tools/data/synthesize_gn0_collection.py --occupancy-dir"
            )
        found.extend(subs)
    return found


def load_scenes(paths: Sequence[str | Path]) -> dict[str, tuple[FloorPlan, Path]]:
    """Loads scenes with their semantics.

    Returns:
        Scene id -> ``(plan, folder)``, in the order found.

    Raises:
        FileNotFoundError / FloorPlanError: a scene cannot be read (the message names the file).
        ValueError: two folders have the same scene id.
    """
    out: dict[str, tuple[FloorPlan, Path]] = {}
    for d in find_scene_dirs(paths):
        plan = FloorPlan.load(d)
        if plan.scene_id in out:
            raise ValueError(f"--scenes: scene id {plan.scene_id!r} appears twice ({out[plan.scene_id][1]} and {d})")
        out[plan.scene_id] = (plan, d)
    return out


def synthesize_heldout_scenes(
    count: int, seed: int, config: FloorPlanConfig | None = None, attempts: int = 5, task: CollectorConfig | None = None
) -> list[FloorPlan]:
    """Generates ``count`` fresh floor plans from the held-out seed stream.

    ``task`` (the episodes' sampling settings) rejects plans that cannot host its episodes, as the training
    collectors do; without it, or with ``goal_point="random"``, the scenes are those of every earlier release.

    Raises:
        SceneError: a scene fails ``attempts`` times (parameters too tight).
    """
    if count < 1:
        raise ValueError(f"synthesize_heldout_scenes: count must be >= 1, got {count}")
    cfg = config or FloorPlanConfig()
    plans = []
    for i in range(count):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), HELDOUT_STREAM, i]))
        last = None
        for _ in range(attempts):
            try:
                plans.append(check_plan_has_goals(generate_floor_plan(cfg, rng, scene_id=f"h{i:04d}"), task))
                break
            except FloorPlanError as e:
                last = e
        else:
            raise SceneError(f"held-out scene h{i:04d}: floor plan failed {attempts} times: {last}")
    return plans


def _base_planner(plan: FloorPlan, cfg: CollectorConfig) -> ExpertPlanner:
    """A planner whose inflated maps every goal of the scene reuses (any valid goal builds them)."""
    for f in plan.furniture:
        cands = goal_candidates(plan, f.index, cfg.planner, cfg.goal_object_distance_m)
        if len(cands):
            try:
                return ExpertPlanner(plan.occupancy(), cands[0], cfg.planner)
            except PlanningError as e:
                raise SceneError(f"scene {plan.scene_id!r}: {e}") from e
    raise SceneError(f"scene {plan.scene_id!r}: no furniture has free space around it for a goal")


def sample_episode_specs(
    plans: Sequence[FloorPlan], num_episodes: int, seed: int, config: CollectorConfig | None = None
) -> list[EpisodeSpec]:
    """Draws evaluation episodes, round-robin over ``plans``.

    Args:
        plans: Scenes (with semantics: rooms and furniture name the goal).
        num_episodes: Episodes in total.
        seed: Evaluation seed.
        config: Task sampling (``success_radius``, ``min_goal_distance_m``, planner, ...).

    Returns:
        ``num_episodes`` specs named ``<scene_id>_ev<k>``.

    Raises:
        SceneError: a scene cannot host an episode.
    """
    if num_episodes < 1 or not plans:
        raise ValueError(f"sample_episode_specs: needs >= 1 episode and >= 1 scene, got {num_episodes}, {len(plans)}")
    cfg = config or CollectorConfig()
    bases: dict[str, ExpertPlanner] = {}
    specs = []
    for k in range(num_episodes):
        plan = plans[k % len(plans)]
        if plan.scene_id not in bases:
            bases[plan.scene_id] = _base_planner(plan, cfg)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), HELDOUT_STREAM, EPISODE_STREAM, k]))
        obj_index, goal, planner, start = sample_task(plan, bases[plan.scene_id], cfg, rng)
        obj = plan.furniture[obj_index]
        instruction = make_instructions(plan.rooms[obj.room].kind, obj.name, 1, rng)[0]
        specs.append(
            EpisodeSpec(
                episode_id=f"{plan.scene_id}_ev{k:03d}",
                scene_id=plan.scene_id,
                start_pose=tuple(start),
                goal=tuple(goal),
                instruction=instruction,
                success_radius=cfg.success_radius,
                shortest_path_m=float(planner.distance(start[:2])),
                seed=int(rng.integers(0, 2**31 - 1)),
                goal_object=obj.name,
            )
        )
    return specs


def draw_heldout_episodes(
    scenes: int, episodes: int, seed: int, floorplan: FloorPlanConfig, task: CollectorConfig
) -> tuple[list[FloorPlan], list[EpisodeSpec]]:
    """The held-out scenes and episodes of one seed, as the closed-loop evaluator draws them with ``--synthesize``.

    Args:
        scenes: Scenes to synthesize.
        episodes: Episodes in total, round-robin over the scenes.
        seed: Held-out seed (scenes, episodes and noise).
        floorplan: The task level's floor plans.
        task: The episodes' sampling settings (goal rule, success radius, minimum goal distance).

    Raises:
        SceneError: a scene cannot be built or cannot host an episode.
    """
    plans = synthesize_heldout_scenes(scenes, seed, floorplan, task=task)
    return plans, sample_episode_specs(plans, episodes, seed, task)
