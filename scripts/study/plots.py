"""Study figures (matplotlib, Agg backend, small PNGs): per-layer reward curves, validation per event type,
closed-loop metrics before and after with confidence intervals.

Each function takes loaded data (see ``scripts/study/report.py``) and a path and writes one PNG atomically.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from . import stats
from .report import EVENTS, LAYERS, METRIC_LABELS, StudyData, Trajectories, aligned

ARM_COLORS = {
    "main": "tab:blue",
    "abl_a_summed": "tab:orange",
    "abl_b_prompt_baseline": "tab:green",
    "abl_c_independent_noise": "tab:red",
    "no_stop_chunk_charge": "tab:gray",
    "cand_stop_chunk": "tab:purple",  # session 17's name of the recipe's charge_stop_chunk, before it entered it
}
DPI = 80


def _figure(rows: int, cols: int, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    return plt, fig, axes


def _save(plt, fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=DPI)
    plt.close(fig)
    os.replace(tmp, path)


def _arm_curve(ax, data: StudyData, arm: str, key: str, window: int, band: bool) -> bool:
    runs = data.arm_runs(arm)
    steps, vals = aligned(runs, key)
    if steps.size == 0:
        return False
    smooth = np.stack([stats.trailing_mean(v, window) for v in vals])
    mean, lo, hi = stats.seed_band(smooth)
    color = ARM_COLORS.get(arm, "gray")
    ax.plot(steps, mean, color=color, lw=1.6 if arm == "main" else 1.0, label=f"{arm} (n={len(runs)})")
    if band and len(runs) > 1:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
    return True


def reward_curves(data: StudyData, path: Path, window: int = 10) -> None:
    """3x3 grid, one panel per credit layer: trailing-mean training reward, main arm with its 95% seed band."""
    plt, fig, axes = _figure(3, 3, (11, 8))
    for ax, layer in zip(axes.flat, LAYERS, strict=True):
        for arm in data.arms:
            _arm_curve(ax, data, arm, f"reward/{layer}/mean", window, band=arm == "main")
        ax.set_title(layer, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(f"training reward per layer (trailing mean over {window} steps; band: 95% CI over seeds)", fontsize=10)
    _save(plt, fig, path)


def validation_curves(data: StudyData, path: Path) -> None:
    """One panel per event type: ODE validation action reward (nav_total + stop_total) over training."""
    plt, fig, axes = _figure(1, len(EVENTS), (3.0 * len(EVENTS), 3.2))
    for ax, ev in zip(axes[0], EVENTS, strict=True):
        for arm in data.arms:
            runs = data.arm_runs(arm)
            steps, nav = aligned(runs, f"val/{ev}/nav_total")
            _, stop = aligned(runs, f"val/{ev}/stop_total")
            if steps.size == 0:
                continue
            mean, lo, hi = stats.seed_band(nav + stop)
            color = ARM_COLORS.get(arm, "gray")
            ax.plot(steps, mean, "o-", ms=3, color=color, lw=1.6 if arm == "main" else 1.0, label=arm)
            if arm == "main" and len(runs) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        ax.set_title(ev, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("nav_total + stop_total", fontsize=8)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("event-balanced validation (ODE); band: 95% CI over seeds", fontsize=10)
    _save(plt, fig, path)


def closed_loop_bars(comps: Mapping[str, Mapping], path: Path) -> None:
    """SR, SPL and collisions/episode of Stage-II and of each arm's Stage-III export, with 95% CIs."""
    metrics = ("success", "spl", "collisions")
    plt, fig, axes = _figure(1, len(metrics), (4.0 * len(metrics), 3.4))
    arms = list(comps)
    for ax, metric in zip(axes[0], metrics, strict=True):
        labels, means, errs, colors = [], [], [], []
        entries = [("Stage-II", comps[arms[0]][metric]["before"], "gray")] if arms else []
        entries += [(arm, comps[arm][metric]["after"], ARM_COLORS.get(arm, "gray")) for arm in arms]
        for label, (m, lo, hi), color in entries:
            labels.append(label.replace("abl_", "").replace("_", "\n", 1))
            means.append(m)
            errs.append([m - lo, hi - m] if lo is not None else [0.0, 0.0])
            colors.append(color)
        x = np.arange(len(labels))
        ax.bar(x, means, color=colors, alpha=0.8)
        if errs:
            ax.errorbar(x, means, yerr=np.asarray(errs).T, fmt="none", ecolor="black", capsize=3, lw=1)
        ax.set_xticks(x, labels, fontsize=6)
        ax.set_title(METRIC_LABELS[metric], fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("closed loop on held-out scenes: before (Stage-II) and after (Stage-III exports), 95% CI", fontsize=10)
    _save(plt, fig, path)


def closed_loop_validation(data: StudyData, path: Path) -> bool:
    """SR and premature-STOP rate of each run's saved checkpoints on the validation episodes, over training.

    Returns:
        False (and draws nothing) when no run was validated in closed loop.
    """
    runs = [r for r in data.runs if r.validation]
    if not runs:
        return False
    plt, fig, axes = _figure(1, 2, (9.0, 3.4))
    for ax, key, title in ((axes[0, 0], "success", "SR"), (axes[0, 1], "premature_stop", "premature STOP")):
        for run in runs:
            steps = sorted(run.validation)
            values = [np.mean([float(e.get(key, np.nan)) for e in run.validation[s]]) for s in steps]
            ax.plot(steps, values, "o-", ms=3, color=ARM_COLORS.get(run.arm, "gray"), label=run.name, lw=1.2)
        if data.stage2_validation:  # the start on the same episodes: the line a run has to beat
            start = np.mean([float(e.get(key, np.nan)) for e in data.stage2_validation])
            ax.axhline(start, color="black", ls="--", lw=1.0, label="stage2 (start)")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("closed-loop validation during training (validation seed)", fontsize=10)
    _save(plt, fig, path)
    return True


def trajectory_comparison(traj: Trajectories, path: Path, episodes_per_scene: int = 3) -> None:
    """Stage-II and Stage-III trajectories of the same held-out episodes on the occupancy maps (one line style per
    evaluation, one colour per episode; ``verl_omni.sim.eval_plot``, the evaluator's own figure)."""
    from verl_omni.sim.eval_plot import plot_trajectories

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    plot_trajectories(tmp, traj.plans, traj.specs, traj.runs, episodes_per_scene=episodes_per_scene)
    os.replace(tmp, path)
