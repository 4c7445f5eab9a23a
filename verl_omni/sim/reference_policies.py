"""Scripted reference policies for the closed-loop evaluator and the DAgger collector.

They bracket what a learned navigator should reach on a task level:

- ``expert``: the A* expert with the privileged map, replanned from the current pose at every call (the
  ceiling; the same planner labels the training data).
- ``expert_no_stop``: the expert that never issues STOP (its SR is 0 by construction, its OSR is the
  expert's): shows that the evaluator needs an explicit STOP.
- ``object_expert``: the expert told what a learned policy is told (the named object, from the instruction)
  plus the map, but not the goal point: it drives to the object's point nearest to where the episode started
  and stops there. Under ``CollectorConfig.goal_point="nearest"`` that is the goal (its SR is the expert's);
  under ``random`` it measures how often the hidden side of the object happens to be the near one, the ceiling
  of any policy without the goal's coordinates.
- ``goal_bearing``: knows the goal point but not the map: turns toward the goal and drives straight at it,
  STOP once the straight-line distance is within the expert's stop distance. It is what a compass can do;
  a learned navigator should beat it on levels with more than one room.
- ``straight``: drives forward and never stops.
- ``stop``: issues STOP at its first call.

Every scripted policy reads the privileged ``pose``/``goal`` of :class:`~verl_omni.sim.closed_loop.PolicyQuery`
and ignores the frames; the learned policy (``verl_omni.sim.wnm_policy``) does the opposite. Motion limits
are the expert planner's (step length, turn rate), so the baselines move like the data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from verl_omni.data.actions import poses_to_actions, wrap_angle
from verl_omni.sim.closed_loop import PolicyQuery
from verl_omni.sim.floorplan import FloorPlan
from verl_omni.sim.planner import ExpertPlanner, PlannerConfig, PlanningError

HORIZON = 32  # action steps returned per call, as the WNM policy returns


class _ScriptedPolicy:
    """Shared shape of the scripted policies: frames are not looked at (one tiny frame is enough)."""

    history_frames = 1
    name = "scripted"

    def __init__(self, image_size: tuple[int, int] = (64, 64), planner: PlannerConfig | None = None) -> None:
        self.image_size = tuple(int(v) for v in image_size)
        self.cfg = planner or PlannerConfig()

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """``float64 [B, 32, 4]`` decoded actions, one row per query (history is ignored)."""
        return np.stack([self.act_one(q) for q in queries])

    def act_one(self, query: PolicyQuery) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError


class StopPolicy(_ScriptedPolicy):
    """STOP at the first step."""

    name = "stop"

    def act_one(self, query: PolicyQuery) -> np.ndarray:
        out = np.zeros((HORIZON, 4))
        out[:, 3] = 1.0
        return out


class StraightPolicy(_ScriptedPolicy):
    """One step length forward per step, never STOP."""

    name = "straight"

    def act_one(self, query: PolicyQuery) -> np.ndarray:
        out = np.zeros((HORIZON, 4))
        out[:, 0] = self.cfg.step_length
        return out


class GoalBearingPolicy(_ScriptedPolicy):
    """Turns toward the goal point (at most the expert's turn rate per step) and drives at it.

    A step moves forward only when the remaining heading error is within one turn step, like the expert's
    own pose generator. STOP is issued at the start of a call whose actual pose is within ``stop_distance``
    (straight line) of the goal; within a chunk the policy only plans motion, since a blocked step would make
    a STOP planned from an imagined pose premature. Having arrived inside a chunk it idles until the next call.
    """

    name = "goal_bearing"

    def act_one(self, query: PolicyQuery) -> np.ndarray:
        pose = np.asarray(query.pose, np.float64).copy()
        goal = np.asarray(query.goal, np.float64)
        out = np.zeros((HORIZON, 4))
        if float(np.hypot(*(goal - pose[:2]))) <= self.cfg.stop_distance:
            out[:, 3] = 1.0
            return out
        for k in range(HORIZON):
            delta = goal - pose[:2]
            dist = float(np.hypot(*delta))
            if dist <= 1e-9:
                break
            err = float(wrap_angle(math.atan2(delta[1], delta[0]) - pose[2]))
            turn = float(np.clip(err, -self.cfg.max_turn_rad, self.cfg.max_turn_rad))
            fwd = min(self.cfg.step_length, dist) if abs(err) <= self.cfg.max_turn_rad else 0.0
            # Actions are in the frame of the previous pose: the translation is along the new heading.
            out[k, 0], out[k, 1], out[k, 2] = fwd * math.cos(turn), fwd * math.sin(turn), turn
            yaw = pose[2] + turn
            pose = np.array([pose[0] + fwd * math.cos(yaw), pose[1] + fwd * math.sin(yaw), wrap_angle(yaw)])
        return out


class ExpertPolicy(_ScriptedPolicy):
    """The A* expert with the scene's map, replanned from the current pose at every call.

    Args:
        plans: Scene id -> floor plan; episodes name their scene through ``PolicyQuery.scene_id``.
        stop: Emit the expert's STOP flags (``False`` gives ``expert_no_stop``).
    """

    name = "expert"

    def __init__(
        self,
        plans: Mapping[str, FloorPlan],
        stop: bool = True,
        image_size: tuple[int, int] = (64, 64),
        planner: PlannerConfig | None = None,
    ) -> None:
        super().__init__(image_size, planner)
        self.plans = plans
        self.stop = stop
        self.name = "expert" if stop else "expert_no_stop"
        self._planners: dict[tuple[str, float, float], ExpertPlanner] = {}
        self._bases: dict[str, ExpertPlanner] = {}

    def planner_for(self, scene_id: str, goal: np.ndarray) -> ExpertPlanner:
        """The (cached) planner of one goal in one scene; the inflated maps are shared per scene."""
        key = (scene_id, float(goal[0]), float(goal[1]))
        if key not in self._planners:
            if scene_id not in self.plans:
                raise KeyError(f"expert policy: scene {scene_id!r} was not given to the policy")
            base = self._bases.get(scene_id)
            planner = base.retarget(goal) if base else ExpertPlanner(self.plans[scene_id].occupancy(), goal, self.cfg)
            self._bases.setdefault(scene_id, planner)
            self._planners[key] = planner
        return self._planners[key]

    def act_one(self, query: PolicyQuery) -> np.ndarray:
        planner = self.planner_for(query.scene_id, np.asarray(query.goal, np.float64))
        try:
            poses, stop = planner.continuation(np.asarray(query.pose, np.float64), HORIZON)
        except PlanningError:
            # A pose the planner cannot leave (pushed into an obstacle's inflated margin): turn in place,
            # which a disc can always do, and replan at the next call.
            out = np.zeros((HORIZON, 4))
            out[:, 2] = self.cfg.max_turn_rad
            return out
        actions = poses_to_actions(poses, stop if self.stop else np.zeros_like(stop))
        if not self.stop:
            # At the goal the expert's poses repeat: without STOP it idles there (turns are zero).
            actions[:, 3] = 0.0
        return actions


class ObjectExpertPolicy(ExpertPolicy):
    """The expert driving to the named object's point nearest to the episode's start (not to the goal point).

    The object is the scene's piece of furniture whose name and room the instruction mentions (instructions name
    objects that are unique by name and room, :func:`verl_omni.sim.collector.make_instructions`).

    Args:
        plans: Scene id -> floor plan.
        goal_object_distance_m: The collector's ``goal_object_distance_m`` (which cells count as next to it).
    """

    name = "object_expert"

    def __init__(
        self,
        plans: Mapping[str, FloorPlan],
        image_size: tuple[int, int] = (64, 64),
        planner: PlannerConfig | None = None,
        goal_object_distance_m: float = 0.7,
    ) -> None:
        super().__init__(plans, stop=True, image_size=image_size, planner=planner)
        self.name = "object_expert"
        self.goal_object_distance_m = goal_object_distance_m
        self._goals: dict[str, np.ndarray] = {}

    def named_object(self, scene_id: str, instruction: str) -> int:
        """Furniture index of the object the instruction names.

        Raises:
            ValueError: no piece, or more than one, matches (the message quotes the instruction).
        """
        plan = self.plans[scene_id]
        hits = [f.index for f in plan.furniture if f.name in instruction and plan.rooms[f.room].kind in instruction]
        longest = max((len(plan.furniture[i].name) for i in hits), default=0)  # "table" inside "blue table"
        hits = [i for i in hits if len(plan.furniture[i].name) == longest]
        if len(hits) != 1:
            raise ValueError(f"object_expert: {len(hits)} objects of scene {scene_id!r} match {instruction!r}")
        return hits[0]

    def act_one(self, query: PolicyQuery) -> np.ndarray:
        from verl_omni.sim.goals import goal_candidates, nearest_goal

        if query.call_index == 0 or query.episode_id not in self._goals:  # the pose of call 0 is the start
            plan = self.plans[query.scene_id]
            cands = goal_candidates(plan, self.named_object(query.scene_id, query.instruction), self.cfg,
                                    self.goal_object_distance_m)  # fmt: skip
            self._goals[query.episode_id] = nearest_goal(plan.occupancy(), cands, np.asarray(query.pose)[:2])[0]
        return super().act_one(dataclasses.replace(query, goal=self._goals[query.episode_id]))


SCRIPTED_POLICIES: tuple[str, ...] = ("expert", "expert_no_stop", "object_expert", "goal_bearing", "straight", "stop")


def make_scripted_policy(
    name: str, plans: Mapping[str, FloorPlan], image_size: tuple[int, int] = (64, 64)
) -> _ScriptedPolicy:
    """Builds a scripted policy by name.

    Raises:
        ValueError: unknown name (the message lists the names).
    """
    makers: dict[str, Callable[[], _ScriptedPolicy]] = {
        "expert": lambda: ExpertPolicy(plans, stop=True, image_size=image_size),
        "expert_no_stop": lambda: ExpertPolicy(plans, stop=False, image_size=image_size),
        "object_expert": lambda: ObjectExpertPolicy(plans, image_size=image_size),
        "goal_bearing": lambda: GoalBearingPolicy(image_size),
        "straight": lambda: StraightPolicy(image_size),
        "stop": lambda: StopPolicy(image_size),
    }
    if name not in makers:
        raise ValueError(f"unknown scripted policy {name!r}; choose one of {list(SCRIPTED_POLICIES)}")
    return makers[name]()
