"""Command-line options of the task and of the expert that labels a collection, shared by the synthesis, DAgger,
Stage-II and evaluation commands (one definition, so that the flags, defaults and help agree everywhere)."""

from __future__ import annotations

import argparse

from verl_omni.sim.goals import GOAL_POINTS
from verl_omni.sim.search_expert import LABEL_EXPERTS


def add_goal_point_argument(p: argparse.ArgumentParser) -> None:
    """Adds ``--goal-point`` (:attr:`~verl_omni.sim.collector.CollectorConfig.goal_point`)."""
    p.add_argument(
        "--goal-point",
        choices=list(GOAL_POINTS),
        default="random",
        help="which point next to the named object is the goal: random = any free cell within 0.7 m of it (hidden "
        "from a policy that is told only the object); nearest = the one nearest to the start (default random)",
    )


def add_label_arguments(p: argparse.ArgumentParser) -> None:
    """Adds ``--label-expert``, ``--face-goal-object`` and ``--goal-point`` (``CollectorConfig`` fields)."""
    add_goal_point_argument(p)
    p.add_argument(
        "--label-expert",
        choices=list(LABEL_EXPERTS),
        default="map",
        help="who labels the query states: map = the planner from the first step; search = turn in place until the "
        "named object has been seen in the history window, then plan (default map)",
    )
    p.add_argument(
        "--face-goal-object",
        action="store_true",
        help="the expert turns toward the named object at the goal before its STOP (CollectorConfig.face_goal_object)",
    )


def label_fields(args: argparse.Namespace) -> dict:
    """The :class:`~verl_omni.sim.collector.CollectorConfig` fields of parsed :func:`add_label_arguments` options."""
    return {"label_expert": args.label_expert, "face_goal_object": args.face_goal_object, "goal_point": args.goal_point}


def label_flags(label_expert: str, face_goal_object: bool, goal_point: str = "random") -> list[str]:
    """The same options as command-line arguments (for a child process)."""
    flags = ["--label-expert", label_expert, "--goal-point", goal_point]
    return flags + (["--face-goal-object"] if face_goal_object else [])
