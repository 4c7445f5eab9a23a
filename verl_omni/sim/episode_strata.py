"""Episode strata: what makes an evaluation episode hard, computed from the scene alone.

A closed-loop success rate mixes episodes that need very different skills. Where the named object is already
in view at the start, a policy only has to ground the instruction and drive; where it is in another room, it
must leave the room through a door before it can see what it was told to find. Splitting the success rate by
these strata says which skill a checkpoint lacks, which a single rate cannot.

Strata of an episode (all from the plan, the start pose and the goal object; nothing from a policy):

- ``same_room``: the start cell lies in the goal object's room.
- ``in_view_at_start``: the object is drawn in the start view (an ideal detector on the renderer's rays).
- ``in_view_after_turn``: it is drawn in at least one of ``turn_steps`` headings of a turn in place.
- ``name_in_other_room``: another room holds a piece of the same colour and kind, so only the instruction's room
  word tells them apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from verl_omni.sim.closed_loop import EpisodeSpec
from verl_omni.sim.eval_metrics import wilson_interval
from verl_omni.sim.floorplan import FloorPlan
from verl_omni.sim.render import CameraConfig
from verl_omni.sim.search_expert import object_bearings

STRATA = ("same_room", "in_view_at_start", "in_view_after_turn", "name_in_other_room")


def goal_furniture_index(plan: FloorPlan, spec: EpisodeSpec) -> int:
    """Index of the episode's named object in ``plan.furniture``.

    Names are unique per room, not per scene (the instruction names the room too), so among pieces of the
    spec's name the one nearest to the episode's goal point is the goal object.

    Raises:
        ValueError: the plan has no piece of that name (the spec belongs to another scene).
    """
    hits = [f.index for f in plan.furniture if f.name == spec.goal_object]
    if not hits:
        raise ValueError(
            f"episode {spec.episode_id}: scene {plan.scene_id!r} has no piece named {spec.goal_object!r}; pass the "
            "scenes the episodes were drawn on"
        )
    occ = plan.occupancy()
    goal = np.asarray(spec.goal, np.float64)[:2]

    def gap(index: int) -> float:
        rows, cols = np.nonzero(plan.furniture_mask(index))
        return float(np.min(np.linalg.norm(occ.grid_to_world(rows, cols) - goal, axis=-1)))

    return min(hits, key=gap)


def episode_strata(
    plan: FloorPlan, spec: EpisodeSpec, camera: CameraConfig | None = None, turn_steps: int = 12
) -> dict[str, bool]:
    """The strata of one episode (see the module docstring).

    Args:
        plan: The episode's scene.
        spec: The episode (start pose ``(x, y, yaw)``, named object).
        camera: The renderer's camera (its field of view decides what is in view); default camera if None.
        turn_steps: Headings of the turn in place, evenly spaced over a full turn, starting at the start yaw.

    Returns:
        ``{stratum: bool}`` for every name in :data:`STRATA`.
    """
    index = goal_furniture_index(plan, spec)
    start = np.asarray(spec.start_pose, np.float64)
    occ = plan.occupancy()
    row, col = occ.world_to_grid(start[None, :2])
    start_room = int(plan.room_id[int(row[0]), int(col[0])])
    yaws = start[2] + np.arange(turn_steps) * (2 * math.pi / turn_steps)
    poses = np.stack([np.full(turn_steps, start[0]), np.full(turn_steps, start[1]), yaws], axis=1)
    seen = np.isfinite(object_bearings(plan, poses, index, camera))
    return {
        "same_room": start_room == plan.furniture[index].room,
        "in_view_at_start": bool(seen[0]),
        "in_view_after_turn": bool(seen.any()),
        "name_in_other_room": any(
            f.name == spec.goal_object and f.room != plan.furniture[index].room for f in plan.furniture
        ),
    }


def stratified_rates(
    episodes: Sequence[Mapping], strata: Mapping[str, Mapping[str, bool]], metric: str = "success"
) -> dict[str, dict[str, dict]]:
    """A binary episode metric split by each stratum.

    Args:
        episodes: Per-episode records of one evaluation (``episode_id`` and ``metric``), as in an evaluation report.
        strata: ``episode_id -> {stratum: bool}`` (:func:`episode_strata`) covering every episode.
        metric: The boolean field to rate (``success``, ``oracle_success``, ``collided``, ...).

    Returns:
        ``{stratum: {"yes"|"no": {"episodes", "count", "mean", "low", "high"}}}`` with 95% Wilson intervals; a side
        with no episodes has ``mean``/``low``/``high`` None.

    Raises:
        KeyError: an episode has no strata (the message names it).
    """
    out: dict[str, dict[str, dict]] = {}
    names = sorted({k for s in strata.values() for k in s})
    for name in names:
        sides: dict[str, dict] = {}
        for side, want in (("yes", True), ("no", False)):
            picked = []
            for e in episodes:
                if e["episode_id"] not in strata:
                    raise KeyError(
                        f"episode {e['episode_id']!r} has no strata; were the episodes drawn on these scenes?"
                    )
                if bool(strata[e["episode_id"]][name]) == want:
                    picked.append(bool(e[metric]))
            n, k = len(picked), int(sum(picked))
            low, high = wilson_interval(k, n) if n else (None, None)
            sides[side] = {"episodes": n, "count": k, "mean": k / n if n else None, "low": low, "high": high}
        out[name] = sides
    return out
