"""The scalars a Stage-III step logs, built from the layer table, and the timer of its phases.

Reward and advantage tables are ``[N, 9]`` in :data:`~verl_omni.pipelines.wnm_shared.layers.LAYER_NAMES` order;
the navigation and STOP totals sum the columns the layer table names (``NAV_LAYERS``, ``STOP_LAYERS``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES, NAV_LAYERS, STOP_LAYERS, VISUAL_LAYER


def reward_metrics(scores: np.ndarray, diagnostics: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per-layer mean and std, the navigation and STOP totals, and the mean of every finite diagnostic term.

    Args:
        scores: ``[N, 9]`` layer rewards.
        diagnostics: Reward terms by name (``[N]`` or ``[N, ...]``); non-finite entries are left out of a mean.
    """
    m = {}
    for g, name in enumerate(LAYER_NAMES):
        m[f"reward/{name}/mean"] = float(scores[:, g].mean())
        m[f"reward/{name}/std"] = float(scores[:, g].std())
    m["reward/nav_total/mean"] = float(scores[:, list(NAV_LAYERS)].sum(1).mean())
    m["reward/stop_total/mean"] = float(scores[:, list(STOP_LAYERS)].sum(1).mean())
    for key, val in diagnostics.items():
        val = np.asarray(val, dtype=np.float64)
        if val.size and np.isfinite(val).any():
            m[f"reward_terms/{key}"] = float(np.nanmean(np.where(np.isfinite(val), val, np.nan)))
    return m


def advantage_metrics(result) -> dict[str, float]:
    """:meth:`AdvantageResult.metrics` plus the std of each layer's advantages."""
    m = result.metrics()
    for g, name in enumerate(LAYER_NAMES):
        m[f"advantages/std/{name}"] = float(result.advantages[:, g].std())
    return m


def validation_metrics(scores: np.ndarray, events: Sequence[Sequence[str]]) -> dict[str, float]:
    """Navigation and STOP totals, visual reward and count over all rollouts and per event label.

    Args:
        scores: ``[N, 9]`` layer rewards of the validation rollouts.
        events: ``N`` event-label lists (a rollout counts in every group it is labelled with).
    """
    groups = {"all": np.ones(len(events), bool)}
    for ev in sorted({e for evs in events for e in evs}):
        groups[ev] = np.array([ev in evs for evs in events])
    out = {}
    for gname, mask in groups.items():
        if not mask.any():
            continue
        s = scores[mask]
        out[f"val/{gname}/nav_total"] = float(s[:, list(NAV_LAYERS)].sum(1).mean())
        out[f"val/{gname}/stop_total"] = float(s[:, list(STOP_LAYERS)].sum(1).mean())
        out[f"val/{gname}/visual"] = float(s[:, VISUAL_LAYER].mean())
        out[f"val/{gname}/count"] = float(mask.sum())
    return out


@dataclass
class Lap:
    """Seconds of one timed phase, set when its ``with`` block ends."""

    seconds: float = 0.0


class PhaseTimer:
    """Wall-clock seconds per named phase over a run.

    ``with timer.phase("rollout") as lap: ...`` appends the block's duration to ``timer.timings["rollout"]``
    and to ``lap.seconds`` (also when the block raises).
    """

    def __init__(self) -> None:
        self.timings: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def phase(self, name: str) -> Iterator[Lap]:
        lap = Lap()
        t0 = time.perf_counter()
        try:
            yield lap
        finally:
            lap.seconds = time.perf_counter() - t0
            self.timings[name].append(lap.seconds)

    def table(self, phases: Sequence[str]) -> str:
        """Calls, mean and total seconds of each phase that ran, in ``phases`` order."""
        lines = ["", "step-time table (seconds)", f"{'phase':<12}{'calls':>7}{'mean':>10}{'total':>10}"]
        for phase in phases:
            v = self.timings.get(phase, [])
            if v:
                lines.append(f"{phase:<12}{len(v):>7}{np.mean(v):>10.2f}{np.sum(v):>10.2f}")
        return "\n".join(lines)
