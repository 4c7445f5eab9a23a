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

Beside the reward, :func:`window_metrics` reads each scored 32-step window as a short episode and gives the
evaluator's own metrics of it (``verl_omni.sim.eval_metrics``: SR, OSR, SPL, premature STOP, collision, path
length), so that a table shows what each behaviour would be credited with by the judge the reward anticipates.

:func:`short_stop_preference` asks the per-layer question the layer-conditioned advantages ask: on the layer that
credits a chunk's motion (``nav_1``), does a rollout that STOPs early in the chunk score above its sibling that
drives on? (It should not merely for having been scored on fewer steps; see the navigation option
``charge_stop_chunk``.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_omni.data.actions import ACTION_LAYOUT, poses_to_actions
from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.sim.eval_metrics import spl
from verl_omni.utils.reward_score.registry import RewardSet
from verl_omni.utils.reward_score.trajectory import RolloutGeometry, compute_geometry
from verl_omni.utils.reward_score.types import RewardBatch

POLICIES: tuple[str, ...] = ("expert", "noisy_imitator", "stand_still", "stop_at_once")
# The evaluator's episode metrics of a scored window (window_metrics), in table order.
WINDOW_METRICS: tuple[str, ...] = ("SR", "OSR", "SPL", "premature_stop", "collided", "path_length")


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


def window_metrics(geometry: RolloutGeometry, success_radius: np.ndarray) -> dict[str, np.ndarray]:
    """The evaluator's episode metrics of each scored window, read as an episode from the query pose to ``E``.

    As in ``verl_omni.sim.eval_metrics``, with the window's end step ``E`` (STOP or first hard collision) as the
    episode's end: ``SR`` a STOP within the success radius (geodesic); ``OSR`` some scored pose, the start
    included, within it; ``SPL`` ``SR * l / max(p, l)`` with ``l`` the geodesic distance at the query pose and
    ``p`` the ``path_length``, the metres translated over the active steps; ``premature_stop`` a STOP outside the
    radius; ``collided`` a hard collision.

    Args:
        geometry: The batch's scored trajectories.
        success_radius: ``[N]`` metres.

    Returns:
        ``{name: float64 [N]}`` for every name in :data:`WINDOW_METRICS` (0/1 for the proportions); NaN for
        invalid rollouts, and SPL is NaN where the window starts in the goal's cell (``l = 0``: no path to weigh).
    """
    success = geometry.succeeded(success_radius)
    step = np.diff(geometry.scored_poses[:, :, :2], axis=1)  # [N, 32, 2]; 0 after E, where the poses freeze
    path = np.where(geometry.active, np.hypot(step[..., 0], step[..., 1]), 0.0).sum(axis=1)
    start = geometry.geodesic[:, 0]
    weighted = [spl(bool(s), float(g), float(p)) if g > 0 else np.nan for s, g, p in zip(success, start, path)]
    metrics = {
        "SR": success,
        "OSR": (geometry.geodesic <= np.asarray(success_radius)[:, None]).any(axis=1),
        "SPL": np.array(weighted, dtype=np.float64),
        "premature_stop": geometry.stopped & ~success,
        "collided": geometry.collided,
        "path_length": path,
    }
    return {k: np.where(geometry.valid, np.asarray(v, dtype=np.float64), np.nan) for k, v in metrics.items()}


def query_batch(states: QueryStates, actions: np.ndarray) -> RewardBatch:
    """The reward batch of ``actions [Q, 32, 4]`` taken from every query state (no video)."""
    return RewardBatch(
        actions=actions,
        start_pose=states.reference_poses[:, 0],
        reference_poses=states.reference_poses,
        goal=states.goal,
        success_radius=states.success_radius,
        events=states.events,
        scene_id=states.scene_id,
        rollout_id=states.query_id,
    )


def score_policy(reward_set: RewardSet, states: QueryStates, actions: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer scores ``{layer: float32 [Q]}`` of ``actions`` at every query state (no video: visual = 0)."""
    out = reward_set.score(query_batch(states, actions))
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
    """Mean reward per layer and of the summed layers, and the mean window metrics, for each policy.

    Returns:
        ``{policy: {layer: mean, ..., "total": mean summed reward, metric: mean over the valid windows, ...}}``
        with the metrics of :data:`WINDOW_METRICS`.
    """
    table: dict[str, dict[str, float]] = {}
    for name in policies:
        actions = policy_actions(states, name, heading_noise_rad, seed)
        scores = score_policy(reward_set, states, actions)
        row = {layer: float(np.mean(scores[layer])) for layer in LAYER_NAMES}
        row["total"] = float(np.mean(np.sum([scores[layer] for layer in LAYER_NAMES], axis=0, dtype=np.float64)))
        geometry = compute_geometry(query_batch(states, actions), reward_set.scene_cache, reward_set.geometry_config)
        for metric, values in window_metrics(geometry, states.success_radius).items():
            row[metric] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        table[name] = row
    return table


def format_table(table: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown table: policies as rows, the summed reward then every layer as columns."""
    cols = ["total", *LAYER_NAMES]
    lines = ["| policy | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:+.3f}" for c in cols) + " |")
    return "\n".join(lines)


def format_metrics_table(table: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown table: policies as rows, the summed reward then the evaluator's window metrics as columns."""
    cols = ["total", *WINDOW_METRICS]
    lines = ["| policy | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name, row in table.items():
        lines.append(f"| {name} | {row['total']:+.3f} | " + " | ".join(f"{row[c]:.3f}" for c in WINDOW_METRICS) + " |")
    return "\n".join(lines)


def short_stop_preference(
    reward_set: RewardSet,
    states: QueryStates,
    stop_step: int,
    heading_noise_rad: float = 0.25,
    seed: int = 0,
    drive_steps: int = 12,
) -> dict[str, float]:
    """How often ``nav_1`` prefers the noisy imitator STOPping at ``stop_step`` to the same imitator driving on.

    The STOP-er is the imitator's actions with the motion zeroed and the stop flag set from ``stop_step`` on (what
    the SFT data pads a plan with after its STOP). Only states whose expert drives on for at least
    ``drive_steps`` steps count, so that every such STOP is premature.

    Returns:
        ``{"states": n, "fraction": share of them where the STOP-er's nav_1 is higher, "mean_gap": mean
        nav_1(STOP-er) - nav_1(driver)}``.
    """
    if not 0 < stop_step < ACTION_LAYOUT.steps_per_chunk:
        raise ValueError(
            f"stop_step must be inside the first chunk (1..{ACTION_LAYOUT.steps_per_chunk - 1}), got {stop_step}"
        )
    keep = states.reference_stop[:, :drive_steps].sum(axis=1) == 0
    drive = policy_actions(states, "noisy_imitator", heading_noise_rad, seed)
    short = drive.copy()
    short[:, stop_step:, :3] = 0.0
    short[:, stop_step:, 3] = 1.0
    gap = (score_policy(reward_set, states, short)["nav_1"] - score_policy(reward_set, states, drive)["nav_1"])[keep]
    n = int(keep.sum())
    return {
        "states": float(n),
        "fraction": float(np.mean(gap > 1e-9)) if n else float("nan"),
        "mean_gap": float(np.mean(gap)) if n else float("nan"),
    }


# Bands of the query state's geodesic distance beyond the success radius (metres) for order_by_distance: a STOP
# there is premature. "Just short" is where Stage III's extra failures were (docs/results.md, session 17).
PREMATURE_BANDS: tuple[tuple[float, float], ...] = ((0.0, 0.5), (0.5, 1.5), (1.5, float("inf")))


def order_by_distance(
    reward_set: RewardSet,
    states: QueryStates,
    heading_noise_rad: float = 0.25,
    seed: int = 0,
    bands: Sequence[tuple[float, float]] = PREMATURE_BANDS,
    drive_steps: int = 2,
) -> list[dict[str, float]]:
    """Does the summed reward keep the evaluator's order where a STOP is premature, band by distance to the goal?

    The mean over all states can hide a band: near the goal, a premature STOP forfeits little progress, and its
    distance-scaled penalty is small, while standing still is charged the STOP it misses. The evaluator ranks
    them the other way in every band (a STOP ends the episode in failure; standing still leaves it open).

    Only states whose expert drives on for at least ``drive_steps`` steps and that lie outside the success
    radius count (there, STOP at once is premature).

    Returns:
        One row per band: ``{"lo", "hi", "states", "<policy>": mean summed reward for each of :data:`POLICIES`,
        "stop_over_stand_still", "stop_over_noisy_imitator": share of states where STOP at once has the higher
        summed reward, "stop_1_over_stand_still": the same on the layer the STOP is credited to}``.
    """
    totals, stop_1 = {}, {}
    for name in POLICIES:
        actions = policy_actions(states, name, heading_noise_rad, seed)
        scores = score_policy(reward_set, states, actions)
        totals[name] = np.sum([scores[layer] for layer in LAYER_NAMES], axis=0, dtype=np.float64)
        stop_1[name] = np.asarray(scores["stop_1"], np.float64)
    expert = policy_actions(states, "expert")
    geometry = compute_geometry(query_batch(states, expert), reward_set.scene_cache, reward_set.geometry_config)
    beyond = geometry.geodesic[:, 0] - states.success_radius
    drives = states.reference_stop[:, :drive_steps].sum(axis=1) == 0
    rows = []
    for lo, hi in bands:
        keep = drives & (beyond > lo) & (beyond <= hi)
        row: dict[str, float] = {"lo": lo, "hi": hi, "states": float(keep.sum())}
        for name in POLICIES:
            row[name] = float(np.mean(totals[name][keep])) if keep.any() else float("nan")
        for other in ("stand_still", "noisy_imitator"):
            wins = totals["stop_at_once"][keep] > totals[other][keep]
            row[f"stop_over_{other}"] = float(np.mean(wins)) if keep.any() else float("nan")
        wins = stop_1["stop_at_once"][keep] > stop_1["stand_still"][keep]
        row["stop_1_over_stand_still"] = float(np.mean(wins)) if keep.any() else float("nan")
        rows.append(row)
    return rows


def format_order_by_distance(rows: Sequence[Mapping[str, float]]) -> str:
    """Markdown table of :func:`order_by_distance`."""
    head = "| distance beyond radius | states | " + " | ".join(POLICIES)
    head += " | STOP over stand still | STOP over imitator | stop_1: STOP over stand still |"
    lines = [head, "| --- |" + " --- |" * (len(POLICIES) + 4)]
    for r in rows:
        band = f"{r['lo']:g}..{r['hi']:g} m" if np.isfinite(r["hi"]) else f"> {r['lo']:g} m"
        cells = [f"{r[p]:+.2f}" for p in POLICIES]
        shares = [
            f"{r[k]:.0%}" for k in ("stop_over_stand_still", "stop_over_noisy_imitator", "stop_1_over_stand_still")
        ]
        lines.append(f"| {band} | {int(r['states'])} | " + " | ".join(cells + shares) + " |")
    return "\n".join(lines)


def short_stop_against_missed(
    reward_set: RewardSet,
    states: QueryStates,
    early_steps: int = 2,
    bands: Sequence[tuple[float, float]] = PREMATURE_BANDS,
) -> list[dict[str, float]]:
    """Where the expert STOPs inside the window: does STOPping a few steps short score below not STOPping at all?

    The evaluator ranks them that way: a STOP outside the success radius ends the episode in failure, while a STOP
    that has not come yet can still come at the next call. In the reward, no STOP is charged the missed-STOP
    penalty and a STOP just short only its distance-scaled premature penalty, so a policy trained on it can learn
    to trade missed STOPs for near misses (``docs/results.md``, issue 18, session 25).

    Three rollouts from each query state whose expert STOPs at step ``s >= early_steps``, inside the radius:

    * ``expert``: the recorded reference (STOP at ``s``);
    * ``short``: the expert's steps up to ``s - early_steps``, then STOP (motion zeroed and the stop flag set from
      there on, as the SFT data pads a plan after its STOP);
    * ``no_stop``: the expert's motion with every stop flag cleared (it reaches the goal and never STOPs).

    Only states whose ``short`` STOP lies outside the success radius count, grouped by its geodesic distance beyond
    the radius.

    Returns:
        One row per band: ``{"lo", "hi", "states", "expert", "short", "no_stop": mean summed reward,
        "short_over_no_stop": share of states where ``short`` has the higher summed reward,
        "short_over_no_stop_stop_layers": the same over the summed ``stop_*`` layers}``.
    """
    if early_steps < 1:
        raise ValueError(f"early_steps must be >= 1, got {early_steps}")
    expert = policy_actions(states, "expert")
    has_stop = states.reference_stop.any(axis=1)
    s = np.where(has_stop, states.reference_stop.argmax(axis=1), -1)
    short = expert.copy()
    at = np.clip(s - early_steps, 0, None)
    steps = np.arange(ACTION_LAYOUT.steps)[None, :]
    after = steps >= at[:, None]
    short[..., :3] = np.where(after[..., None], 0.0, short[..., :3])
    short[..., 3] = np.where(after, 1.0, 0.0)
    no_stop = expert.copy()
    no_stop[..., 3] = 0.0
    stop_layers = [layer for layer in LAYER_NAMES if layer.startswith("stop_")]
    totals, stop_sums = {}, {}
    for name, actions in (("expert", expert), ("short", short), ("no_stop", no_stop)):
        scores = score_policy(reward_set, states, actions)
        totals[name] = np.sum([scores[layer] for layer in LAYER_NAMES], axis=0, dtype=np.float64)
        stop_sums[name] = np.sum([scores[layer] for layer in stop_layers], axis=0, dtype=np.float64)
    geo_expert = compute_geometry(query_batch(states, expert), reward_set.scene_cache, reward_set.geometry_config)
    geo_short = compute_geometry(query_batch(states, short), reward_set.scene_cache, reward_set.geometry_config)
    beyond = geo_short.stop_geodesic() - states.success_radius
    keep = (s >= early_steps) & geo_expert.succeeded(states.success_radius) & geo_short.stopped & (beyond > 0)
    rows = []
    for lo, hi in bands:
        band = keep & (beyond > lo) & (beyond <= hi)
        n = int(band.sum())
        row: dict[str, float] = {"lo": lo, "hi": hi, "states": float(n)}
        for name in totals:
            row[name] = float(np.mean(totals[name][band])) if n else float("nan")
        row["short_over_no_stop"] = float(np.mean(totals["short"][band] > totals["no_stop"][band])) if n else np.nan
        row["short_over_no_stop_stop_layers"] = (
            float(np.mean(stop_sums["short"][band] > stop_sums["no_stop"][band])) if n else float("nan")
        )
        rows.append(row)
    return rows


def format_short_stop_against_missed(rows: Sequence[Mapping[str, float]]) -> str:
    """Markdown table of :func:`short_stop_against_missed`."""
    lines = [
        "| short STOP beyond radius | states | expert | short | no_stop | short over no_stop | on the stop layers |",
        "| --- |" + " --- |" * 6,
    ]
    for r in rows:
        band = f"{r['lo']:g}..{r['hi']:g} m" if np.isfinite(r["hi"]) else f"> {r['lo']:g} m"
        cells = [f"{r[k]:+.2f}" for k in ("expert", "short", "no_stop")]
        shares = [f"{r[k]:.0%}" for k in ("short_over_no_stop", "short_over_no_stop_stop_layers")]
        lines.append(f"| {band} | {int(r['states'])} | " + " | ".join(cells + shares) + " |")
    return "\n".join(lines)
