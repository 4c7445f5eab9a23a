"""Scripted policies scored on recorded query states: does the reward rank behaviour like the evaluator?

The closed-loop evaluator (``verl_omni.sim.closed_loop``) prefers, in this order: following the expert;
imitating it imperfectly (it still makes progress and may still arrive); standing still (no progress, but
the episode goes on and the policy may still move later); stopping at once (the episode is over and failed).
:func:`rank_policies` scores those four behaviours on the query states of a GN0 collection with a real reward
set, so that tests and ``scripts/reward_ranking.py`` can check that the mean summed reward orders them the
same way.

Policies (``POLICIES``), each ``[32, 4]`` actions ``(dx, dy, dyaw, stop)`` from the query pose:

* ``expert``: the recorded reference, ``poses_to_actions(reference_poses, reference_stop)``;
* ``noisy_imitator``: the expert's steps with i.i.d. Gaussian noise of ``heading_noise_rad`` (0.25 rad) added to
  every ``dyaw`` (so the heading error accumulates like a policy that imitates the turns badly); the
  expert's STOP flags are kept;
* ``stand_still``: zero motion, never STOP;
* ``stop_at_once``: STOP on the first step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_omni.data.actions import ACTION_LAYOUT, poses_to_actions
from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.utils.reward_score.registry import RewardSet
from verl_omni.utils.reward_score.types import RewardBatch

POLICIES: tuple[str, ...] = ("expert", "noisy_imitator", "stand_still", "stop_at_once")


@dataclass
class QueryStates:
    """Recorded query states of a collection, one row per (episode, query).

    Attributes:
        reference_poses: ``[Q, 33, 3]``.
        reference_stop: ``[Q, 32]`` expert stop flags.
        goal: ``[Q, 2]``.
        success_radius: ``[Q]``.
        events: Per query, its event names.
        scene_id: Per query, its scene.
        query_id: Per query, ``<episode_id>/t<t>``.
    """

    reference_poses: np.ndarray
    reference_stop: np.ndarray
    goal: np.ndarray
    success_radius: np.ndarray
    events: list[list[str]]
    scene_id: list[str]
    query_id: list[str]

    @property
    def size(self) -> int:
        return self.reference_poses.shape[0]


def load_query_states(collection_dir: str | Path) -> QueryStates:
    """Reads every query state of a GN0 collection (``docs/contracts.md``), episodes in sorted order."""
    root = Path(collection_dir)
    episode_files = sorted((root / "episodes").glob("*/episode.json"))
    if not episode_files:
        raise FileNotFoundError(f"{root}: no episodes/*/episode.json (not a GN0 collection)")
    ref, stop, goal, radius, events, scenes, ids = [], [], [], [], [], [], []
    for path in episode_files:
        rec = json.loads(path.read_text())
        for q in rec["queries"]:
            ref.append(q["reference_poses"])
            stop.append(q["reference_stop"])
            goal.append(rec["goal"])
            radius.append(rec["success_radius"])
            events.append(list(q["events"]))
            scenes.append(rec["scene_id"])
            ids.append(f"{rec['episode_id']}/t{q['t']}")
    return QueryStates(
        reference_poses=np.asarray(ref, np.float64),
        reference_stop=np.asarray(stop, np.float64),
        goal=np.asarray(goal, np.float64),
        success_radius=np.asarray(radius, np.float64),
        events=events,
        scene_id=scenes,
        query_id=ids,
    )


def policy_actions(states: QueryStates, policy: str, heading_noise_rad: float = 0.25, seed: int = 0) -> np.ndarray:
    """``[Q, 32, 4]`` actions of one scripted policy (see the module docstring) at every query state."""
    steps = ACTION_LAYOUT.steps
    expert = poses_to_actions(states.reference_poses, states.reference_stop)
    if policy == "expert":
        return expert
    if policy == "noisy_imitator":
        noisy = expert.copy()
        noisy[..., 2] += np.random.default_rng(seed).normal(0.0, heading_noise_rad, size=(states.size, steps))
        return noisy
    out = np.zeros((states.size, steps, 4))
    if policy == "stand_still":
        return out
    if policy == "stop_at_once":
        out[:, :, 3] = 1.0
        return out
    raise ValueError(f"unknown policy {policy!r}; known: {POLICIES}")


def score_policy(reward_set: RewardSet, states: QueryStates, actions: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer scores ``{layer: float32 [Q]}`` of ``actions`` at every query state (no video: visual = 0)."""
    batch = RewardBatch(
        actions=actions,
        start_pose=states.reference_poses[:, 0],
        reference_poses=states.reference_poses,
        goal=states.goal,
        success_radius=states.success_radius,
        events=states.events,
        scene_id=states.scene_id,
        rollout_id=states.query_id,
    )
    out = reward_set.score(batch)
    scores = dict(out.scores)
    if "geometry/layer_valid" in out.diagnostics:
        scores["layer_valid"] = out.diagnostics["geometry/layer_valid"]
    return scores


def rank_policies(
    reward_set: RewardSet,
    states: QueryStates,
    policies: Sequence[str] = POLICIES,
    heading_noise_rad: float = 0.25,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Mean reward per layer and of the summed layers for each policy.

    Returns:
        ``{policy: {layer: mean, ..., "total": mean summed reward}}``.
    """
    table: dict[str, dict[str, float]] = {}
    for name in policies:
        scores = score_policy(reward_set, states, policy_actions(states, name, heading_noise_rad, seed))
        row = {layer: float(np.mean(scores[layer])) for layer in LAYER_NAMES}
        row["total"] = float(np.mean(np.sum([scores[layer] for layer in LAYER_NAMES], axis=0, dtype=np.float64)))
        table[name] = row
    return table


def format_table(table: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown table: policies as rows, the summed reward then every layer as columns."""
    cols = ["total", *LAYER_NAMES]
    lines = ["| policy | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:+.3f}" for c in cols) + " |")
    return "\n".join(lines)
