"""Pure statistics of the Stage-III study: curve smoothing, seed bands, before/after changes, closed-loop pooling.

Every function here is a pure function of its arguments (numpy in, numpy/dicts out) so that the study's
numbers can be checked against hand calculations and scipy independently of any run.

Conventions: confidence intervals are two-sided at ``confidence`` (0.95 by default); a mean of ``n`` values
gets a Student-t interval with ``n - 1`` degrees of freedom; a difference of two independent means gets a
Welch interval; a proportion of independent binary outcomes gets a Wilson score interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from verl_omni.sim.eval_metrics import HIGHER_IS_BETTER, PROPORTION_METRICS, SUMMARY_METRICS

# Closed-loop metrics the study reports, in table order, and the direction that counts as better (None: neither;
# path length is reported beside SR as a sign of reward gaming, not as a goal), both from the evaluator's registry
# (verl_omni.sim.eval_metrics.METRICS). The last three are the gaming signs (premature STOP, standing still,
# wandering); reports written before the evaluator recorded them lack them.
CLOSED_LOOP_METRICS: tuple[str, ...] = SUMMARY_METRICS
# Rates (Wilson intervals) are the evaluator's own proportion metrics.
BINARY_METRICS: tuple[str, ...] = PROPORTION_METRICS


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average that ignores NaNs: ``out[t] = nanmean(values[max(0, t - window + 1) : t + 1])``.

    A trailing (not centred) window, so a smoothed value only uses steps already taken, like a live curve.

    Args:
        values: ``[T]`` raw curve (NaN for a missing step).
        window: Window length (>= 1).

    Returns:
        ``float64 [T]``; NaN where the whole window is NaN.
    """
    if window < 1:
        raise ValueError(f"trailing_mean: window must be >= 1, got {window}")
    x = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(x)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, x, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(finite)])
    hi = np.arange(1, x.size + 1)
    lo = np.maximum(0, hi - window)
    cnt = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), np.nan)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean and Student-t interval of the mean of finite values.

    Returns:
        ``(mean, low, high)``; bounds are None for fewer than 2 values and equal the mean for zero spread.
    """
    from scipy.stats import t

    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise ValueError("t_interval: no finite values")
    mean = float(x.mean())
    if x.size < 2:
        return mean, None, None
    sem = float(x.std(ddof=1) / math.sqrt(x.size))
    if sem == 0.0:
        return mean, mean, mean
    low, high = t.interval(confidence, x.size - 1, loc=mean, scale=sem)
    return mean, float(low), float(high)


def seed_band(curves: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Across-seed mean curve with a per-step Student-t band.

    Args:
        curves: ``[S, T]`` one curve per seed (NaN where a seed has no value at a step).

    Returns:
        ``(mean, low, high)``, each ``float64 [T]``; the band is NaN at steps with fewer than 2 seeds.
    """
    c = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    mean = np.full(c.shape[1], np.nan)
    low, high = mean.copy(), mean.copy()
    for j in range(c.shape[1]):
        col = c[:, j][np.isfinite(c[:, j])]
        if col.size == 0:
            continue
        m, lo, hi = t_interval(col, confidence)
        mean[j] = m
        if lo is not None:
            low[j], high[j] = lo, hi
    return mean, low, high


def welch_difference(
    before: Sequence[float], after: Sequence[float], confidence: float = 0.95
) -> dict[str, float | None]:
    """Difference of means ``mean(after) - mean(before)`` with a Welch interval (unequal variances).

    Returns:
        ``{"before", "after", "diff", "low", "high"}``; bounds are None when either side has < 2 values.
    """
    from scipy.stats import ttest_ind

    a = np.asarray(before, dtype=np.float64)
    b = np.asarray(after, dtype=np.float64)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if a.size == 0 or b.size == 0:
        raise ValueError("welch_difference: both sides need at least one finite value")
    out: dict[str, float | None] = {
        "before": float(a.mean()),
        "after": float(b.mean()),
        "diff": float(b.mean() - a.mean()),
        "low": None,
        "high": None,
    }
    if a.size >= 2 and b.size >= 2:
        if a.std() == 0 and b.std() == 0:
            out["low"] = out["high"] = out["diff"]
        else:
            ci = ttest_ind(b, a, equal_var=False).confidence_interval(confidence)
            out["low"], out["high"] = float(ci.low), float(ci.high)
    return out


def early_late_change(values: Sequence[float], fraction: float = 0.2, confidence: float = 0.95) -> dict:
    """Compares the first and the last ``fraction`` of a curve's finite values (Welch interval).

    Used for "did the training reward rise": the per-step values of the first and last windows are treated
    as two samples; consecutive steps are correlated, so the interval is indicative, not exact.

    Returns:
        :func:`welch_difference` of (first window, last window) plus ``"window"`` (values per side).
    """
    if not 0 < fraction <= 0.5:
        raise ValueError(f"early_late_change: fraction must be in (0, 0.5], got {fraction}")
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 2:
        raise ValueError(f"early_late_change: needs >= 2 finite values, got {x.size}")
    k = max(1, int(round(fraction * x.size)))
    out = welch_difference(x[:k], x[-k:], confidence)
    out["window"] = k
    return out


def intervals_overlap(a: tuple[float | None, float | None], b: tuple[float | None, float | None]) -> bool | None:
    """Whether closed intervals ``[a0, a1]`` and ``[b0, b1]`` overlap (None when a bound is unknown)."""
    if None in a or None in b:
        return None
    return not (a[1] < b[0] or b[1] < a[0])


def relative_change(before: float, after: float) -> float | None:
    """``(after - before) / |before|``; None when ``before`` is 0 (no relative scale)."""
    if before == 0:
        return None
    return (after - before) / abs(before)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (scipy's implementation)."""
    from scipy.stats import binomtest

    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson: needs 0 <= successes <= n and n >= 1, got {successes}/{n}")
    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def episode_matrix(runs: Sequence[Sequence[Mapping]], metric: str) -> tuple[list[str], np.ndarray]:
    """Stacks one metric of several evaluations of the same episodes.

    Args:
        runs: One list of per-episode dicts (``episode_id`` and ``metric``) per evaluated checkpoint.
        metric: Metric name.

    Returns:
        ``(episode_ids, float64 [R, E])``.

    Raises:
        ValueError: the runs do not hold the same episodes in the same order.
    """
    if not runs:
        raise ValueError("episode_matrix: no runs")
    ids = [e["episode_id"] for e in runs[0]]
    for r in runs[1:]:
        if [e["episode_id"] for e in r] != ids:
            raise ValueError("episode_matrix: every run must cover the same episodes in the same order")
    return ids, np.array([[float(e[metric]) for e in r] for r in runs], dtype=np.float64)


def compare_closed_loop(
    baseline: Sequence[Mapping], treated: Sequence[Sequence[Mapping]], confidence: float = 0.95
) -> dict[str, dict]:
    """Before/after comparison of closed-loop metrics on the same held-out episodes.

    ``treated`` holds one evaluation per seed of the same arm. Per episode the treated value is averaged over
    seeds (the seed-averaged outcome of the arm), so episodes stay the independent unit: the baseline mean gets a
    Wilson interval for binary metrics and a t interval otherwise; the treated seed-averaged mean and the paired
    difference (treated - baseline) get t intervals over episodes.

    Returns:
        Metric -> ``{"before": (m, lo, hi), "after": (m, lo, hi), "diff": (m, lo, hi), "relative": r,
        "overlap": bool|None, "improved": bool|None, "seeds": S, "episodes": E, "per_seed": [m_s, ...]}``;
        ``improved`` is True when the difference interval excludes 0 in the better direction.
    """
    if not treated:
        raise ValueError("compare_closed_loop: no treated evaluations")
    out: dict[str, dict] = {}
    recorded = [m for m in CLOSED_LOOP_METRICS if all(m in e for r in (baseline, *treated) for e in r)]
    for metric in recorded:
        _, base = episode_matrix([baseline], metric)
        _, tr = episode_matrix([baseline, *treated], metric)
        base, tr = base[0], tr[1:]
        after_ep = tr.mean(axis=0)
        if metric in BINARY_METRICS:
            lo, hi = wilson(int(round(base.sum())), base.size, confidence)
            before = (float(base.mean()), lo, hi)
        else:
            before = t_interval(base, confidence)
        after = t_interval(after_ep, confidence)
        if metric in BINARY_METRICS and after[1] is not None:
            after = (after[0], max(0.0, after[1]), min(1.0, after[2]))  # a rate's t interval stays inside [0, 1]
        diff = t_interval(after_ep - base, confidence)
        better = HIGHER_IS_BETTER[metric]
        improved = None
        if diff[1] is not None and better is not None:
            improved = bool(diff[1] > 0) if better else bool(diff[2] < 0)
        out[metric] = {
            "before": before,
            "after": after,
            "diff": diff,
            "relative": relative_change(before[0], after[0]),
            "overlap": intervals_overlap(before[1:], after[1:]),
            "improved": improved,
            "seeds": int(tr.shape[0]),
            "episodes": int(base.size),
            "per_seed": [float(v) for v in tr.mean(axis=1)],
        }
    return out


def goal_check(comparison: Mapping[str, Mapping], sr_points: float = 0.10, collision_cut: float = 0.30) -> dict:
    """The issue's closed-loop goal: SR +``sr_points`` and ``collision_cut`` fewer collisions, CIs apart.

    Returns:
        ``{"sr_gain", "sr_goal_met", "collision_reduction", "collision_goal_met", "sr_cis_apart",
        "collision_cis_apart", "met"}`` (reductions as positive fractions; None where undefined).
    """
    sr, col = comparison["success"], comparison["collisions"]
    sr_gain = sr["after"][0] - sr["before"][0]
    rel = col["relative"]
    reduction = None if rel is None else -rel
    sr_apart = None if sr["overlap"] is None else not sr["overlap"]
    col_apart = None if col["overlap"] is None else not col["overlap"]
    sr_met = sr_gain >= sr_points - 1e-12
    col_met = reduction is not None and reduction >= collision_cut - 1e-12
    return {
        "sr_gain": sr_gain,
        "sr_goal_met": bool(sr_met),
        "collision_reduction": reduction,
        "collision_goal_met": bool(col_met),
        "sr_cis_apart": sr_apart,
        "collision_cis_apart": col_apart,
        "met": bool(sr_met and col_met and sr_apart and col_apart),
    }
