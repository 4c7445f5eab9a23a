"""The reward and the closed-loop evaluator agree on the robot's footprint, the expert's turn and STOP success.

The evaluator (``verl_omni.sim.closed_loop``) is the judge the reward must anticipate: a reward footprint smaller
than the evaluator's lets rollouts graze walls the evaluation counts as collisions, a rate guard below the
expert's turn step penalises imitating it, and a success test other than the evaluator's geodesic one rewards
STOPs the evaluation fails. The STOP test scores real (synthesized) query states with the reward and, separately,
with the evaluator's own episode scoring (``episode_result`` on a freshly loaded map).
"""

import math

import numpy as np
import pytest
import yaml
from reward_helpers import REPO, synthesize_collection

from verl_omni.data.actions import integrate_actions
from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap
from verl_omni.sim.closed_loop import ClosedLoopConfig, EpisodeSpec, episode_result
from verl_omni.sim.collector import CollectorConfig
from verl_omni.sim.events import EventThresholds
from verl_omni.sim.floorplan import FloorPlanConfig
from verl_omni.sim.planner import PlannerConfig
from verl_omni.utils.reward_score import RewardBatch, build_reward_set
from verl_omni.utils.reward_score.ranking import load_query_states, policy_actions
from verl_omni.utils.reward_score.trajectory import GeometryConfig

LOCKED = REPO / "recipes" / "wnm_3d" / "stage3" / "config" / "locked.yaml"


def _locked_reward_set() -> dict:
    return dict(yaml.safe_load(LOCKED.read_text())["reward"]["reward_set"])


def test_reward_and_evaluator_use_one_robot_radius():
    # 0.2 m: the disc the evaluator sweeps (ClosedLoopConfig), the planner keeps clear, the event labeller sweeps and
    # the floor plans keep doors passable for. The locked recipe and the reward's defaults must use the same one.
    radii = {
        "shared constant": ROBOT_RADIUS_M,
        "locked recipe": _locked_reward_set()["robot_radius"],
        "GeometryConfig": GeometryConfig().robot_radius,
        "reward set without a radius": build_reward_set({"rewards": {"stop": {}}}).geometry_config.robot_radius,
        "ClosedLoopConfig": ClosedLoopConfig().robot_radius,
        "PlannerConfig": PlannerConfig().robot_radius,
        "EventThresholds": EventThresholds().robot_radius,
        "FloorPlanConfig": FloorPlanConfig().robot_radius,
    }
    assert radii == dict.fromkeys(radii, 0.2)


def test_rate_guard_admits_the_experts_turn_step():
    # The planner turns at most 30 degrees (pi / 6 = 0.5236 rad) per step; the locked rate limit must not be below
    # it, or the guard charges the expert's own turns.
    assert PlannerConfig().max_turn_rad == pytest.approx(math.radians(30))
    assert _locked_reward_set()["rewards"]["yaw"]["rate_limit_rad"] >= math.radians(30)


def test_stop_success_and_distance_are_the_evaluators_on_real_query_states(tmp_path):
    collection, occupancy_dir = synthesize_collection(tmp_path, num_scenes=2, episodes_per_scene=3)
    states = load_query_states(collection)
    # The success radius of every recorded episode is the one the evaluator's episodes are drawn with
    # (sim.heldout.sample_episode_specs: CollectorConfig().success_radius).
    np.testing.assert_array_equal(states.success_radius, CollectorConfig().success_radius)
    cfg = _locked_reward_set()
    cfg["occupancy_root"] = str(occupancy_dir)
    reward_set = build_reward_set(cfg)

    # The expert's own motion with a STOP forced at step s: STOP poses spread from the query pose to the end of the
    # reference, so some land inside the success radius (near required STOPs) and most do not.
    expert = policy_actions(states, "expert")
    stop_steps = (0, 3, 8, 15, 22, 31)
    actions = np.concatenate([expert] * len(stop_steps))
    for k, s in enumerate(stop_steps):
        rows = slice(k * states.size, (k + 1) * states.size)
        actions[rows, s:, 3] = 1.0
        actions[rows, s:, :3] = 0.0
    reps = len(stop_steps)
    batch = RewardBatch(
        actions=actions,
        start_pose=np.tile(states.reference_poses[:, 0], (reps, 1)),
        reference_poses=np.tile(states.reference_poses, (reps, 1, 1)),
        goal=np.tile(states.goal, (reps, 1)),
        success_radius=np.tile(states.success_radius, reps),
        events=states.events * reps,
        scene_id=states.scene_id * reps,
        rollout_id=[f"{q}/s{s}" for s in stop_steps for q in states.query_id],
    )
    out = reward_set.score(batch)
    reward_success = out.diagnostics["stop/success"].sum(axis=1) > 0
    reward_distance = out.diagnostics["stop/stop_distance_m"]
    stopped = np.isfinite(reward_distance)  # a STOP happened before any hard collision
    assert stopped.mean() > 0.95

    maps = {}
    poses = integrate_actions(batch.start_pose, actions)
    checked, successes = 0, 0
    for i in np.flatnonzero(stopped):
        scene = batch.scene_id[i]
        if scene not in maps:
            maps[scene] = OccupancyMap.load(occupancy_dir / scene)
        s = stop_steps[i // states.size]
        spec = EpisodeSpec(
            episode_id=batch.rollout_id[i].replace("/", "_"),
            scene_id=scene,
            start_pose=tuple(batch.start_pose[i]),
            goal=tuple(batch.goal[i]),
            instruction="",
            success_radius=float(batch.success_radius[i]),
            shortest_path_m=1.0,
            seed=0,
        )
        judged = episode_result(
            spec, maps[scene], poses[i, : s + 1], actions[i, :s], np.zeros(s, bool), 0.0, True, "stop", 1
        )
        assert judged.success == reward_success[i], batch.rollout_id[i]
        assert judged.ne == pytest.approx(float(reward_distance[i]), abs=1e-6), batch.rollout_id[i]
        checked += 1
        successes += judged.success
    # Both outcomes are exercised: successes (STOPs at the end of references that reach the goal) and failures.
    assert checked > 100 and 5 <= successes < checked - 5
