#!/usr/bin/env python
"""Closed-loop evaluation of WNM checkpoints and scripted reference policies in held-out synthetic scenes.

Every episode renders its 33-frame history, samples 32 actions with the ODE sampler, executes the first chunk
(8 steps) and asks again, until STOP or ``--max-steps``. Reports SR, OSR, SPL, NE and collisions per episode and
aggregated with 95% confidence intervals (Wilson for proportions, Student-t for means), writes
``<output-dir>/report.json`` and ``<output-dir>/trajectories.png``. With ``--compare`` a second checkpoint runs
the same episodes with the same noise seeds; the report adds paired differences (compare - checkpoint).
Collisions block the robot's translation (the episode goes on) unless ``--collision end``.

``--policy`` adds scripted reference policies (``expert``, ``expert_no_stop``, ``goal_bearing``, ``straight``,
``stop``; see ``verl_omni/sim/reference_policies.py``) on the same episodes, so every baseline row of a table can
be reproduced; ``--level`` (``one_room``, ``two_rooms``, ``house``) picks the task level of synthesized scenes
and episodes (``verl_omni/sim/levels.py``).

Examples:
    python tools/eval/closed_loop_eval.py --checkpoint ckpt/stage2 --compare ckpt/stage3 \\
        --synthesize 4 --seed 1 --episodes 16 --output-dir eval/run1
    python tools/eval/closed_loop_eval.py --checkpoint ckpt/stage3 --scenes ws/occupancy --episodes 8 \\
        --output-dir eval/run2
    python tools/eval/closed_loop_eval.py --policy expert goal_bearing straight stop --level two_rooms \
        --synthesize 40 --seed 1000 --episodes 400 --output-dir eval/baselines
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from verl_omni.data.cli_common import CliError, positive_int, run_cli

REPORT_NAME = "report.json"
PLOT_NAME = "trajectories.png"
SCENES_NAME = "scenes"
REPORT_FORMAT = "wnm-closed-loop-eval/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 report written; 2 bad arguments or inputs, nothing written",
    )
    p.add_argument("--checkpoint", type=Path, help="complete WNM checkpoint directory")
    p.add_argument(
        "--policy",
        nargs="+",
        default=[],
        metavar="NAME",
        help="scripted reference policies evaluated on the same episodes: expert, expert_no_stop, object_expert, "
        "goal_bearing, straight, stop",
    )
    p.add_argument(
        "--level",
        help="task level of synthesized scenes and episodes: one_room, two_rooms, house (sets --scene-size-m, "
        "--max-rooms and --min-goal-distance)",
    )
    p.add_argument("--compare", type=Path, help="second checkpoint, evaluated on the same episodes and seeds")
    p.add_argument("--scenes", nargs="+", type=Path, default=[], help="scene folders, or folders of scene folders")
    p.add_argument("--synthesize", type=int, default=0, metavar="N", help="generate N fresh held-out scenes")
    p.add_argument("--seed", type=int, default=0, help="seed of held-out scenes, episodes and noise (default 0)")
    p.add_argument("--episodes", type=positive_int, default=8, help="episodes in total, spread over the scenes (8)")
    p.add_argument("--max-steps", type=positive_int, default=128, help="motion steps per episode (default 128)")
    p.add_argument("--execute-steps", type=positive_int, default=8, help="steps executed per call (default 8)")
    p.add_argument("--collision", choices=("block", "end"), default="block", help="on collision (default block)")
    p.add_argument("--success-radius", type=float, default=0.5, help="geodesic success radius, m (default 0.5)")
    p.add_argument("--min-goal-distance", type=float, default=3.0, help="min start-goal geodesic, m (default 3)")
    from verl_omni.sim.label_args import add_goal_point_argument

    add_goal_point_argument(p)
    p.add_argument("--num-steps", type=positive_int, default=10, help="ODE denoising steps (default 10)")
    p.add_argument("--shift", type=float, default=3.0, help="sigma schedule shift (default 3.0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes running episodes, each with its own copy of the policy (default 1)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="DiT dtype")
    p.add_argument(
        "--exact-batching",
        action="store_true",
        help="sample each episode on its own: bit-identical whatever episodes share a call (slower on CPU)",
    )
    p.add_argument(
        "--stop-votes",
        type=positive_int,
        default=1,
        help="samples per call voting on each step's STOP flag (WNMPolicy.stop_votes; default 1: one sample)",
    )
    p.add_argument(
        "--stop-gate",
        action="store_true",
        help="STOP only where the checkpoint's view head sees the named object within the expert's stopping distance "
        "(models/wnm/stop_gate.py; needs a checkpoint with stop_gate/, i.e. trained with --view-aux-weight > 0)",
    )
    p.add_argument(
        "--stop-gate-distance",
        type=float,
        default=None,
        metavar="M",
        help="with --stop-gate: stopping distance in metres instead of the one fitted in training",
    )
    p.add_argument("--fov-deg", type=float, default=90.0, help="camera field of view (default 90, as synthesized)")
    p.add_argument("--scene-size-m", type=float, nargs=2, default=[8.0, 6.0], metavar=("W", "H"), help="--synthesize")
    p.add_argument("--max-rooms", type=positive_int, default=5, help="rooms per synthesized scene (default 5)")
    p.add_argument(
        "--only-episodes",
        type=Path,
        metavar="FILE",
        help="evaluate only these episode ids (one per line) of the drawn set; every episode keeps its start, goal "
        "and noise seed (tools/eval/gate_replay.py writes such a file)",
    )
    p.add_argument("--plot-episodes", type=positive_int, default=3, help="episodes drawn per scene (default 3)")
    p.add_argument("--output-dir", required=True, type=Path, help="folder for report.json and trajectories.png")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def _outputs(out_dir: Path, synthesize: bool) -> list[Path]:
    names = [REPORT_NAME, PLOT_NAME] + ([SCENES_NAME] if synthesize else [])
    return [out_dir / n for n in names]


def _refuse_existing(paths: list[Path]) -> None:
    taken = [str(p) for p in paths if p.exists()]
    if taken:
        raise CliError(
            f"--output-dir: {', '.join(taken)} already exist(s); choose a new --output-dir (never overwritten)"
        )


def _publish(tmp: Path, final: Path) -> None:
    """Moves a finished temporary file into place, failing instead of replacing a file that appeared meanwhile."""
    try:
        os.link(tmp, final)  # link(2) refuses an existing destination, unlike rename(2)
    except FileExistsError:
        raise CliError(f"{final}: appeared while evaluating; nothing was overwritten (result left in {tmp})") from None
    tmp.unlink()


def _checkpoint_info(path: Path) -> dict:
    from verl_omni.data.hashing import file_sha256
    from verl_omni.models.wnm.checkpoint import MANIFEST_NAME, read_manifest

    manifest = read_manifest(path)
    return {
        "path": str(path.resolve()),
        "manifest_sha256": file_sha256(path / MANIFEST_NAME),
        "provenance": manifest.get("provenance", {}),
    }


def _validate(args: argparse.Namespace) -> None:
    from verl_omni.sim.levels import LEVELS
    from verl_omni.sim.reference_policies import SCRIPTED_POLICIES

    if args.checkpoint is None and not args.policy:
        raise CliError("nothing to evaluate: pass --checkpoint DIR and/or --policy NAME...")
    if args.compare is not None and args.checkpoint is None:
        raise CliError("--compare needs --checkpoint (the paired differences are compare - checkpoint)")
    if args.stop_gate_distance is not None and not (args.stop_gate and args.stop_gate_distance > 0):
        raise CliError(f"--stop-gate-distance needs --stop-gate and a distance > 0, got {args.stop_gate_distance}")
    unknown = [p for p in args.policy if p not in SCRIPTED_POLICIES]
    if unknown:
        raise CliError(f"--policy: unknown {unknown}; choose from {list(SCRIPTED_POLICIES)}")
    if len(set(args.policy)) != len(args.policy):
        raise CliError(f"--policy: a name appears twice in {args.policy}")
    from verl_omni.sim.eval_plot import LINE_STYLES

    n_runs = (args.checkpoint is not None) + (args.compare is not None) + len(args.policy)
    if n_runs > len(LINE_STYLES):
        raise CliError(f"{n_runs} policies to evaluate; the trajectory plot draws at most {len(LINE_STYLES)}")
    if args.level is not None and args.level not in LEVELS:
        raise CliError(f"--level: unknown {args.level!r}; choose one of {sorted(LEVELS)}")
    if not args.scenes and args.synthesize <= 0:
        raise CliError("no scenes: pass --scenes DIR... and/or --synthesize N (fresh held-out scenes)")
    if args.synthesize < 0:
        raise CliError(f"--synthesize must be >= 0, got {args.synthesize}")
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if args.num_steps < 2:
        raise CliError(f"--num-steps must be >= 2 (the last denoising step is always Euler), got {args.num_steps}")
    if not args.shift > 0:
        raise CliError(f"--shift must be > 0, got {args.shift}")
    if args.seed < 0:
        raise CliError(f"--seed must be >= 0, got {args.seed}")
    from verl_omni.models.wnm import CheckpointError, read_checkpoint_contract

    for flag, ckpt in (("--checkpoint", args.checkpoint), ("--compare", args.compare)):
        if ckpt is not None and not (ckpt / "config.json").is_file():
            raise CliError(f"{flag} {ckpt}: not a WNM checkpoint directory (no config.json)")
        if ckpt is not None:
            try:  # fail before any evaluation runs, not after the first checkpoint's episodes
                read_checkpoint_contract(ckpt)
            except (CheckpointError, ValueError) as e:
                raise CliError(f"{flag} {ckpt}: {e}") from e
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise CliError(f"--output-dir {args.output_dir}: exists and is not a directory")
    _refuse_existing(_outputs(args.output_dir, args.synthesize > 0))


def _only_episodes(specs: list, path: Path) -> list:
    """The specs whose ids ``path`` lists (one per line, blank lines ignored), in the drawn order.

    Raises:
        CliError: the file cannot be read, lists nothing, or lists an id that was not drawn.
    """
    try:
        wanted = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise CliError(f"--only-episodes {path}: cannot read it ({e})") from e
    if not wanted:
        raise CliError(f"--only-episodes {path}: lists no episode id")
    drawn = {s.episode_id for s in specs}
    unknown = [w for w in wanted if w not in drawn]
    if unknown:
        raise CliError(
            f"--only-episodes {path}: {unknown[:5]} ({len(unknown)} in all) are not among the {len(specs)} drawn "
            "episodes; use the --seed, --episodes and scenes of the run the ids come from"
        )
    keep = set(wanted)
    return [s for s in specs if s.episode_id in keep]


def _configs(args: argparse.Namespace):
    from verl_omni.sim.closed_loop import ClosedLoopConfig
    from verl_omni.sim.collector import CollectorConfig
    from verl_omni.sim.floorplan import FloorPlanConfig
    from verl_omni.sim.levels import get_level

    try:
        loop = ClosedLoopConfig(
            max_steps=args.max_steps, execute_steps=args.execute_steps, collision=args.collision, fov_deg=args.fov_deg
        )
        if args.level is not None:
            level = get_level(args.level)
            tasks = CollectorConfig(success_radius=args.success_radius, min_goal_distance_m=level.min_goal_distance_m,
                                    goal_point=args.goal_point)  # fmt: skip
            plans = level.floorplan()
        else:
            tasks = CollectorConfig(success_radius=args.success_radius, min_goal_distance_m=args.min_goal_distance,
                                    goal_point=args.goal_point)  # fmt: skip
            plans = FloorPlanConfig(size_m=tuple(args.scene_size_m), max_rooms=args.max_rooms)
    except ValueError as e:
        raise CliError(f"invalid evaluation settings: {e}") from e
    if loop.robot_radius != tasks.planner.robot_radius:
        raise CliError("robot radius of the evaluator and the task sampler disagree")
    return loop, tasks, plans


def _load_scenes(args: argparse.Namespace, floorplan_cfg, tasks=None) -> tuple[dict, dict, list]:
    """Scene id -> plan, scene id -> source description, and the plans synthesized here."""
    from verl_omni.sim.collector import SceneError
    from verl_omni.sim.floorplan import FloorPlanError
    from verl_omni.sim.heldout import load_scenes, synthesize_heldout_scenes

    try:
        loaded = load_scenes(args.scenes) if args.scenes else {}
        fresh = []
        if args.synthesize:
            fresh = synthesize_heldout_scenes(args.synthesize, args.seed, floorplan_cfg, task=tasks)
    except (FileNotFoundError, FloorPlanError, SceneError, ValueError) as e:
        raise CliError(str(e)) from e
    plans = {sid: plan for sid, (plan, _) in loaded.items()}
    sources = {sid: str(d.resolve()) for sid, (_, d) in loaded.items()}
    for plan in fresh:
        if plan.scene_id in plans:
            raise CliError(f"--scenes already holds a scene named {plan.scene_id!r}, the name of a synthesized scene")
        plans[plan.scene_id] = plan
        sources[plan.scene_id] = f"synthesized (seed {args.seed}) -> {SCENES_NAME}/{plan.scene_id}"
    return plans, sources, fresh


def _evaluate(label: str, ckpt: Path, args, plans, specs, loop_cfg):
    from verl_omni.models.wnm import CheckpointError
    from verl_omni.sim.loop_pool import reuse_when_in_process, run_closed_loop_pool
    from verl_omni.sim.wnm_policy import WNMPolicy

    factory = functools.partial(
        WNMPolicy.from_checkpoint,
        ckpt,
        device=args.device,
        dtype=args.dtype,
        num_steps=args.num_steps,
        shift=args.shift,
        name=label,
        exact=args.exact_batching,
        stop_votes=args.stop_votes,
        stop_gate=args.stop_gate,
        stop_gate_distance_m=args.stop_gate_distance,
    )
    try:
        policy = factory()  # loads here: a bad checkpoint fails before any worker starts
    except (CheckpointError, ValueError) as e:
        raise CliError(f"{ckpt}: {e}") from e
    numel = policy.backend.layout.numel
    source = reuse_when_in_process(factory, policy, args.workers)
    start = time.perf_counter()
    results, _ = run_closed_loop_pool(source, plans, specs, loop_cfg, args.workers, not args.no_progress, label)
    return results, time.perf_counter() - start, numel


def _evaluate_scripted(name: str, args, plans, specs, loop_cfg):
    from verl_omni.sim.loop_pool import run_closed_loop_pool
    from verl_omni.sim.reference_policies import make_scripted_policy

    factory = functools.partial(make_scripted_policy, name, plans)
    start = time.perf_counter()
    results, _ = run_closed_loop_pool(factory, plans, specs, loop_cfg, args.workers, not args.no_progress, name)
    return results, time.perf_counter() - start


def _jsonable_args(args: argparse.Namespace) -> dict:
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, Path):
            v = str(v)
        elif isinstance(v, list):
            v = [str(x) if isinstance(x, Path) else x for x in v]
        out[k] = v
    return out


def _summary_table(runs: list[tuple[str, dict]], paired: dict | None) -> str:
    from verl_omni.sim.eval_metrics import METRIC_LABELS, SUMMARY_METRICS, format_estimate

    header = (
        ["metric (95% CI)"] + [label for label, _ in runs] + (["difference (compare - checkpoint)"] if paired else [])
    )
    rows = [header]
    for name in SUMMARY_METRICS:
        row = [METRIC_LABELS[name]] + [format_estimate(agg[name]) for _, agg in runs]
        if paired:
            row.append(format_estimate(paired[name]))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _write_outputs(out: Path, fresh: list, plans: dict, specs: list, runs: list, report: dict, args) -> None:
    """Writes scenes (if synthesized), the PNG and the JSON (last), each under a temporary name first."""
    from verl_omni.sim.eval_plot import plot_trajectories

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _refuse_existing(_outputs(out, bool(fresh)))
        if fresh:
            tmp_scenes = Path(tempfile.mkdtemp(prefix=f".{SCENES_NAME}.partial-", dir=out))
            try:
                for plan in fresh:
                    plan.save(tmp_scenes / plan.scene_id)
                if (out / SCENES_NAME).exists():
                    raise CliError(f"{out / SCENES_NAME}: appeared while evaluating; nothing was overwritten")
                tmp_scenes.rename(out / SCENES_NAME)
            finally:
                shutil.rmtree(tmp_scenes, ignore_errors=True)
        tmp_png = out / f".{PLOT_NAME}.tmp-{os.getpid()}"
        plot_trajectories(tmp_png, plans, specs, runs, episodes_per_scene=args.plot_episodes)
        _publish(tmp_png, out / PLOT_NAME)
        tmp_json = out / f".{REPORT_NAME}.tmp-{os.getpid()}"
        tmp_json.write_text(json.dumps(report, indent=1) + "\n")
        _publish(tmp_json, out / REPORT_NAME)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    loop_cfg, task_cfg, floorplan_cfg = _configs(args)
    t0 = time.perf_counter()

    from verl_omni.models.wnm import check_contract_compatibility
    from verl_omni.sim.collector import SceneError
    from verl_omni.sim.eval_metrics import aggregate, paired_differences, stop_gate_summary
    from verl_omni.sim.heldout import sample_episode_specs

    plans, sources, fresh = _load_scenes(args, floorplan_cfg, task_cfg)
    try:
        specs = sample_episode_specs(list(plans.values()), args.episodes, args.seed, task_cfg)
    except SceneError as e:
        raise CliError(f"cannot draw episodes: {e}") from e
    if args.only_episodes is not None:
        specs = _only_episodes(specs, args.only_episodes)
    print(f"{len(specs)} episodes over {len(plans)} scenes ({', '.join(plans)})")

    entries = ([("checkpoint", args.checkpoint)] if args.checkpoint else []) + (
        [("compare", args.compare)] if args.compare else []
    )
    labels = [ckpt.resolve().name for _, ckpt in entries]
    if len(labels) == 2 and labels[0] == labels[1]:
        labels = [f"{labels[0]} (checkpoint)", f"{labels[1]} (compare)"]
    runs, report_runs, numels = [], {}, []
    for (key, ckpt), label in zip(entries, labels, strict=True):
        results, seconds, numel = _evaluate(label, ckpt, args, plans, specs, loop_cfg)
        numels.append(numel)
        per_episode = [r.metrics() for r in results]
        agg = aggregate(per_episode)
        runs.append((label, results, agg))
        episodes = [r.to_dict() for r in results]
        report_runs[key] = {
            "label": label,
            "checkpoint": _checkpoint_info(ckpt),
            "seconds": round(seconds, 3),
            "aggregate": agg,
            "episodes": episodes,
        }
        gate = stop_gate_summary(episodes, task_cfg.success_radius, loop_cfg.execute_steps)
        if gate is not None:
            # Where the gate let STOPs through, on the evaluator's own distances (see stop_gate_summary).
            report_runs[key]["stop_gate"] = gate
    for name in args.policy:
        results, seconds = _evaluate_scripted(name, args, plans, specs, loop_cfg)
        agg = aggregate([r.metrics() for r in results])
        runs.append((name, results, agg))
        report_runs[f"policy:{name}"] = {
            "label": name,
            "policy": name,
            "seconds": round(seconds, 3),
            "aggregate": agg,
            "episodes": [r.to_dict() for r in results],
        }
    comparison = None
    if args.compare:
        contract = check_contract_compatibility(args.checkpoint, args.compare)
        comparison = {
            "paired_differences": paired_differences(
                report_runs["checkpoint"]["episodes"], report_runs["compare"]["episodes"]
            ),
            "contract_compatible": contract.ok,
            "contract_differences": contract.differences,
            "same_initial_noise": numels[0] == numels[1],
        }
        if not contract.ok:
            print(f"note: the checkpoints are not contract-compatible ({len(contract.differences)} differences)")

    report = {
        "format": REPORT_FORMAT,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "arguments": _jsonable_args(args),
        "settings": {
            "closed_loop": {**vars(loop_cfg)},
            "success_radius": task_cfg.success_radius,
            "min_goal_distance_m": task_cfg.min_goal_distance_m,
            "level": args.level,
            "floorplan": {"size_m": list(floorplan_cfg.size_m), "max_rooms": floorplan_cfg.max_rooms},
            "sampler": {
                "mode": "ode",
                "num_steps": args.num_steps,
                "shift": args.shift,
                "stop_votes": args.stop_votes,
                "stop_gate": args.stop_gate,
                "stop_gate_distance_m": args.stop_gate_distance,
            },
            "distance": "geodesic on the occupancy grid (8-connected, un-inflated)",
            "collision_handling": "blocked: translation refused, rotation kept, episode continues"
            if loop_cfg.collision == "block"
            else "the first collision ends the episode",
        },
        "scenes": [{"scene_id": sid, "source": sources[sid]} for sid in plans],
        "episodes": [s.to_dict() for s in specs],
        "runs": report_runs,
        "comparison": comparison,
    }

    out = args.output_dir
    _write_outputs(out, fresh, plans, specs, [(label, results) for label, results, _ in runs], report, args)

    print()
    print(_summary_table([(label, agg) for label, _, agg in runs], comparison and comparison["paired_differences"]))
    print()
    for label, results, _ in runs:
        ends = {r: sum(x.end_reason == r for x in results) for r in ("stop", "max_steps", "collision")}
        calls = sum(x.policy_calls for x in results)
        print(f"{label}: {len(results)} episodes, {calls} policy calls, ends {ends}")
    for run in report_runs.values():
        if "stop_gate" in run:
            g = run["stop_gate"]
            print(
                f"{run['label']}: STOP gate: {g['stop_asked']} calls asked for STOP, {g['allowed']} let through "
                f"({g['allowed_outside_radius']} outside the success radius, true median "
                f"{g['allowed_true_m_median']:.2f} m, gate's {g['allowed_gate_m_median']:.2f} m), {g['blocked']} "
                f"refused ({g['blocked_inside_radius']} inside it); gate - true {g['gate_minus_true_m_mean']:+.2f} m"
            )
    print(f"wrote {out / REPORT_NAME}")
    print(f"wrote {out / PLOT_NAME}")
    if args.synthesize:
        print(f"wrote {out / SCENES_NAME} ({args.synthesize} held-out scenes)")
    print(f"elapsed {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
