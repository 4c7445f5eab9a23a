"""Command-line options of the expert that labels a collection, shared by the synthesis, DAgger and Stage-II
commands (one definition, so that the flags, defaults and help agree everywhere)."""

from __future__ import annotations

import argparse

from verl_omni.sim.search_expert import LABEL_EXPERTS


def add_label_arguments(p: argparse.ArgumentParser) -> None:
    """Adds ``--label-expert`` and ``--face-goal-object`` (:class:`~verl_omni.sim.collector.CollectorConfig` fields)."""
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
    return {"label_expert": args.label_expert, "face_goal_object": args.face_goal_object}


def label_flags(label_expert: str, face_goal_object: bool) -> list[str]:
    """The same options as command-line arguments (for a child process)."""
    return ["--label-expert", label_expert] + (["--face-goal-object"] if face_goal_object else [])
