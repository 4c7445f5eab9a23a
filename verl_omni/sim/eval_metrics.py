"""Closed-loop navigation metrics and their 95% confidence intervals (pure functions).

Per episode (computed by :mod:`verl_omni.sim.closed_loop`):

* ``success`` (SR): the policy issued STOP with the geodesic distance to the goal at most the success radius;
* ``oracle_success`` (OSR): some visited pose (the start included) was within the success radius;
* ``spl``: success weighted by path length, ``S * l / max(p, l)`` with ``l`` the geodesic start-goal distance
  and ``p`` the length the robot actually travelled;
* ``ne``: navigation error, the geodesic distance to the goal where the episode ended (metres);
* ``collisions``: action steps whose swept footprint hit occupied space; ``collided``: at least one;
  ``collision_events``: maximal runs of consecutive blocked steps (one contact, however long the robot pushes on);
  ``longest_blocked_run``: the longest such run. A policy that keeps driving into a wall it touched raises
  ``collisions`` without raising ``collision_events``, so the two together tell contacts from pushing;
* ``premature_stop``: the episode ended by a STOP outside the success radius (the failure the STOP reward's
  premature term and forfeit target);
* ``path_length``: metres actually travelled; ``progress``: geodesic metres gained from start to end.

:data:`METRICS` (one :class:`MetricSpec` each: name, label, aggregation, better direction) is the single list of
these metrics: the evaluator's tables, the study's comparisons and the paired reports derive theirs from it, so a new
metric is added there once.

Aggregates: proportions get Wilson score intervals (``scipy.stats.binomtest``), means get Student-t intervals
(``scipy.stats.t``). Comparisons of two policies on the same episodes use the per-episode paired differences
``B - A`` with a Student-t interval on their mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class MetricSpec:
    """One closed-loop metric of an episode record (a key of ``EpisodeResult.metrics()``).

    Attributes:
        name: Key in an episode record and in :func:`aggregate`'s result.
        label: Human-readable row or column name for tables.
        aggregate: ``"rate"`` for a bool per episode (a proportion with a Wilson interval) or ``"mean"`` for a
            number per episode (a mean with a Student-t interval).
        higher_is_better: The direction of change that counts as an improvement; None for neither (reported
            beside the goals, e.g. path length as a sign of reward gaming).
        optional: Added after the first reports were written; a record without it (an older report, a hand-made
            record) is still aggregated, without this metric.
        summary: Shown in the evaluator's summary table and compared in the study's before/after tables.
    """

    name: str
    label: str
    aggregate: Literal["rate", "mean"]
    higher_is_better: bool | None
    optional: bool = False
    summary: bool = True

    def __post_init__(self) -> None:
        if self.aggregate not in ("rate", "mean"):
            raise ValueError(f"MetricSpec {self.name!r}: aggregate must be 'rate' or 'mean', got {self.aggregate!r}")


# The single source of truth for the closed-loop metrics, in table order; everything below is derived from it.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("success", "SR", "rate", True),
    MetricSpec("oracle_success", "OSR", "rate", True),
    MetricSpec("spl", "SPL", "mean", True),
    MetricSpec("ne", "NE (m)", "mean", False),
    MetricSpec("collisions", "collisions/ep", "mean", False),
    MetricSpec("collided", "episodes w/ collision", "rate", False),
    MetricSpec("collision_events", "collision events/ep", "mean", False, optional=True),
    MetricSpec("longest_blocked_run", "longest blocked run", "mean", False, optional=True),
    # The gaming signs (premature STOP, standing still, wandering); premature_stop is derived from end_reason
    # when a record lacks it.
    MetricSpec("premature_stop", "premature STOP", "rate", False, optional=True),
    MetricSpec("progress", "geodesic progress (m)", "mean", True, optional=True),
    MetricSpec("path_length", "path length (m)", "mean", None),
    MetricSpec("steps", "steps", "mean", None, summary=False),
)
METRIC_SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}
PROPORTION_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.aggregate == "rate")
MEAN_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.aggregate == "mean")
OPTIONAL_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.optional)
SUMMARY_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.summary)
METRIC_LABELS: dict[str, str] = {m.name: m.label for m in METRICS}
HIGHER_IS_BETTER: dict[str, bool | None] = {m.name: m.higher_is_better for m in METRICS}


def spl(success: bool, shortest_path_m: float, path_length_m: float) -> float:
    """Success weighted by (normalized inverse) path length of one episode.

    Args:
        success: Whether the episode succeeded.
        shortest_path_m: Geodesic start-goal distance ``l`` (> 0).
        path_length_m: Length ``p`` the robot travelled (>= 0).

    Returns:
        ``l / max(p, l)`` when successful, else 0.
    """
    if not shortest_path_m > 0 or not path_length_m >= 0:
        raise ValueError(
            f"spl: needs shortest_path_m > 0 and path_length_m >= 0, got {shortest_path_m}, {path_length_m}"
        )
    return float(shortest_path_m / max(path_length_m, shortest_path_m)) if success else 0.0


def blocked_run_lengths(blocked: Sequence[bool]) -> np.ndarray:
    """``int64 [runs]`` lengths of the runs of consecutive blocked steps in an episode's ``bool [steps]`` flags."""
    flags = np.asarray(blocked, bool).astype(np.int8).ravel()
    edges = np.diff(np.concatenate(([0], flags, [0])))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).astype(np.int64)


def blocked_runs(blocked: Sequence[bool]) -> tuple[int, int]:
    """Contacts in an episode's ``bool [steps]`` blocked flags: ``(runs of consecutive blocked steps, longest)``."""
    lengths = blocked_run_lengths(blocked)
    return (int(lengths.size), int(lengths.max())) if lengths.size else (0, 0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (no continuity correction)."""
    from scipy.stats import binomtest

    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: needs 0 <= successes <= n and n >= 1, got {successes}/{n}")
    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean and Student-t interval of the mean.

    Returns:
        ``(mean, low, high)``; the bounds are None for a single value (no spread to estimate) and equal the
        mean when every value is the same.
    """
    from scipy.stats import t

    x = np.asarray(values, np.float64)
    if x.size == 0 or not np.isfinite(x).all():
        raise ValueError(f"mean_interval: needs a non-empty array of finite values, got {x.tolist()}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, None, None
    sem = float(x.std(ddof=1) / math.sqrt(x.size))
    if sem == 0.0:  # scipy returns nan for a zero scale; the interval degenerates to the point
        return mean, mean, mean
    low, high = t.interval(confidence, x.size - 1, loc=mean, scale=sem)
    return mean, float(low), float(high)


def _value(e: Mapping, name: str):
    """Metric ``name`` of episode record ``e``; None for a missing optional metric (see OPTIONAL_METRICS)."""
    if name in e:
        return e[name]
    if name == "premature_stop" and "end_reason" in e:
        return e["end_reason"] == "stop" and not e["success"]
    if name in OPTIONAL_METRICS:
        return None
    raise KeyError(f"episode {e.get('episode_id', '?')!r} has no metric {name!r}")


def _columns(episodes: Sequence[Mapping], names: Sequence[str]) -> dict[str, list]:
    """``{name: per-episode values}`` for the names every episode has (optional ones may be left out)."""
    out = {}
    for name in names:
        vals = [_value(e, name) for e in episodes]
        if all(v is not None for v in vals):
            out[name] = vals
    return out


def aggregate(episodes: Sequence[Mapping[str, float]], confidence: float = 0.95) -> dict:
    """Aggregates per-episode metrics.

    Args:
        episodes: One mapping per episode with every name of :data:`PROPORTION_METRICS` (bool) and
            :data:`MEAN_METRICS` (number); those in :data:`OPTIONAL_METRICS` may be missing (then left out).
        confidence: Interval confidence level.

    Returns:
        ``{"episodes": n, "confidence": c, <metric>: {"mean", "low", "high", "method"} ...}``; proportions
        also carry ``"count"``.
    """
    n = len(episodes)
    if n == 0:
        raise ValueError("aggregate: no episodes")
    out: dict = {"episodes": n, "confidence": confidence}
    for name, vals in _columns(episodes, PROPORTION_METRICS).items():
        k = sum(bool(v) for v in vals)
        low, high = wilson_interval(k, n, confidence)
        out[name] = {"mean": k / n, "low": low, "high": high, "count": k, "method": "wilson"}
    for name, vals in _columns(episodes, MEAN_METRICS).items():
        mean, low, high = mean_interval([float(v) for v in vals], confidence)
        out[name] = {"mean": mean, "low": low, "high": high, "method": "student-t"}
    return out


def paired_differences(
    a: Sequence[Mapping[str, float]], b: Sequence[Mapping[str, float]], confidence: float = 0.95
) -> dict:
    """Per-metric mean of the paired differences ``b - a`` over the same episodes, with a Student-t interval.

    Raises:
        ValueError: the two lists do not hold the same episodes in the same order.
    """
    ids_a = [e["episode_id"] for e in a]
    ids_b = [e["episode_id"] for e in b]
    if ids_a != ids_b:
        raise ValueError("paired_differences: both runs must cover the same episodes in the same order")
    out: dict = {"episodes": len(a), "confidence": confidence, "direction": "compare - checkpoint"}
    names = PROPORTION_METRICS + MEAN_METRICS
    ca, cb = _columns(a, names), _columns(b, names)
    for name in [m for m in names if m in ca and m in cb]:
        diff = [float(vb) - float(va) for va, vb in zip(ca[name], cb[name], strict=True)]
        mean, low, high = mean_interval(diff, confidence)
        out[name] = {"mean": mean, "low": low, "high": high, "method": "paired student-t"}
    return out


def format_estimate(entry: Mapping, digits: int = 3) -> str:
    """``mean [low, high]`` (or ``mean`` alone when the interval is undefined)."""
    m = f"{entry['mean']:.{digits}f}"
    if entry.get("low") is None:
        return m
    return f"{m} [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"


def premature_stop_bins(
    episodes: Sequence[Mapping], success_radius: Mapping[str, float] | float, edges: Sequence[float]
) -> list[int]:
    """Premature STOPs (a STOP outside the success radius) counted by the geodesic distance left beyond the radius.

    A STOP just short of the goal and one in the wrong room are both premature; the bins tell them apart (a
    distance-scaled STOP penalty barely charges the first).

    Args:
        episodes: Per-episode records with ``premature_stop`` and ``ne`` (geodesic metres to the goal at the end).
        success_radius: Each episode id's success radius (from the report's episode specs), or one for all.
        edges: Increasing metres beyond the radius, e.g. ``(0.5, 1.5)``.

    Returns:
        ``len(edges) + 1`` counts: ``(0, edges[0]]``, ``(edges[0], edges[1]]``, ..., ``(edges[-1], inf)``.
    """
    counts = [0] * (len(edges) + 1)
    for ep in episodes:
        if not ep.get("premature_stop"):
            continue
        if isinstance(success_radius, (int, float)):
            radius = success_radius
        elif ep["episode_id"] in success_radius:
            radius = success_radius[ep["episode_id"]]
        else:
            raise KeyError(f"episode {ep['episode_id']!r}: no success radius given for it")
        beyond = float(ep["ne"]) - float(radius)
        counts[sum(beyond > e for e in edges)] += 1
    return counts


def premature_stop_bin_labels(edges: Sequence[float]) -> list[str]:
    """Column heads of :func:`premature_stop_bins`' counts, e.g. ``["0-0.5 m", "0.5-1.5 m", "> 1.5 m"]``."""
    lows = (0.0, *edges[:-1])
    return [f"{lo:g}-{hi:g} m" for lo, hi in zip(lows, edges, strict=True)] + [f"> {edges[-1]:g} m"]


def report_runs(path) -> tuple[dict[str, list[dict]], list[dict] | None]:
    """Label -> per-episode records of one evaluation report file, and the episode specs it carries.

    Reads ``closed_loop_eval.py`` reports (specs at the top under ``episodes``, records under ``runs``) and the
    per-checkpoint files of ``train_stage2.py`` (records at the top, specs under ``specs``; reports before
    2026-12-02 carry none, then the specs are None).

    Raises:
        ValueError: the file cannot be read or holds no per-episode records; the message names the file.
    """
    import json
    from pathlib import Path

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the report ({e})") from e
    if isinstance(data, dict) and isinstance(data.get("runs"), dict):
        runs = {k: v["episodes"] for k, v in data["runs"].items() if isinstance(v, dict) and "episodes" in v}
        if runs:
            return runs, data.get("episodes")
    elif isinstance(data, dict) and isinstance(data.get("episodes"), list):
        return {str(data.get("label", path.stem)): data["episodes"]}, data.get("specs")
    raise ValueError(f"{path}: no per-episode records (expected a top-level 'episodes' list or 'runs' with 'episodes')")


def stop_gate_summary(
    episodes: Sequence[Mapping], success_radius: float, execute_steps: int | None = None
) -> dict | None:
    """How the STOP gate decided, from the episodes' ``policy_notes`` (``verl_omni.sim.wnm_policy.gate_notes``).

    Every note is a call whose chunk asked for a STOP; its true distance is the geodesic distance to the goal at
    the call's pose (``geodesic[step]``; the STOP itself comes ``stop_step`` motion steps later).

    Args:
        episodes: ``EpisodeResult.to_dict()`` records (a report's ``episodes``).
        success_radius: Metres; a STOP farther than this is premature.
        execute_steps: Steps a call executes; only STOPs asked for inside them count (the others were never
            going to happen in that call). None counts every note.

    Returns:
        None when no episode carries a gate note; else ``{"stop_asked", "allowed", "allowed_outside_radius"
        (premature STOPs the gate let through), "blocked", "blocked_inside_radius" (STOPs at the goal it refused),
        "allowed_true_m_median", "allowed_gate_m_median" (true and predicted metres of the STOPs it let through),
        "gate_minus_true_m_mean" (mean predicted object distance minus true goal distance over all asked calls)}``.
    """
    true_m, gate_m, allowed = [], [], []
    for e in episodes:
        geodesic = e.get("geodesic")
        for note in e.get("policy_notes", []):
            if not note.get("stop_asked") or geodesic is None:
                continue
            if execute_steps is not None and int(note.get("stop_step", 0)) >= execute_steps:
                continue
            true_m.append(float(geodesic[int(note["step"])]))
            gate_m.append(float(note["gate_distance_m"]))
            allowed.append(bool(note["stop_allowed"]))
    if not true_m:
        return None
    true_m, gate_m, allowed = np.asarray(true_m), np.asarray(gate_m), np.asarray(allowed, bool)
    outside = true_m > success_radius
    return {
        "stop_asked": int(len(true_m)),
        "allowed": int(allowed.sum()),
        "allowed_outside_radius": int((allowed & outside).sum()),
        "blocked": int((~allowed).sum()),
        "blocked_inside_radius": int((~allowed & ~outside).sum()),
        "allowed_true_m_median": float(np.median(true_m[allowed])) if allowed.any() else float("nan"),
        "allowed_gate_m_median": float(np.median(gate_m[allowed])) if allowed.any() else float("nan"),
        "gate_minus_true_m_mean": float(np.mean(gate_m - true_m)),
    }
