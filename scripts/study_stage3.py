#!/usr/bin/env python
"""Stage-III study: does counterfactual, layer-credited GRPO improve the Stage-II policy, and do its parts matter?

Three subcommands, run in this order (see docs/results.md for the study design and the exact commands):

  prepare  (CPU, here)  builds the workspace with the real user commands: training collection, Stage-II
                        stand-in (SFT), converted/sampled/event-val data, held-out evaluation scenes; then
                        packs the slim copy a GPU machine needs into <workdir>/carry (prints its size).
  run      (GPU box)    trains the main recipe x 3 seeds and each ablation x 1 seed concurrently (one process
                        and one Ray runtime per run), exports each run's last checkpoint, evaluates Stage-II and
                        every export closed-loop on the held-out scenes; writes <workdir>/results (partial
                        results as they complete) and, with --pack, one tar.gz of everything but weights.
  report   (CPU, here)  plots (PNG) and Markdown tables with 95% CIs from a results folder or tarball.
  all      (GPU box)    prepare (unless done), run (resumed when an earlier call started it) and report, from one
                        command that is simply repeated after a cut-off (e.g. from a trained Stage-II checkpoint:
                        all --workdir W --stage2-checkpoint CKPT --level two_rooms --goal-point nearest
                        --face-goal-object --gpu --heldout-seed 2000 --eval-episodes 400 --eval-execute-steps 3
                        --stop-gate --val-episodes 100 --val-seed 1000).

Examples:
    python scripts/study_stage3.py prepare --workdir .study
    python scripts/study_stage3.py run --workdir .study --cpu --steps 2          # plumbing dry run
    python scripts/study_stage3.py run --workdir .study --gpu --pack $OUT/study_results.tar.gz
    python scripts/study_stage3.py report --workdir .study --results-tar study_results.tar.gz \\
        --output-dir docs/results --update-doc docs/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import plan as study_plan  # noqa: E402
from study import workspace as study_ws  # noqa: E402

DOC_BEGIN = "<!-- study:generated:begin -->"
DOC_END = "<!-- study:generated:end -->"
CARRY_ARCHIVE = "carry.tar.xz"
FIGURES = (
    "reward_curves.png",
    "validation_events.png",
    "closed_loop.png",
    "closed_loop_validation.png",
    "trajectories.png",
)


class StudyError(Exception):
    """A user-facing error: the message names the flag or file and what to do."""


def human(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


# ---------------------------------------------------------------------------------------------- prepare
def cmd_prepare(args: argparse.Namespace) -> int:
    w = args.workdir
    full_root, carry, archive = w / "full", w / "carry", w / CARRY_ARCHIVE
    for p in (full_root, carry, archive):
        if p.exists():
            raise StudyError(f"--workdir: {p} already exists; choose a new --workdir (never overwritten)")
    try:
        s = study_ws.WorkspaceSettings(
            scenes=args.scenes,
            episodes_per_scene=args.episodes_per_scene,
            collection_seed=args.collection_seed,
            sft_steps=args.sft_steps,
            sft_max_queries=args.sft_max_queries,
            sft_batch_size=args.sft_batch_size,
            sft_lr=args.sft_lr,
            sft_action_weight=args.sft_action_weight,
            train_size=args.train_size,
            per_event=args.per_event,
            heldout_scenes=args.heldout_scenes,
            heldout_seed=args.heldout_seed,
            workers=args.workers,
            stage2_checkpoint=str(args.stage2_checkpoint.resolve()) if args.stage2_checkpoint else "",
            level=args.level,
            goal_point=args.goal_point,
            face_goal_object=args.face_goal_object,
            behaviour_beta=args.behaviour_beta,
            behaviour_execute_steps=args.behaviour_execute_steps,
            behaviour_max_steps=args.behaviour_max_steps,
            behaviour_num_steps=args.behaviour_num_steps,
            device=args.device,
            prompt_event_share=args.prompt_event_share,
        )
    except ValueError as e:
        raise StudyError(str(e)) from e
    t0 = time.time()
    log = w / "prepare.log"
    try:
        full = study_ws.build_full(full_root, s, log)
    except RuntimeError as e:
        raise StudyError(str(e)) from e
    desc = study_ws.pack_carry(full, carry, s)
    ckpt_prov = json.loads((carry / "ckpt" / "checkpoint_manifest.json").read_text()).get("provenance", {})
    print(f"\nworkspace built in {time.time() - t0:.0f}s; log {log}")
    print(f"  full workspace {full_root}: {human(study_ws.dir_bytes(full_root))}")
    for key in ("ckpt", "collection", "scenes", "train", "eventval", "heldout_scenes"):
        print(f"  carry/{key:<15}{human(study_ws.dir_bytes(carry / key)):>10}")
    print(
        f"  carry total     {human(study_ws.dir_bytes(carry)):>10}  ({desc['train_size']} train rows, "
        f"{desc['val_rows']} val rows, {desc['videos']} videos)"
    )
    total = study_ws.write_carry_archive(carry, archive)
    print(f"  {archive}: {human(total)}  <- the one path to carry to the GPU machine")
    if "final_heldout_loss" in ckpt_prov:
        ini, fin = ckpt_prov["initial_heldout_loss"], ckpt_prov["final_heldout_loss"]
        print(
            f"  {'Stage-II checkpoint' if args.stage2_checkpoint else 'Stage-II stand-in'} held-out loss (its own "
            f"training): action {ini['action']:.3f} -> {fin['action']:.3f}, "
            f"video {ini['video']:.3f} -> {fin['video']:.3f}"
        )
    if total > args.carry_limit_mb * 1e6:
        print(f"warning: carry is {human(total)}, above --carry-limit-mb {args.carry_limit_mb}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- run
def _settings(args: argparse.Namespace) -> study_plan.StudySettings:
    kw: dict = {}
    if args.cpu:
        # CPU plumbing check: one actor process per run, tiny step counts.
        kw.update(
            gpus=0,
            cpu_workers=1,
            prompts_per_step=1,
            micro_batch_rollouts=16,
            rollout_micro_batch=16,
            val_max_samples=4,
        )
    for name in ("steps", "lr", "prompts_per_step", "val_freq", "save_freq"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.steps is not None:
        kw.setdefault("val_freq", max(1, args.steps // 10))
        kw.setdefault("save_freq", max(1, args.steps // 10))
    kw["ablation_seeds"] = tuple(args.ablation_seeds)
    kw["main_seeds"] = tuple(args.main_seeds)
    try:
        return study_plan.StudySettings(**kw)
    except ValueError as e:
        raise StudyError(f"run settings: {e}") from e


def _pack(results: Path, carry: Path, dest: Path) -> int:
    """tar.gz of the results without weights (checkpoints, exports), written atomically; returns bytes."""
    if dest.exists():
        raise StudyError(f"--pack {dest}: already exists; choose a new file name")
    dest.parent.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p.startswith("global_step_") or p == "export" for p in parts):
            return None
        return info

    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(results, arcname="results", filter=keep)
        tar.add(carry / "workspace.json", arcname="results/workspace.json")
    os.replace(tmp, dest)
    return dest.stat().st_size


def cmd_run(args: argparse.Namespace) -> int:
    from study.runner import EvalSettings, StudyRunner

    carry = args.workdir / "carry"
    archive = args.workdir / CARRY_ARCHIVE
    results = args.workdir / args.results_name
    if results.exists() and not args.resume:
        raise StudyError(f"{results}: already exists; pass a new --results-name (never overwritten) or --resume")
    if args.resume and not (results / "status.json").is_file():
        raise StudyError(f"--resume: {results / 'status.json'} not found; nothing to resume (run without --resume)")
    if args.pack is not None and args.pack.exists():
        raise StudyError(f"--pack {args.pack}: already exists; choose a new file name")
    try:
        if not carry.exists() and archive.is_file():
            study_ws.extract_carry_archive(archive, carry)
            print(f"extracted {archive} -> {carry}")
        ws = study_ws.load_carry(carry)
    except (FileNotFoundError, ValueError) as e:
        raise StudyError(str(e)) from e
    moved = study_ws.relocate(carry, ws["desc"])
    if moved:
        print(f"relocated manifests to {carry}: {[str(p) for p in moved]}")
    settings = _settings(args)
    try:
        runs = study_plan.plan_runs(settings, tuple(args.arms) if args.arms else None)
    except ValueError as e:
        raise StudyError(f"--arms: {e}") from e
    locked = study_plan.load_locked_recipe()
    configs = [
        (r.name, study_plan.trainer_config(r, settings, ws, results / "runs" / r.name / "out", locked)) for r in runs
    ]
    task = ws["desc"].get("settings", {})
    heldout: dict = {}
    if args.heldout_seed is not None:
        heldout = {
            "synthesize": args.heldout_scenes or 40,
            "seed": args.heldout_seed,
            "level": task.get("level", "house"),
            "goal_point": task.get("goal_point", "random"),
        }
    elif args.heldout_scenes is not None:
        raise StudyError("--heldout-scenes needs --heldout-seed (the carried scenes are used otherwise)")
    common = {"execute_steps": args.eval_execute_steps, "stop_gate": args.stop_gate, "workers": args.eval_workers}
    if args.val_episodes and args.heldout_seed is None:
        raise StudyError("--val-episodes needs --heldout-seed (validation draws its own scenes, like the held-out set)")
    if args.select_by_validation and not args.val_episodes:
        raise StudyError("--select-by-validation needs --val-episodes (it chooses among the validated checkpoints)")
    if args.val_episodes and args.val_seed == args.heldout_seed:
        raise StudyError(f"--val-seed {args.val_seed}: that is the held-out seed; choose another one")
    if args.cpu:
        ev = EvalSettings(
            episodes=args.eval_episodes or 4, max_steps=args.eval_max_steps or 16, device="cpu", **common, **heldout
        )
    else:
        ev = EvalSettings(
            episodes=args.eval_episodes or 96, max_steps=args.eval_max_steps or 128, device="cuda", **common, **heldout
        )
    val = dataclasses.replace(ev, seed=args.val_seed, episodes=args.val_episodes) if args.val_episodes else None
    runner = StudyRunner(
        results,
        configs,
        ws["ckpt"],
        ws["heldout_scenes"],
        ev,
        max_train=args.max_concurrent or (2 if args.cpu else len(configs)),
        max_eval=args.max_eval or (1 if args.cpu else 6),
        train_deadline_s=args.train_deadline_s or (1500.0 if args.cpu else 300.0),
        deadline_s=args.deadline_s or (2400.0 if args.cpu else 450.0),
        threads_per_job=args.threads_per_job or (1 if args.cpu else 2),
        meta={"settings": vars(settings), "workspace": ws["desc"], "argv": sys.argv[1:]},
        resume=args.resume,
        val_settings=val,
        select_by_validation=args.select_by_validation,
        stop_grace_s=300.0 if args.cpu else 120.0,  # a CPU step takes minutes, a GPU step seconds
    )
    print(
        f"study: {len(configs)} runs ({', '.join(n for n, _ in configs)}), {settings.steps} steps each, "
        f"{settings.prompts_per_step} prompts x 16 rollouts per step, lr {settings.lr}; eval {ev.episodes} episodes"
    )
    t0 = time.time()
    state = {}
    try:
        state = runner.run()
    finally:
        if args.pack is not None and results.exists():
            size = _pack(results, carry, args.pack)
            print(f"packed {args.pack} ({human(size)})")
    done = [n for n, s in state.items() if s["state"] == "done"]
    failed = {n: s.get("reason", s["state"]) for n, s in state.items() if s["state"] != "done"}
    print(f"\nstudy finished in {time.time() - t0:.0f}s: {len(done)} done, {len(failed)} not done")
    for name, s in state.items():
        print(f"  {name:<28} {s['state']:<10} steps {s.get('steps_done', '-')!s:<5} {s.get('reason', '')}")
    print(f"results: {results}")
    return 0 if not failed else 1


# ---------------------------------------------------------------------------------------------- all
def cmd_all(args: argparse.Namespace) -> int:
    """prepare -> run -> report, each step skipped or resumed when an earlier call got through it.

    Call it again with the same flags after a cut-off (a machine that gives 10-minute calls): a built workspace
    is reused, a results folder with ``status.json`` is resumed, and the report is written once every run is
    done (``<workdir>/report``, or ``report.<time>`` when that exists).
    """
    w = args.workdir
    if (w / "carry" / "workspace.json").is_file() or (w / CARRY_ARCHIVE).is_file():
        print(f"== prepare: reusing the workspace in {w}")
    else:
        print("== prepare", flush=True)
        if cmd_prepare(args) not in (0, 1):  # 1: the carry copy is above --carry-limit-mb, a warning here
            return 2
    results = w / args.results_name
    args.resume = (results / "status.json").is_file()
    if args.pack is not None and args.pack.exists():  # an earlier call's tarball: kept, this call writes beside it
        args.pack = args.pack.with_name(f"{int(time.time())}-{args.pack.name}")
        print(f"--pack exists; this call packs to {args.pack}")
    print(f"== run{' (resuming)' if args.resume else ''}", flush=True)
    rc = cmd_run(args)
    if rc != 0:
        print("not every run is done; call the same command again to go on", file=sys.stderr)
        return rc
    out = w / "report"
    if out.exists():
        out = w / f"report.{int(time.time())}"
    print(f"== report -> {out}", flush=True)
    report_args = argparse.Namespace(results=results, results_tar=None, output_dir=out, update_doc=None, smooth=10)
    return cmd_report(report_args)


# ---------------------------------------------------------------------------------------------- report
def _results_from_tar(tar_path: Path, workdir: Path) -> Path:
    dest = workdir / f"results_from_{tar_path.name.split('.')[0]}"
    if dest.exists():
        print(f"using already extracted {dest}")
        return dest / "results"
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=workdir))
    with tarfile.open(tar_path, "r:gz") as tar:
        tar.extractall(tmp, filter="data")
    if not (tmp / "results" / "status.json").is_file():
        shutil.rmtree(tmp)
        raise StudyError(f"--results-tar {tar_path}: no results/status.json inside; is it a `run --pack` file?")
    tmp.rename(dest)
    return dest / "results"


def _update_doc(doc: Path, block: str) -> None:
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise StudyError(f"--update-doc {doc}: markers {DOC_BEGIN} / {DOC_END} not found; add them where tables go")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    tmp = doc.with_name(f".{doc.name}.tmp-{os.getpid()}")
    tmp.write_text(f"{head}{DOC_BEGIN}\n{block}{DOC_END}{tail}")
    os.replace(tmp, doc)


def cmd_report(args: argparse.Namespace) -> int:
    from study import plots
    from study import report as rep

    if args.results_tar is not None:
        if not args.results_tar.is_file():
            raise StudyError(f"--results-tar {args.results_tar}: not a file")
        results = _results_from_tar(args.results_tar, args.workdir)
    else:
        results = args.results or args.workdir / "results"
    out = args.output_dir
    taken = [str(out / n) for n in (*FIGURES, "tables.md", "summary.json") if (out / n).exists()]
    if taken:
        raise StudyError(f"--output-dir: {', '.join(taken)} already exist(s); choose a new --output-dir")
    try:
        data = rep.load_results(results)
    except (FileNotFoundError, ValueError) as e:
        raise StudyError(str(e)) from e
    comps = rep.closed_loop_comparisons(data)
    out.mkdir(parents=True, exist_ok=True)
    plots.reward_curves(data, out / FIGURES[0], window=args.smooth)
    plots.validation_curves(data, out / FIGURES[1])
    figures = [FIGURES[0], FIGURES[1]]
    if comps:
        plots.closed_loop_bars(comps, out / FIGURES[2])
        figures.append(FIGURES[2])
    if plots.closed_loop_validation(data, out / FIGURES[3]):
        figures.append(FIGURES[3])
    # Stage II beside the first main seed on the same held-out episodes (the first scenes, 3 episodes each).
    main_runs = [r.name for r in data.arm_runs("main") if r.episodes is not None]
    try:
        traj = rep.load_trajectories(results, [rep.STAGE2, *main_runs[:1]])
    except (ValueError, KeyError) as e:  # other episodes, or a report written without trajectories: no figure
        print(f"warning: no trajectories.png: {type(e).__name__}: {e}", file=sys.stderr)
        traj = None
    if traj is not None:
        plots.trajectory_comparison(traj, out / FIGURES[4])
        figures.append(FIGURES[4])
    rel = os.path.relpath(out, args.update_doc.parent) if args.update_doc else str(out)
    block = rep.render_markdown(data, comps, [f"{rel}/{f}" for f in figures], _display_path(results))
    (out / "tables.md").write_text(block)
    (out / "summary.json").write_text(json.dumps(rep.summary_json(data, comps), indent=1, default=list) + "\n")
    if args.update_doc:
        _update_doc(args.update_doc, block)
        print(f"updated {args.update_doc}")
    print(block)
    for f in (*figures, "tables.md", "summary.json"):
        print(f"wrote {out / f} ({(out / f).stat().st_size / 1e3:.0f} kB)")
    return 0


def _display_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it, else its name: committed docs must not
    carry one machine's absolute paths."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return Path(path).name


# ---------------------------------------------------------------------------------------------- CLI
def _add_prepare_args(pp: argparse.ArgumentParser, d: study_ws.WorkspaceSettings) -> None:
    """Flags of `prepare` (and of `all`)."""
    pp.add_argument("--scenes", type=int, default=d.scenes, help=f"training scenes ({d.scenes})")
    pp.add_argument("--episodes-per-scene", type=int, default=d.episodes_per_scene)
    pp.add_argument("--collection-seed", type=int, default=d.collection_seed)
    pp.add_argument("--sft-steps", type=int, default=d.sft_steps, help=f"Stage-II stand-in steps ({d.sft_steps})")
    pp.add_argument("--sft-max-queries", type=int, default=d.sft_max_queries)
    pp.add_argument("--sft-batch-size", type=int, default=d.sft_batch_size)
    pp.add_argument("--sft-lr", type=float, default=d.sft_lr)
    pp.add_argument("--sft-action-weight", type=float, default=d.sft_action_weight)
    pp.add_argument("--train-size", type=int, default=d.train_size, help=f"training prompts ({d.train_size})")
    pp.add_argument("--per-event", type=int, default=d.per_event, help="validation rows per event type")
    pp.add_argument(
        "--prompt-event-share",
        default=d.prompt_event_share,
        metavar="EVENT=SHARE",
        help="take this share of the training prompts from query states with EVENT, e.g. collision_precursor=0.25 "
        "(tools/data/sample_stage3_train.py --event-share; default: one uniform state per episode)",
    )
    pp.add_argument("--workers", type=int, default=d.workers)
    pp.add_argument("--carry-limit-mb", type=float, default=8.0, help="warn (exit 1) above this carry size")
    pp.add_argument(
        "--stage2-checkpoint",
        type=Path,
        help="a trained Stage-II checkpoint (e.g. a scripts/train_stage2.py DAgger round): no stand-in is trained, "
        "and the Stage-III collection is gathered with it as the behaviour policy (tools/data/collect_dagger.py)",
    )
    pp.add_argument("--level", default=d.level, help=f"task level of the collection and held-out scenes ({d.level})")
    pp.add_argument("--goal-point", choices=("random", "nearest"), default=d.goal_point, help="goal rule")
    pp.add_argument("--face-goal-object", action="store_true", help="the expert turns to the object before STOP")
    pp.add_argument(
        "--behaviour-beta",
        type=float,
        default=d.behaviour_beta,
        help=f"with --stage2-checkpoint: expert share of the collection's policy calls ({d.behaviour_beta})",
    )
    pp.add_argument(
        "--behaviour-execute-steps",
        type=int,
        default=d.behaviour_execute_steps,
        help=f"with --stage2-checkpoint: steps the behaviour policy executes per call ({d.behaviour_execute_steps})",
    )
    pp.add_argument("--behaviour-max-steps", type=int, default=d.behaviour_max_steps, help="steps per episode")
    pp.add_argument("--behaviour-num-steps", type=int, default=d.behaviour_num_steps, help="behaviour ODE steps")
    pp.add_argument("--device", default=d.device, help=f"torch device of the behaviour policy ({d.device})")


def _add_run_args(pr: argparse.ArgumentParser) -> None:
    """Flags of `run` (and of `all`) but --workdir and the held-out ones."""
    dev = pr.add_mutually_exclusive_group(required=True)
    dev.add_argument("--gpu", action="store_true", help="one GPU, all runs concurrently on it")
    dev.add_argument("--cpu", action="store_true", help="CPU plumbing check (use tiny --steps)")
    pr.add_argument("--steps", type=int, help="training steps per run (default 120)")
    pr.add_argument("--lr", type=float, help="actor learning rate (default 1e-4)")
    pr.add_argument("--prompts-per-step", type=int, help="prompts per step (default 4, 16 rollouts each)")
    pr.add_argument("--val-freq", type=int, help="validation interval in steps")
    pr.add_argument("--save-freq", type=int, help="checkpoint interval in steps")
    pr.add_argument("--arms", nargs="+", help=f"subset of arms (default all: {list(study_plan.ARM_BY_NAME)})")
    pr.add_argument("--main-seeds", type=int, nargs="+", default=[1, 2, 3])
    pr.add_argument("--ablation-seeds", type=int, nargs="+", default=[1])
    pr.add_argument("--max-concurrent", type=int, help="trainings at once (default: all on GPU, 2 on CPU)")
    pr.add_argument("--max-eval", type=int, help="exports/evaluations at once (default 6 on GPU, 1 on CPU)")
    pr.add_argument("--threads-per-job", type=int, help="OMP_NUM_THREADS per job (default 2 GPU, 1 CPU)")
    pr.add_argument("--eval-episodes", type=int, help="closed-loop episodes (default 96 GPU, 4 CPU)")
    pr.add_argument("--eval-max-steps", type=int, help="closed-loop step limit (default 128 GPU, 16 CPU)")
    pr.add_argument("--train-deadline-s", type=float, help="stop trainings after this (300 GPU, 1500 CPU)")
    pr.add_argument("--deadline-s", type=float, help="stop everything after this (450 GPU, 2400 CPU)")
    pr.add_argument("--results-name", default="results", help="results folder inside --workdir")
    pr.add_argument("--pack", type=Path, help="write a tar.gz of the results (no weights) here")
    pr.add_argument("--eval-execute-steps", type=int, default=8, help="action steps executed per policy call (8)")
    pr.add_argument("--stop-gate", action="store_true", help="evaluate with the checkpoints' STOP gate")
    pr.add_argument("--eval-workers", type=int, default=1, help="processes per evaluation (default 1)")
    pr.add_argument(
        "--val-episodes",
        type=int,
        default=0,
        help="closed-loop validation during training: every saved checkpoint is exported and evaluated on this "
        "many episodes of --val-seed while the training goes on (default 0: off; needs --heldout-seed)",
    )
    pr.add_argument("--val-seed", type=int, default=1000, help="seed of the validation episodes (default 1000)")
    pr.add_argument(
        "--select-by-validation",
        action="store_true",
        help="export and evaluate each run's checkpoint with the best closed-loop validation SR (ties: the later "
        "one) instead of its last; needs --val-episodes",
    )
    pr.add_argument(
        "--resume",
        action="store_true",
        help="go on with --results-name from an earlier call: finished runs are kept, trainings resume from "
        "their last checkpoint, cut-off evaluations run again",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = study_ws.WorkspaceSettings()

    pp = sub.add_parser("prepare", help="build the workspace and its carry copy (CPU)")
    pp.add_argument("--workdir", type=Path, required=True, help="study folder (git-ignored, e.g. .study)")
    pp.add_argument("--heldout-scenes", type=int, default=d.heldout_scenes)
    pp.add_argument("--heldout-seed", type=int, default=d.heldout_seed)
    _add_prepare_args(pp, d)
    pp.set_defaults(func=cmd_prepare)

    pr = sub.add_parser("run", help="train, export and evaluate every run (GPU box; --cpu for a dry run)")
    pr.add_argument("--workdir", type=Path, required=True)
    pr.add_argument(
        "--heldout-seed",
        type=int,
        help="evaluate on scenes and episodes the evaluator draws from this held-out seed (closed_loop_eval.py "
        "--synthesize --seed, on the workspace's level and goal rule); default: the workspace's held-out scenes",
    )
    pr.add_argument("--heldout-scenes", type=int, help="with --heldout-seed: scenes drawn (default 40)")
    _add_run_args(pr)
    pr.set_defaults(func=cmd_run)

    pa = sub.add_parser(
        "all",
        help="prepare (unless done), run (resuming an earlier call's results) and report, from one command",
    )
    pa.add_argument("--workdir", type=Path, required=True)
    pa.add_argument("--heldout-scenes", type=int, default=40, help="held-out scenes the evaluator draws (40)")
    pa.add_argument("--heldout-seed", type=int, required=True, help="held-out seed of scenes, episodes and noise")
    _add_prepare_args(pa, d)
    _add_run_args(pa)
    pa.set_defaults(func=cmd_all)

    pt = sub.add_parser("report", help="plots and tables from a results folder or tarball")
    pt.add_argument("--workdir", type=Path, required=True)
    pt.add_argument("--results", type=Path, help="results folder (default <workdir>/results)")
    pt.add_argument("--results-tar", type=Path, help="tar.gz written by `run --pack` (extracted into --workdir)")
    pt.add_argument("--output-dir", type=Path, required=True, help="folder for PNGs, tables.md, summary.json")
    pt.add_argument("--update-doc", type=Path, help="replace the generated block of this Markdown file")
    pt.add_argument("--smooth", type=int, default=10, help="trailing-mean window of training curves (10)")
    pt.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Absolute paths: trainer configs and manifests written from them must not depend on a working directory.
    args.workdir = args.workdir.resolve()
    try:
        return args.func(args)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
