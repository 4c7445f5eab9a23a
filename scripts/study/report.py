"""Turns a study's results folder into plots (PNG) and Markdown tables with confidence intervals.

Reading (``load_results``) is separate from the numbers (``training_table``, ``validation_table``,
``closed_loop_tables``: pure functions of the loaded data) and from drawing (``scripts/study/plots.py``).

Layout read: ``results/status.json``, ``results/runs/<run>/out/metrics.jsonl`` and
``results/evals/<run|stage2>/report.json`` (format ``wnm-closed-loop-eval/1``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from verl_omni.sim.eval_metrics import METRIC_LABELS as EVAL_METRIC_LABELS
from verl_omni.sim.eval_metrics import premature_stop_bin_labels, premature_stop_bins

from . import stats
from .plan import ARM_BY_NAME

LAYERS = ("visual", "nav_1", "nav_2", "nav_3", "nav_4", "stop_1", "stop_2", "stop_3", "stop_4")
EVENTS = ("all", "collision_precursor", "premature_stop_risk", "required_stop", "near_goal_continuation")
# The evaluator's labels, so the study's tables name a metric as closed_loop_eval.py prints it.
METRIC_LABELS = {m: EVAL_METRIC_LABELS[m] for m in stats.CLOSED_LOOP_METRICS}
# A premature STOP at most this far (geodesic metres) from the goal counts as "just short" in the validation table.
NEAR_GOAL_STOP_M = 1.0
STAGE2 = "stage2"


@dataclass
class RunData:
    """What one training run left behind.

    Attributes:
        name / arm / seed: Run identity.
        metrics: One dict per logged step (``metrics.jsonl``).
        episodes: Per-episode closed-loop metrics of its export (None when not evaluated).
        status: Its entry of ``status.json``.
        validation: Closed-loop validation during training: step -> per-episode metrics of that checkpoint.
    """

    name: str
    arm: str
    seed: int
    metrics: list[dict] = field(default_factory=list)
    episodes: list[dict] | None = None
    status: dict = field(default_factory=dict)
    validation: dict[int, list[dict]] = field(default_factory=dict)

    def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of a metric over the steps that logged it."""
        pts = [(m["step"], m[key]) for m in self.metrics if key in m and m[key] is not None]
        if not pts:
            return np.zeros(0), np.zeros(0)
        s, v = zip(*pts, strict=True)
        return np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64)


@dataclass
class StudyData:
    """All runs plus the Stage-II evaluation."""

    runs: list[RunData]
    stage2: list[dict] | None
    status: dict
    stage2_validation: list[dict] | None = None  # the start on the validation episodes (its "step 0")

    def arm_runs(self, arm: str) -> list[RunData]:
        return sorted((r for r in self.runs if r.arm == arm), key=lambda r: r.seed)

    @property
    def arms(self) -> list[str]:
        present = {r.arm for r in self.runs}
        return [a for a in ARM_BY_NAME if a in present]


def split_run_name(name: str) -> tuple[str, int]:
    """``"main_s2" -> ("main", 2)``."""
    arm, _, seed = name.rpartition("_s")
    if not arm or not seed.isdigit():
        raise ValueError(f"run name {name!r} is not <arm>_s<seed>")
    return arm, int(seed)


def _episodes(report_path: Path) -> list[dict] | None:
    if not report_path.is_file():
        return None
    rep = json.loads(report_path.read_text())
    if rep.get("format") != "wnm-closed-loop-eval/1":
        raise ValueError(f"{report_path}: field 'format' is {rep.get('format')!r}, expected wnm-closed-loop-eval/1")
    keep = ("episode_id", "scene_id", *stats.CLOSED_LOOP_METRICS, "end_reason", "steps")
    # Each record carries its episode's success radius (the specs hold it; older reports only the argument), for
    # the premature-STOP distance table.
    radius = {spec["episode_id"]: spec.get("success_radius") for spec in rep.get("episodes") or []}
    default = (rep.get("arguments") or {}).get("success_radius")
    out = []
    for e in rep["runs"]["checkpoint"]["episodes"]:
        rec = {k: e[k] for k in keep if k in e}
        r = radius.get(e["episode_id"], default)
        if r is not None:
            rec["success_radius"] = float(r)
        out.append(rec)
    return out


def load_results(results: Path) -> StudyData:
    """Reads a results folder (partial results are fine: missing pieces stay None/empty).

    Raises:
        FileNotFoundError: ``status.json`` is missing (names it).
    """
    status_file = results / "status.json"
    if not status_file.is_file():
        raise FileNotFoundError(f"{status_file}: not found; is {results} the output of `study_stage3.py run`?")
    status = json.loads(status_file.read_text())
    runs = []
    for name, st in status["runs"].items():
        if name == STAGE2:
            continue
        arm, seed = split_run_name(name)
        mfile = results / "runs" / name / "out" / "metrics.jsonl"
        metrics = [json.loads(x) for x in mfile.read_text().splitlines() if x.strip()] if mfile.is_file() else []
        run = RunData(name, arm, seed, metrics, _episodes(results / "evals" / name / "report.json"), st)
        # Paths relative to this results folder (status.json holds the GPU machine's absolute ones).
        for report in sorted((results / "evals" / "val" / name).glob("step_*/report.json")):
            tail = report.parent.name.removeprefix("step_")
            if tail.isdigit():
                run.validation[int(tail)] = _episodes(report)
        runs.append(run)
    start_val = _episodes(results / "evals" / "val" / STAGE2 / "step_0" / "report.json")
    return StudyData(runs, _episodes(results / "evals" / STAGE2 / "report.json"), status, start_val)


# ---------------------------------------------------------------------------------------------- numbers
@dataclass
class Trajectories:
    """Closed-loop trajectories of several evaluations on the same episodes (for the trajectory figure).

    Attributes:
        plans: Scene id -> ``FloorPlan`` (the evaluator's saved scenes).
        specs: ``EpisodeSpec`` per drawn episode, in evaluation order.
        runs: ``(label, [EpisodeResult])`` per evaluation, results in ``specs`` order.
    """

    plans: dict
    specs: list
    runs: list


def load_trajectories(results: Path, names: Sequence[str], scenes: int = 6) -> Trajectories | None:
    """Trajectories of the evaluations ``names`` (``stage2`` or run names) on the first ``scenes`` scenes.

    The scenes come from the first evaluation that saved them (``evals/<name>/scenes``: the evaluator writes the
    scenes it synthesized); every evaluation of a study draws the same episodes, which is checked.

    Returns:
        None when none of ``names`` was evaluated or no scene folder was saved.

    Raises:
        ValueError: two evaluations drew different episodes.
        KeyError: a report holds no trajectories (``poses`` and the other ``EpisodeResult.to_dict`` fields).
    """
    from verl_omni.sim.closed_loop import EpisodeResult, EpisodeSpec
    from verl_omni.sim.floorplan import FloorPlan

    reports = {}
    for name in names:
        path = results / "evals" / name / "report.json"
        if path.is_file():
            reports[name] = (path, json.loads(path.read_text()))
    scene_root = next(
        (results / "evals" / n / "scenes" for n in reports if (results / "evals" / n / "scenes").is_dir()), None
    )
    if not reports or scene_root is None:
        return None
    first_path, first = next(iter(reports.values()))
    specs = [EpisodeSpec.from_dict(e) for e in first["episodes"]]
    keep_scenes = list(dict.fromkeys(s.scene_id for s in specs))[:scenes]
    keep = [i for i, s in enumerate(specs) if s.scene_id in keep_scenes]
    runs = []
    for name, (path, rep) in reports.items():
        if [e["episode_id"] for e in rep["episodes"]] != [s.episode_id for s in specs]:
            raise ValueError(f"{path}: its episodes differ from those of {first_path}; not one study's evaluations")
        episodes = rep["runs"]["checkpoint"]["episodes"]
        runs.append((name, [EpisodeResult.from_dict(episodes[i]) for i in keep]))
    plans = {sid: FloorPlan.load(scene_root / sid) for sid in keep_scenes}
    return Trajectories(plans, [specs[i] for i in keep], runs)


def aligned(runs: Sequence[RunData], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps [T], values [S, T])`` of a metric over the union of logged steps (NaN where a run lacks one)."""
    curves = [r.curve(key) for r in runs]
    steps = np.unique(np.concatenate([c[0] for c in curves])) if curves else np.zeros(0, np.int64)
    out = np.full((len(curves), steps.size), np.nan)
    for i, (s, v) in enumerate(curves):
        out[i, np.searchsorted(steps, s)] = v
    return steps, out


def fmt(m: float | None, lo: float | None = None, hi: float | None = None, digits: int = 3) -> str:
    if m is None or not np.isfinite(m):
        return "n/a"
    if lo is None or hi is None:
        return f"{m:+.{digits}f}" if digits else f"{m}"
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def training_table(data: StudyData, fraction: float = 0.2) -> list[list[str]]:
    """Per layer and arm: change of the seed-averaged training reward from the first to the last ``fraction``
    of steps (Welch 95% interval over the steps of the two windows)."""
    arms = data.arms
    rows = [["layer", *[f"{a} (n={len(data.arm_runs(a))})" for a in arms]]]
    for layer in (*LAYERS, "nav_total", "stop_total"):
        row = [layer]
        for arm in arms:
            _, vals = aligned(data.arm_runs(arm), f"reward/{layer}/mean")
            mean = np.nanmean(vals, axis=0) if vals.size else vals
            try:
                ch = stats.early_late_change(mean, fraction)
                row.append(fmt(ch["diff"], ch["low"], ch["high"]))
            except ValueError:
                row.append("n/a")
        rows.append(row)
    return rows


# What the training rollouts did, from the reward set's diagnostics (per-step means over the step's rollouts):
# (label, metric key, scale). The hard-collision diagnostic is a one-hot over the 4 chunks averaged over them,
# so 4 x its mean is the share of rollouts that collided within their 32 steps.
ROLLOUT_BEHAVIOUR = (
    ("training rollouts with a hard collision", "reward_terms/collision/hard", 4.0),
    ("first collision step (32: none)", "reward_terms/geometry/collision_step", 1.0),
    ("STOP step (32: none)", "reward_terms/geometry/stop_step", 1.0),
)


def rollout_behaviour_table(data: StudyData, fraction: float = 0.2) -> list[list[str]]:
    """Per arm: what its training rollouts did in the first and the last ``fraction`` of steps (seed-averaged,
    Welch 95% interval over the steps). Read beside the closed-loop table: rollouts that collide less in training
    while the held-out episodes collide more point at states the training prompts do not hold."""
    arms = data.arms
    rows = [["training rollouts", *[f"{a}: first -> last (change)" for a in arms]]]
    for label, key, scale in ROLLOUT_BEHAVIOUR:
        row = [label]
        for arm in arms:
            _, vals = aligned(data.arm_runs(arm), key)
            mean = scale * np.nanmean(vals, axis=0) if vals.size and np.isfinite(vals).any() else np.zeros(0)
            try:
                ch = stats.early_late_change(mean, fraction)
                row.append(f"{ch['before']:.3f} -> {ch['after']:.3f} ({fmt(ch['diff'], ch['low'], ch['high'])})")
            except ValueError:
                row.append("n/a")
        rows.append(row)
    return rows


def validation_table(data: StudyData) -> list[list[str]]:
    """Per event and arm: action reward (nav_total + stop_total) at the first and the last validation, and
    the per-seed change with a t interval over seeds (a single seed has no interval)."""
    arms = data.arms
    rows = [["event", *[f"{a}: first -> last (change)" for a in arms]]]
    for ev in EVENTS:
        row = [ev]
        for arm in arms:
            runs = data.arm_runs(arm)
            _, nav = aligned(runs, f"val/{ev}/nav_total")
            _, stop = aligned(runs, f"val/{ev}/stop_total")
            if nav.size == 0:
                row.append("n/a")
                continue
            total = nav + stop
            firsts, lasts = [], []
            for r in range(total.shape[0]):
                fin = total[r][np.isfinite(total[r])]
                if fin.size >= 2:
                    firsts.append(fin[0])
                    lasts.append(fin[-1])
            if not firsts:
                row.append("n/a")
                continue
            m, lo, hi = stats.t_interval(np.asarray(lasts) - np.asarray(firsts))
            row.append(f"{np.mean(firsts):+.3f} -> {np.mean(lasts):+.3f} ({fmt(m, lo, hi)})")
        rows.append(row)
    return rows


def closed_loop_validation_table(data: StudyData) -> list[list[str]]:
    """Closed-loop validation during training: per run and saved checkpoint, SR (Wilson 95%) and the signs of
    reward gaming beside it (premature STOP, progress, path length) and collisions.

    ``premature STOP <= 1 m`` is the share of episodes that STOPped outside the success radius but within
    :data:`NEAR_GOAL_STOP_M` of the goal (geodesic): it separates a policy that stops just short of its goal (a
    STOP-placement or STOP-gate error) from one that gives up far away."""
    rows = [["run", "step", "episodes", "SR [95% CI]", "premature STOP", f"premature STOP <= {NEAR_GOAL_STOP_M:g} m",
             "progress (m)", "path (m)", "collisions/ep"]]  # fmt: skip
    # The start first (step 0 of every run), when it was validated on the same episodes.
    start = [(STAGE2 + " (start)", 0, data.stage2_validation)] if data.stage2_validation else []
    for name, step, eps in [*start, *((r.name, s, r.validation[s]) for r in data.runs for s in sorted(r.validation))]:
        n, k = len(eps), sum(bool(e["success"]) for e in eps)
        lo, hi = stats.wilson(k, n)

        def mean(key: str, eps=eps) -> str:
            vals = [float(e[key]) for e in eps if key in e]
            return f"{np.mean(vals):.2f}" if vals else "n/a"

        near = [bool(e["premature_stop"]) and float(e["ne"]) <= NEAR_GOAL_STOP_M for e in eps if "premature_stop" in e]
        rows.append([name, str(step), str(n), f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]", mean("premature_stop"),
                     f"{np.mean(near):.2f}" if near else "n/a", mean("progress"), mean("path_length"),
                     mean("collisions")])  # fmt: skip
    return rows


def closed_loop_comparisons(data: StudyData) -> dict[str, dict]:
    """Arm -> :func:`stats.compare_closed_loop` of its evaluated exports against Stage-II."""
    if data.stage2 is None:
        return {}
    out = {}
    for arm in data.arms:
        evals = [r.episodes for r in data.arm_runs(arm) if r.episodes is not None]
        if evals:
            out[arm] = stats.compare_closed_loop(data.stage2, evals)
    return out


def closed_loop_main_table(comp: Mapping[str, Mapping]) -> list[list[str]]:
    """Before/after/difference rows of one arm's comparison."""
    rows = [["metric", "Stage-II (95% CI)", "Stage-III (95% CI)", "paired diff (95% CI)", "relative", "CIs apart"]]
    for metric in (m for m in stats.CLOSED_LOOP_METRICS if m in comp):
        c = comp[metric]
        rel = "n/a" if c["relative"] is None else f"{100 * c['relative']:+.0f}%"
        apart = "n/a" if c["overlap"] is None else ("yes" if not c["overlap"] else "no")
        rows.append([METRIC_LABELS[metric], fmt(*c["before"]), fmt(*c["after"]), fmt(*c["diff"]), rel, apart])
    return rows


# Metres beyond the success radius that bound the premature-STOP distance bins.
PREMATURE_STOP_EDGES: tuple[float, ...] = (0.5, 1.5)


def premature_stop_distance_table(data: StudyData, edges: Sequence[float] = PREMATURE_STOP_EDGES) -> list[list[str]]:
    """Held-out premature STOPs of Stage-II and every evaluated run, by the distance left beyond the success radius.

    Stage III's extra premature STOPs have been near misses (``docs/results.md``, issue 18): this table shows
    whether a run trades missed STOPs for STOPs just short. Empty (header only) when the records lack ``ne``,
    ``premature_stop`` or ``success_radius``.
    """
    rows = [["evaluation", "episodes", *premature_stop_bin_labels(edges), "all premature STOPs"]]
    named = [(STAGE2, data.stage2)] + [(r.name, r.episodes) for arm in data.arms for r in data.arm_runs(arm)]
    for name, eps in named:
        if not eps or not all({"ne", "premature_stop", "success_radius"} <= e.keys() for e in eps):
            continue
        counts = premature_stop_bins(eps, {e["episode_id"]: e["success_radius"] for e in eps}, edges)
        rows.append([name, str(len(eps)), *(str(c) for c in counts), str(sum(counts))])
    return rows


def ablation_table(data: StudyData, comps: Mapping[str, Mapping]) -> list[list[str]]:
    """Per arm: final training/validation rewards and closed-loop metrics with paired differences vs Stage-II."""
    rows = [
        [
            "arm",
            "seeds",
            "steps",
            "train nav_total (last 20%)",
            "val all: action reward (last)",
            "SR",
            "dSR vs Stage-II",
            "SPL",
            "collisions/ep",
            "dcollisions vs Stage-II",
        ]
    ]
    for arm in data.arms:
        runs = data.arm_runs(arm)
        steps = ",".join(str(r.status.get("steps_done", len(r.metrics))) for r in runs)
        _, nav = aligned(runs, "reward/nav_total/mean")
        last = "n/a"
        if nav.size:
            k = max(1, int(round(0.2 * nav.shape[1])))
            m, lo, hi = stats.t_interval(np.nanmean(nav[:, -k:], axis=1))
            last = fmt(m, lo, hi)
        _, vn = aligned(runs, "val/all/nav_total")
        _, vs = aligned(runs, "val/all/stop_total")
        val = "n/a"
        if vn.size:
            finals = [row[np.isfinite(row)][-1] for row in (vn + vs) if np.isfinite(row).any()]
            if finals:
                val = fmt(*stats.t_interval(finals))
        c = comps.get(arm)
        cells = ["n/a"] * 5
        if c is not None:
            cells = [
                fmt(*c["success"]["after"]),
                fmt(*c["success"]["diff"]),
                fmt(*c["spl"]["after"]),
                fmt(*c["collisions"]["after"]),
                fmt(*c["collisions"]["diff"]),
            ]
        label = ARM_BY_NAME[arm].label if arm in ARM_BY_NAME else arm
        rows.append([f"{arm}: {label}", str(len(runs)), steps, last, val, *cells])
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def run_status_table(data: StudyData) -> list[list[str]]:
    rows = [["run", "state", "steps", "train s", "eval s", "note"]]
    for name, st in data.status["runs"].items():
        note = st.get("reason") or st.get("note") or ""
        if "selected_step" in st:  # --select-by-validation
            note = f"{note}; exported step {st['selected_step']} ({st.get('selection', '')})".lstrip("; ")
        rows.append(
            [
                name,
                st.get("state", "?"),
                str(st.get("steps_done", "")),
                str(st.get("train_s", "")),
                str(st.get("eval_s", "")),
                note.replace("|", "/"),
            ]
        )
    return rows


def render_markdown(data: StudyData, comps: Mapping[str, Mapping], figures: Sequence[str], source: str) -> str:
    """The generated block of docs/results.md."""
    parts = [f"_Generated by `scripts/study_stage3.py report` from `{source}`._", ""]
    parts += ["#### Runs", "", markdown_table(run_status_table(data)), ""]
    parts += [
        "#### Training rewards: change from the first to the last 20% of steps (seed-averaged, Welch 95% CI)",
        "",
        markdown_table(training_table(data)),
        "",
        "#### What the training rollouts did: first vs last 20% of steps (seed-averaged, Welch 95% CI)",
        "",
        markdown_table(rollout_behaviour_table(data)),
        "",
        "#### Event-balanced validation (ODE): action reward nav_total + stop_total, first -> last validation",
        "",
        markdown_table(validation_table(data)),
        "",
    ]
    if "main" in comps:
        goal = stats.goal_check(comps["main"])
        n = comps["main"]["success"]
        parts += [
            f"#### Closed loop, held-out scenes: Stage-II vs main Stage-III ({n['seeds']} seed(s) averaged per "
            f"episode, {n['episodes']} episodes)",
            "",
            markdown_table(closed_loop_main_table(comps["main"])),
            "",
            f"Goal (+10 SR points and 30% fewer collisions, CIs apart): SR gain {100 * goal['sr_gain']:+.1f} points, "
            f"collision reduction "
            + ("n/a" if goal["collision_reduction"] is None else f"{100 * goal['collision_reduction']:.0f}%")
            + f" -> **{'met' if goal['met'] else 'not met'}**.",
            "",
        ]
    stop_bins = premature_stop_distance_table(data)
    if len(stop_bins) > 1:
        parts += [
            "#### Premature STOPs on the held-out episodes, by the geodesic distance left beyond the success radius",
            "",
            markdown_table(stop_bins),
            "",
        ]
    if any(r.validation for r in data.runs):
        parts += [
            "#### Closed-loop validation during training (validation seed, not the held-out one)",
            "",
            markdown_table(closed_loop_validation_table(data)),
            "",
        ]
    parts += ["#### Ablations (same steps, seeds and episodes)", "", markdown_table(ablation_table(data, comps)), ""]
    parts += [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(parts) + "\n"


def summary_json(data: StudyData, comps: Mapping[str, Mapping]) -> dict:
    """Machine-readable summary of the tables."""
    out = {
        "runs": {r.name: {"steps": len(r.metrics), "evaluated": r.episodes is not None} for r in data.runs},
        "closed_loop": comps,
    }
    if "main" in comps:
        out["goal"] = stats.goal_check(comps["main"])
    return out
