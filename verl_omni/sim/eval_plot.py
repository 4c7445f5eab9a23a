"""Trajectory figure of a closed-loop evaluation: one panel per scene, a few episodes each, on the occupancy map.

Each episode has its own colour; each evaluated checkpoint its own line style (solid for the first, dashed
for the second), so a comparison shows both runs of the same episode in the same colour. Markers: start
(circle), goal (star) with its success radius, STOP (square), collisions (small crosses), step limit (none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from verl_omni.sim.closed_loop import EpisodeResult, EpisodeSpec
from verl_omni.sim.floorplan import FloorPlan

# Matplotlib dash patterns; runs beyond the named styles take explicit (offset, on-off) sequences.
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2, 1, 2)))


def plot_trajectories(
    path: str | Path,
    plans: Mapping[str, FloorPlan],
    specs: Sequence[EpisodeSpec],
    runs: Sequence[tuple[str, Sequence[EpisodeResult]]],
    episodes_per_scene: int = 3,
    columns: int = 3,
) -> None:
    """Writes the PNG to ``path`` (the caller handles temporary names and overwrite refusal).

    Args:
        path: Output PNG file.
        plans: Scene id -> plan.
        specs: Episodes (in the order of each run's results).
        runs: ``(label, results)`` per evaluated checkpoint, results in ``specs`` order.
        episodes_per_scene: The first this many episodes of each scene are drawn.
        columns: Panels per row.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Circle

    if len(runs) > len(LINE_STYLES):
        raise ValueError(f"plot_trajectories: at most {len(LINE_STYLES)} runs, got {len(runs)}")
    for label, results in runs:
        if [r.episode_id for r in results] != [s.episode_id for s in specs]:
            raise ValueError(f"plot_trajectories: results of {label!r} do not follow the episode list")
    scene_ids = list(dict.fromkeys(s.scene_id for s in specs))
    ncols = max(1, min(columns, len(scene_ids)))
    nrows = math.ceil(len(scene_ids) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 4.2 * nrows + 0.6), dpi=110)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    colours = [f"C{i}" for i in range(10)]
    for ax, sid in zip(axes, scene_ids, strict=False):
        occ = plans[sid].occupancy()
        x0, x1, y0, y1 = occ.extent
        # Row index grows with +y (docs/contracts.md), hence origin="lower".
        ax.imshow(occ.state, cmap="gray", vmin=0, vmax=255, origin="lower", extent=(x0, x1, y0, y1))
        shown = [i for i, s in enumerate(specs) if s.scene_id == sid][:episodes_per_scene]
        for n, i in enumerate(shown):
            spec, colour = specs[i], colours[n % len(colours)]
            ax.add_patch(Circle(spec.goal, spec.success_radius, fill=False, color=colour, lw=1.0, alpha=0.8))
            ax.plot(*spec.goal, marker="*", ms=12, color=colour, mec="black", mew=0.5, ls="none")
            ax.plot(*spec.start_pose[:2], marker="o", ms=6, color=colour, mec="black", mew=0.5, ls="none")
            for (_, results), style in zip(runs, LINE_STYLES, strict=False):
                r = results[i]
                ax.plot(r.poses[:, 0], r.poses[:, 1], ls=style, color=colour, lw=1.6)
                if r.end_reason == "stop":
                    ax.plot(*r.poses[-1, :2], marker="s", ms=9, mfc="none", mec=colour, mew=1.5, ls="none")
                hits = np.nonzero(r.blocked)[0] + 1
                if hits.size:
                    ax.plot(r.poses[hits, 0], r.poses[hits, 1], marker="x", ms=5, color="red", ls="none")
        ax.set_title(f"scene {sid}", fontsize=10)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y0, y1)
        ax.set_aspect("equal")
        ax.tick_params(labelsize=7)
    for ax in axes[len(scene_ids) :]:
        ax.set_axis_off()
    handles = [Line2D([], [], color="black", ls=style, label=label) for (label, _), style in zip(runs, LINE_STYLES)]
    handles += [
        Line2D([], [], marker="o", color="grey", ls="none", label="start"),
        Line2D([], [], marker="*", color="grey", ms=10, ls="none", label="goal (radius)"),
        Line2D([], [], marker="s", mfc="none", mec="grey", ls="none", label="STOP"),
        Line2D([], [], marker="x", color="red", ls="none", label="collision"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(str(path), format="png")
