"""Where along the expert's path does a checkpoint ask to STOP? A paired, state-matched STOP probe.

Closed-loop numbers mix two things: which states a policy reaches, and what it does there. After Stage III, the
premature STOPs just short of the goal grew (``docs/results.md``), and two explanations fit: the policy's own
stop channel fires farther from the goal, or the STOP gate (a view head reading the DiT's features, which Stage
III changes) lets more of those STOPs through. This probe separates them by asking every checkpoint the same
questions in the same states: the map expert drives each episode (:class:`ShadowPolicy`), and at every call each
checkpoint is shown the same history and instruction, with the same initial noise (the noise is keyed by
episode, seed and call index, see :class:`~verl_omni.sim.wnm_policy.WNMPolicy`). Its answer never moves the
robot. Per call it records:

* ``asked``: the checkpoint's chosen chunk STOPs within the steps a call executes (the raw stop channel, before
  the gate);
* with a gate, what the gate saw (``gate_distance_m``, ``gate_visible_logit``) and whether it would let a STOP
  through (``gate_allows``); ``ends_here`` = asked and allowed, i.e. the episode would end at this state;
* the state's true geodesic distance to the goal (the evaluator's distance) and whether the expert STOPs there;
* what the chosen chunk's executed steps would do from that pose, run through the evaluator's own stepping
  (:func:`~verl_omni.sim.closed_loop.execute_actions`, same robot radius, up to a STOP): whether a step would be
  blocked by a wall (``collides``), the metres it would travel (``moved_m``) and the geodesic progress it would
  make (``progress_m``), beside the expert's own progress from the same state (``expert_progress_m``). Closed-loop
  collisions can grow because a policy reaches harder states or because its actions hit walls more often from the
  same states; these fields measure the second.

:func:`summarise` groups calls by that distance (bands of :data:`DISTANCE_BANDS`, metres beyond the success
radius) and gives each checkpoint's rates with Wilson intervals, and the paired difference of two checkpoints
with a percentile interval from resampling *episodes* (calls of one episode are not independent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from verl_omni.sim.closed_loop import ROBOT_RADIUS_M, PolicyQuery, execute_actions
from verl_omni.sim.eval_metrics import wilson_interval

# Bands of (true geodesic distance - success radius), metres: at the goal, just short, near, far.
DISTANCE_BANDS: tuple[tuple[float, float], ...] = ((-np.inf, 0.0), (0.0, 0.5), (0.5, 1.5), (1.5, np.inf))
RATES: tuple[str, ...] = ("asked", "gate_allows", "ends_here", "collides")
# Per-call amounts (metres) averaged per band and compared in pairs like the rates.
AMOUNTS: tuple[str, ...] = ("moved_m", "progress_m")


def band_label(lo: float, hi: float) -> str:
    """``"<= rho"``, ``"rho+0.0..0.5 m"``, ``"> rho+1.5 m"`` style labels of a band of distance beyond the radius."""
    if not np.isfinite(lo):
        return f"<= rho+{hi:g} m" if hi else "<= rho (at the goal)"
    if not np.isfinite(hi):
        return f"> rho+{lo:g} m"
    return f"rho+{lo:g}..{hi:g} m"


@dataclass
class ProbeCall:
    """One shadow answer: a checkpoint's view of one state the expert reached.

    Attributes:
        checkpoint: Label of the shadow checkpoint.
        episode_id: Episode.
        call: 0-based call index within the episode.
        geodesic_m: True geodesic distance from the state to the goal (metres).
        success_radius: The episode's success radius (metres).
        expert_stops: The expert STOPs within this call's executed steps.
        asked: The checkpoint's chosen chunk STOPs within the executed steps (before any gate).
        gate_allows: The gate would let a STOP through here (None without a gate).
        gate_distance_m: The gate's predicted distance to the named object (None without a gate).
        gate_visible_logit: The gate's visibility logit (None without a gate).
        collides: A step of the chosen chunk's executed steps would be blocked by a wall (None: not simulated).
        moved_m: Metres those steps would travel (None: not simulated).
        progress_m: Geodesic distance to the goal now minus after those steps (None: not simulated).
        expert_progress_m: The same for the expert's executed steps from this state (None: not simulated).
    """

    checkpoint: str
    episode_id: str
    call: int
    geodesic_m: float
    success_radius: float
    expert_stops: bool
    asked: bool
    gate_allows: bool | None = None
    gate_distance_m: float | None = None
    gate_visible_logit: float | None = None
    collides: bool | None = None
    moved_m: float | None = None
    progress_m: float | None = None
    expert_progress_m: float | None = None

    @property
    def ends_here(self) -> bool:
        """The episode would end here: a STOP asked and (with a gate) let through."""
        return self.asked and self.gate_allows is not False

    def to_dict(self) -> dict:
        return {**asdict(self), "ends_here": self.ends_here}


class ShadowPolicy:
    """Drives with ``driver``; asks every shadow policy the same question and keeps their answers.

    Args:
        driver: The policy whose actions are executed (the map expert).
        shadows: Label -> WNM policy; their answers are recorded, never executed.
        occupancy: Scene id -> occupancy map (for the true geodesic distance of each state).
        success_radius: Episode id -> success radius.
        execute_steps: Steps a call executes (the window in which a STOP counts as asked).
        robot_radius: Disc footprint radius (metres) of the simulated steps; the evaluator's by default.
    """

    def __init__(
        self,
        driver,
        shadows: Mapping,
        occupancy: Mapping,
        success_radius: Mapping,
        execute_steps: int,
        robot_radius: float = ROBOT_RADIUS_M,
    ):
        if not shadows:
            raise ValueError("ShadowPolicy: no shadow policies to probe")
        sizes = {tuple(p.image_size) for p in shadows.values()} | {tuple(driver.image_size)}
        if len(sizes) != 1:
            raise ValueError(f"ShadowPolicy: the driver and the shadows expect different image sizes {sorted(sizes)}")
        self.driver = driver
        self.shadows = dict(shadows)
        self.occupancy = occupancy
        self.success_radius = success_radius
        self.execute_steps = int(execute_steps)
        self.robot_radius = float(robot_radius)
        self.image_size = tuple(driver.image_size)
        self.history_frames = max(int(p.history_frames) for p in [driver, *self.shadows.values()])
        self.calls: list[ProbeCall] = []

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """The driver's actions for ``uint8 [B, T, H, W, 3]`` histories; records each shadow's answer."""
        actions = np.asarray(self.driver.act(history[:, -int(self.driver.history_frames) :], queries), np.float64)
        expert_stops = (actions[:, : self.execute_steps, 3] > 0.5).any(axis=1)
        geodesic = [self._geodesic(q, np.asarray(q.pose)[:2]) for q in queries]
        expert_motion = [self._motion(q, actions[i], geodesic[i]) for i, q in enumerate(queries)]
        for label, shadow in self.shadows.items():
            shadow.act(history[:, -int(shadow.history_frames) :], queries)
            asked = self._asked(shadow, len(queries))
            chosen = np.asarray(shadow.last_chosen(), np.float64)
            view = shadow.last_gate_view() if getattr(shadow, "stop_gate", None) is not None else None
            for i, q in enumerate(queries):
                seen = view[i] if view is not None else {}
                collides, moved, progress = self._motion(q, chosen[i], geodesic[i])
                self.calls.append(
                    ProbeCall(
                        checkpoint=label,
                        episode_id=q.episode_id,
                        call=q.call_index,
                        geodesic_m=geodesic[i],
                        success_radius=float(self.success_radius[q.episode_id]),
                        expert_stops=bool(expert_stops[i]),
                        asked=bool(asked[i]),
                        gate_allows=seen.get("stop_allowed"),
                        gate_distance_m=seen.get("gate_distance_m"),
                        gate_visible_logit=seen.get("gate_visible_logit"),
                        collides=collides,
                        moved_m=moved,
                        progress_m=progress,
                        expert_progress_m=expert_motion[i][2],
                    )
                )
        return actions

    def _geodesic(self, query: PolicyQuery, xy: np.ndarray) -> float:
        """True geodesic distance (metres) from ``xy`` to the query's goal in its scene."""
        occupancy = self.occupancy[query.scene_id]
        return float(occupancy.geodesic_at(np.asarray(query.goal), np.asarray(xy, np.float64)[None, :2])[0])

    def _motion(self, query: PolicyQuery, chunk: np.ndarray, geodesic_now: float) -> tuple[bool, float, float]:
        """``(collides, moved_m, progress_m)`` of ``chunk``'s executed steps from the query's pose.

        Stepped by the evaluator's :func:`~verl_omni.sim.closed_loop.execute_actions` (walls refuse a translation
        and keep the rotation; a STOP ends the steps), so a blocked step here is a collision there.
        """
        outcome = execute_actions(
            self.occupancy[query.scene_id], np.asarray(query.pose), chunk[: self.execute_steps], self.robot_radius
        )
        end = outcome.poses[-1, :2] if len(outcome.poses) else np.asarray(query.pose)[:2]
        return outcome.collisions > 0, float(outcome.path_length), geodesic_now - self._geodesic(query, end)

    def _asked(self, shadow, n: int) -> np.ndarray:
        """``bool [n]``: the shadow's chosen chunk (before the gate) STOPs within the executed steps."""
        chosen = shadow.last_chosen()
        if chosen is None or len(chosen) != n:
            raise RuntimeError("ShadowPolicy: the shadow policy kept no chosen chunk for its last call")
        return (np.asarray(chosen)[:, : self.execute_steps, 3] > 0.5).any(axis=1)


def rate_interval(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of a rate (:func:`~verl_omni.sim.eval_metrics.wilson_interval`); NaNs for ``n = 0``."""
    if n == 0:
        return float("nan"), float("nan")
    return wilson_interval(successes, n)


def _band_of(call: ProbeCall) -> int | None:
    beyond = call.geodesic_m - call.success_radius
    for k, (lo, hi) in enumerate(DISTANCE_BANDS):
        if lo < beyond <= hi:
            return k
    return None


def paired_episode_bootstrap(
    a: np.ndarray, b: np.ndarray, episodes: np.ndarray, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired calls and a 95% percentile interval from resampling whole episodes.

    Hand-written rather than ``scipy.stats.bootstrap`` because the unit resampled is the episode (a cluster of
    calls), which that function does not offer.

    Args:
        a, b: ``[n]`` 0/1 outcomes of the same calls under two checkpoints.
        episodes: ``[n]`` episode id of each call.
        resamples: Bootstrap resamples.
        seed: Generator seed.

    Returns:
        ``(difference, lo, hi)``; NaNs when there are no calls.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return float("nan"), float("nan"), float("nan")
    ids, inverse = np.unique(np.asarray(episodes), return_inverse=True)
    diff_sum = np.bincount(inverse, weights=a - b, minlength=len(ids))
    count = np.bincount(inverse, minlength=len(ids)).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ids), size=(resamples, len(ids)))
    stats = diff_sum[draws].sum(axis=1) / count[draws].sum(axis=1)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(diff_sum.sum() / count.sum()), float(lo), float(hi)


def summarise(calls: Sequence[ProbeCall], pair: tuple[str, str] | None = None) -> dict:
    """Rates per checkpoint and distance band, and the paired difference of ``pair = (a, b)`` (a - b).

    Returns:
        ``{"bands": [label, ...], "checkpoints": {label: [{"calls", "expert_stops", rate: share, rate + "_ci":
        [lo, hi], "gate_distance_m_mean", "geodesic_m_mean"} per band]}, "paired": {rate: [{"difference", "lo",
        "hi", "calls"} per band]} or None}``. Gate rates are NaN for a checkpoint without a gate.
    """
    labels = list(dict.fromkeys(c.checkpoint for c in calls))
    out: dict = {"bands": [band_label(lo, hi) for lo, hi in DISTANCE_BANDS], "checkpoints": {}, "paired": None}
    for label in labels:
        rows = []
        mine = [c for c in calls if c.checkpoint == label]
        for k in range(len(DISTANCE_BANDS)):
            band = [c for c in mine if _band_of(c) == k]
            row: dict = {
                "calls": len(band),
                "expert_stops": float(np.mean([c.expert_stops for c in band]) if band else np.nan),
            }
            for rate in RATES:
                values = [getattr(c, rate) for c in band if getattr(c, rate) is not None]
                hits = int(np.sum(values)) if values else 0
                row[rate] = hits / len(values) if values else float("nan")
                row[f"{rate}_ci"] = list(rate_interval(hits, len(values)))
            for amount in (*AMOUNTS, "expert_progress_m"):
                values = [getattr(c, amount) for c in band if getattr(c, amount) is not None]
                row[amount] = float(np.mean(values)) if values else float("nan")
            gate_m = [c.gate_distance_m for c in band if c.gate_distance_m is not None]
            row["gate_distance_m_mean"] = float(np.mean(gate_m)) if gate_m else float("nan")
            row["geodesic_m_mean"] = float(np.mean([c.geodesic_m for c in band])) if band else float("nan")
            rows.append(row)
        out["checkpoints"][label] = rows
    if pair is not None:
        first, second = pair
        by_key = {(c.checkpoint, c.episode_id, c.call): c for c in calls}
        keys = [
            (c.episode_id, c.call) for c in calls if c.checkpoint == first and (second, c.episode_id, c.call) in by_key
        ]
        paired: dict = {}
        for rate in (*RATES, *AMOUNTS):
            rows = []
            for k in range(len(DISTANCE_BANDS)):
                mine = [
                    key
                    for key in keys
                    if _band_of(by_key[(first, *key)]) == k
                    and getattr(by_key[(first, *key)], rate) is not None
                    and getattr(by_key[(second, *key)], rate) is not None
                ]
                a = np.array([float(getattr(by_key[(first, *key)], rate)) for key in mine], dtype=np.float64)
                b = np.array([float(getattr(by_key[(second, *key)], rate)) for key in mine], dtype=np.float64)
                diff, lo, hi = paired_episode_bootstrap(a, b, np.array([key[0] for key in mine]), seed=k)
                rows.append({"difference": diff, "lo": lo, "hi": hi, "calls": len(mine)})
            paired[rate] = rows
        out["paired"] = {"a": first, "b": second, **paired}
    return out


def format_summary(summary: Mapping) -> str:
    """Markdown tables of :func:`summarise`'s result: per checkpoint, then the paired difference."""
    lines = []
    for label, rows in summary["checkpoints"].items():
        header = (
            "| distance beyond radius | calls | expert STOPs | STOP asked | gate allows | episode would end "
            "| wall hit | moved (m) | progress (m) | expert's progress (m) | gate's distance (m) | true geodesic (m) |"
        )
        lines += [f"\n{label}\n", header, "| --- |" + " --- |" * 11]
        for name, r in zip(summary["bands"], rows, strict=True):
            cells = [f"{r[rate]:.2f} [{r[f'{rate}_ci'][0]:.2f}, {r[f'{rate}_ci'][1]:.2f}]" for rate in RATES]
            amounts = [f"{r.get(a, float('nan')):.3f}" for a in (*AMOUNTS, "expert_progress_m")]
            lines.append(
                f"| {name} | {r['calls']} | {r['expert_stops']:.2f} | " + " | ".join(cells + amounts)
                + f" | {r['gate_distance_m_mean']:.2f} | {r['geodesic_m_mean']:.2f} |"
            )  # fmt: skip
    paired = summary.get("paired")
    if paired:
        lines += [f"\npaired, {paired['a']} - {paired['b']} (same states, same noise; 95% interval over episodes)\n",
                  "| distance beyond radius | calls | STOP asked | gate allows | episode would end | wall hit "
                  "| moved (m) | progress (m) |",
                  "| --- |" + " --- |" * 7]  # fmt: skip
        for k, name in enumerate(summary["bands"]):
            cells = [
                f"{paired[rate][k]['difference']:+.3f} [{paired[rate][k]['lo']:+.3f}, {paired[rate][k]['hi']:+.3f}]"
                for rate in (*RATES, *AMOUNTS)
                if rate in paired
            ]
            lines.append(f"| {name} | {paired['asked'][k]['calls']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
