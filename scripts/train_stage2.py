#!/usr/bin/env python
"""Stage II from one command: expert SFT, then closed-loop DAgger-SFT rounds, each checkpoint evaluated.

Round 0 synthesizes a noisy-expert collection of the task level (``tools/data/synthesize_gn0_collection.py``)
and trains the WNM model on it with joint flow matching. Round r >= 1 lets the round r-1 checkpoint drive
(mixed with the expert at probability ``beta_r = beta0 * decay**(r-1)``) in fresh training scenes, relabels
every visited state with the expert (``verl_omni/sim/dagger.py``), aggregates the new data with all earlier
rounds' and continues training. After every round the checkpoint is evaluated in closed loop on held-out
scenes (their own seed stream), next to the scripted baselines of the level on the same episodes, and probed
open-loop (``verl_omni/sim/probes.py``). Every checkpoint carries a README (data, steps, settings, licence).

Outputs under ``--workdir``: ``data/r<k>`` collections, ``ckpt/stage2_r<k>`` checkpoints,
``eval/<name>.json`` closed-loop reports, ``probes.json``, ``summary.json`` and ``summary.md``. A stage whose
output exists is reused, so a rerun with the same flags resumes.

Example (one H200, a few minutes):
    python scripts/train_stage2.py --workdir runs/s2 --level two_rooms --scenes 300 --rounds 3 --device cuda \\
        --workers 16 --eval-episodes 400
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINES = ("expert", "object_expert", "goal_bearing", "straight", "stop")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Stage II: expert SFT + closed-loop DAgger-SFT rounds, evaluated.")
    p.add_argument("--workdir", required=True, type=Path, help="run folder (created; stages found there are reused)")
    p.add_argument("--level", default="two_rooms", help="task level: one_room, two_rooms, house (default two_rooms)")
    p.add_argument("--size", default="tiny", help="WNMConfig size preset (default tiny)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="WNMConfig override")
    p.add_argument(
        "--init-checkpoint",
        type=Path,
        help="start round 0 from this Stage-II checkpoint (its weights, encoders, action normalization and STOP "
        "gate) instead of a fresh model, e.g. a one_room checkpoint for two_rooms (a curriculum over task levels); "
        "--size/--set are then refused (the model is the checkpoint's)",
    )
    p.add_argument("--scenes", type=int, default=200, help="scenes of the round-0 collection (default 200)")
    p.add_argument("--episodes-per-scene", type=int, default=4, help="episodes per scene (default 4)")
    p.add_argument(
        "--goal-variants",
        type=int,
        default=1,
        help="goals every round-0 trajectory is labelled for (synthesize_gn0_collection.py --goal-variants; default 1)",
    )
    from verl_omni.sim.label_args import add_label_arguments

    add_label_arguments(p)
    p.add_argument("--rounds", type=int, default=2, help="rounds in all, round 0 included (default 2)")
    p.add_argument("--dagger-scenes", type=int, default=100, help="fresh scenes per DAgger round (default 100)")
    p.add_argument("--beta0", type=float, default=0.5, help="expert share of round 1 (default 0.5)")
    p.add_argument("--beta-decay", type=float, default=0.5, help="beta factor per later round (default 0.5)")
    p.add_argument(
        "--sft-steps",
        type=int,
        default=4000,
        help="SFT steps of round 0 (default 4000); 0 with --init-checkpoint: round 0 is that checkpoint unchanged "
        "and its collection is encoded for the DAgger rounds to aggregate (DAgger rounds from a checkpoint trained "
        "elsewhere, e.g. one carried from an earlier machine)",
    )
    p.add_argument("--round-steps", type=int, default=2000, help="SFT steps of every later round (default 2000)")
    p.add_argument(
        "--dagger-share",
        type=float,
        default=None,
        help="share of every SFT batch of a DAgger round drawn from that round's own rows, the rest from the "
        "aggregate of earlier rounds (SFTConfig.newest_share; default: every aggregated row equally likely, i.e. "
        "the new rows' share of the aggregate)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="SFT rows per step (default 64)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    p.add_argument("--action-weight", type=float, default=4.0, help="weight of the action loss (default 4)")
    p.add_argument(
        "--goal-aux-weight",
        type=float,
        default=0.0,
        help="weight of the auxiliary goal-direction loss in SFT (models/wnm/goal_probe.py; default 0: off)",
    )
    p.add_argument(
        "--view-aux-weight",
        type=float,
        default=0.0,
        help="weight of the auxiliary view-grounding loss in SFT: is the named object in the current frame, where "
        "(goal_probe.ObjectViewProbe; default 0: off)",
    )
    p.add_argument(
        "--independent-action-noise",
        type=float,
        default=0.0,
        help="share of SFT rows whose actions get a noise level of their own (SFTConfig; default 0: off)",
    )
    p.add_argument(
        "--goal-aux-pure-noise",
        type=float,
        default=0.0,
        help="share of SFT rows at pure noise that carry the goal-direction loss (SFTConfig; default 0: all rows)",
    )
    p.add_argument(
        "--train-encoders",
        default="text_encoder,image_encoder,geometry_encoder",
        help="built-in encoders trained with the DiT, comma-separated, or 'none' (default: all three)",
    )
    p.add_argument("--eval-scenes", type=int, default=40, help="held-out scenes (default 40)")
    p.add_argument("--eval-episodes", type=int, default=400, help="held-out episodes (default 400)")
    p.add_argument("--eval-seed", type=int, default=1000, help="seed of held-out scenes and episodes (default 1000)")
    p.add_argument(
        "--eval-stop-votes",
        type=int,
        nargs="+",
        default=[1],
        help="also evaluate every checkpoint with these STOP votes per call (WNMPolicy.stop_votes; default 1 only)",
    )
    p.add_argument(
        "--eval-stop-gate",
        action="store_true",
        help="also evaluate every checkpoint with its STOP gate (models/wnm/stop_gate.py: STOP only where the view "
        "head sees the named object within the expert's stopping distance), with the largest --eval-stop-votes; "
        "needs --view-aux-weight > 0",
    )
    p.add_argument(
        "--eval-plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="evaluate every checkpoint without its STOP gate too (default); --no-eval-plain keeps only the gated "
        "evaluation (needs --eval-stop-gate) and saves one closed-loop pass per evaluated round",
    )
    p.add_argument(
        "--eval-rounds",
        type=int,
        nargs="*",
        default=None,
        help="rounds evaluated in closed loop and probed (default: every round; the flag alone: none); an unlisted "
        "round keeps the reports an earlier call wrote, so a run split over several GPU calls spends its device time "
        "on the rounds that matter",
    )
    p.add_argument(
        "--matmul-precision",
        choices=("highest", "high", "medium"),
        default="high",
        help="torch.set_float32_matmul_precision while a round encodes and trains: 'high' lets CUDA float32 matmuls "
        "use TF32 tensor cores (default; several times faster on Ampere and Hopper, about 1e-3 relative rounding), "
        "'highest' keeps full float32; evaluation and DAgger driving always run at full float32 (their numbers do "
        "not depend on this flag or on how many processes drive); no effect on CPU",
    )
    p.add_argument(
        "--sft-autocast",
        choices=("none", "bfloat16"),
        default="none",
        help="bfloat16: SFT forwards under torch.autocast (float32 weights and optimizer; see "
        "scripts/bench_stage2_sft.py for what it saves); default none",
    )
    p.add_argument(
        "--sft-ema-decay",
        type=float,
        default=0.0,
        metavar="DECAY",
        help="save the exponential moving average of the SFT weights (this decay, e.g. 0.999; ramped up over the "
        "first steps) instead of the last iterate (SFTConfig.ema_decay); default 0, off",
    )
    p.add_argument(
        "--compile-blocks",
        action="store_true",
        help="torch.compile the DiT blocks for SFT (WNMTransformer.compile_blocks; the first steps pay for compiling)",
    )
    p.add_argument(
        "--reuse-encoded",
        type=Path,
        default=None,
        metavar="RUN",
        help="take over round 0's encoded rows from RUN (another run's --workdir whose round 0 encoded the same "
        "collection with a model of the same lineage, e.g. the previous chained DAgger round's replay), recomputing "
        "only the trained encoders' features, instead of decoding and encoding the collection again; used only when "
        "the collection digest and the rows fingerprint (VAE, latent statistics, action normalization, config, "
        "untrained encoders) match, otherwise round 0 is encoded as usual and the reason is logged",
    )
    p.add_argument(
        "--encode-batch",
        type=int,
        default=None,
        help="query states per encoder call when a round's collection is encoded (default 256 on CUDA, where it "
        "encoded 2.1x faster than 64 on an H100, docs/benchmarks.md; 64 elsewhere, which bounds the VAE's "
        "activations in host memory)",
    )
    p.add_argument(
        "--profile-sft-steps",
        type=int,
        default=0,
        help="profile this many SFT steps of every trained round with torch.profiler, after 20 steps of warm-up "
        "(fewer when the round is short), and write the operators by device and by host time to "
        "<workdir>/profile/r<k>_sft.txt (default 0: off)",
    )
    p.add_argument(
        "--sft-snapshot-s",
        type=float,
        default=30.0,
        help="seconds of SFT between snapshots of the round in progress (weights, optimizer, random state; in "
        "data/r<k>.encoded/sft.pt): a run cut off during SFT goes on from the last one (default 30; 0 = every step)",
    )
    p.add_argument(
        "--eval-execute-steps",
        type=int,
        default=8,
        help="action steps a checkpoint executes per policy call in the closed-loop evaluation (default 8, one "
        "chunk; fewer replans more often, e.g. 3; reports of other values than 8 are labelled <name>_x<steps>); the "
        "scripted baselines keep 8",
    )
    p.add_argument(
        "--dagger-execute-steps",
        type=int,
        default=8,
        help="action steps the DAgger behaviour policy executes per call (default 8, one chunk)",
    )
    p.add_argument("--probe-states", type=int, default=256, help="held-out states of the open-loop probes (256)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, SFT and DAgger draws (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU processes (default: all cores)")
    p.add_argument(
        "--drive-workers",
        type=int,
        default=None,
        help="processes driving closed-loop episodes (evaluation, DAgger), each with its own policy copy "
        "(default: --workers)",
    )
    p.add_argument(
        "--synthesize-only",
        action="store_true",
        help="write the round-0 collection (data/r0) and exit: lets a curriculum synthesize the next level on spare "
        "cores while the GPU trains the current one (scripts/stage2_curriculum.sh)",
    )
    p.add_argument("--skip-baselines", action="store_true", help="do not evaluate the scripted baselines here")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def _log(msg: str) -> None:
    print(f"[stage2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def synthesize_collection(
    out: Path,
    *,
    scenes: int,
    episodes_per_scene: int,
    seed: int,
    workers: int,
    level: str,
    goal_variants: int,
    label_expert: str,
    face_goal_object: bool = False,
    image_size: tuple[int, int] | None = None,
    goal_point: str = "random",
    log=print,
) -> None:
    """Builds a noisy-expert GN0 collection in ``out`` (occupancy scenes in ``<out>_occ``) unless one is there.

    Runs ``tools/data/synthesize_gn0_collection.py`` in a child process (it writes to temporary folders and
    renames them, so a collection that exists is complete). Shared with ``scripts/probe_grounding.py``.
    """
    from verl_omni.sim.label_args import label_flags

    if (out / "collection.json").is_file():
        log(f"reusing {out}")
        return
    cmd = [
        sys.executable, str(REPO / "tools/data/synthesize_gn0_collection.py"), "--output-dir", str(out),
        "--occupancy-dir", str(out.with_name(out.name + "_occ")), "--num-scenes", str(scenes),
        "--episodes-per-scene", str(episodes_per_scene), "--seed", str(seed), "--workers", str(workers),
        "--level", level, "--goal-variants", str(goal_variants),
        *label_flags(label_expert, face_goal_object, goal_point),
    ]  # fmt: skip
    if image_size is not None:
        cmd += ["--image-size", *map(str, image_size)]
    log(" ".join(cmd[1:]))
    subprocess.run(cmd, check=True)


def _synthesize(args, out: Path) -> None:
    synthesize_collection(
        out, scenes=args.scenes, episodes_per_scene=args.episodes_per_scene, seed=args.seed, workers=args.workers,
        level=args.level, goal_variants=args.goal_variants, label_expert=args.label_expert,
        face_goal_object=args.face_goal_object, goal_point=args.goal_point,
        image_size=tuple(args.image_size), log=_log,
    )  # fmt: skip


def _readme(name: str, args, rnd: int, provenance: dict, evaluation: dict | None, model_config=None) -> str:
    """The model card saved as the checkpoint's README.md (listed in its manifest, so written once, at save time).

    Args:
        model_config: The saved model's ``WNMConfig``; its transformer dims are named (with ``--init-checkpoint``
            they come from that checkpoint, not from ``--size``).
    """
    from verl_omni.models.wnm.model_card import lineage_section

    dims = (
        ""
        if model_config is None
        else f" ({model_config.num_layers} layers, {model_config.num_heads} heads x {model_config.head_dim}, "
        f"FFN {model_config.ffn_dim})"
    )
    lines = [
        f"# {name}",
        "",
        f"WNM world-action model, Stage II (round {rnd} of closed-loop DAgger-SFT), size `{args.size}`{dims} on the "
        f"synthetic `{args.level}` task level. Trained by `scripts/train_stage2.py`.",
        "",
        "## Data",
        f"- round 0: noisy-expert collection, {args.scenes} scenes x {args.episodes_per_scene} episodes (seed "
        f"{args.seed})"
        + (
            f"; rounds 1..{rnd}: DAgger rounds of {args.dagger_scenes} fresh scenes each, driven by the previous "
            f"checkpoint (executing {args.dagger_execute_steps} of its 8 steps a call) mixed with the expert at "
            f"expert share {args.beta0} x {args.beta_decay}^(round - 1), relabelled by the expert; every round "
            "trains on all rounds' rows so far."
            if rnd > 0
            else "."
        ),
        f"- query states used: {provenance.get('train_rows', '?')} training rows.",
        *(
            [
                f"- round 0 {'is' if args.sft_steps == 0 else 'started from'} `{args.init_checkpoint.name}` (manifest "
                f"sha256 {_checkpoint_digest(args.init_checkpoint)[:12]})"
                + (
                    ", unchanged: this run trained only the DAgger rounds."
                    if args.sft_steps == 0
                    else ", not from a fresh model."
                )
            ]
            if args.init_checkpoint is not None
            else []
        ),
        f"- task: goal point `{args.goal_point}` next to the named object, labelled by the `{args.label_expert}` expert"
        + (", which turns to face the object before its STOP." if args.face_goal_object else "."),
        "",
        "## Training",
        f"- joint flow matching (video + actions), AdamW lr {args.lr}, batch {args.batch_size}, action weight "
        f"{args.action_weight}; steps: {provenance.get('sft_steps_total', '?')} in all; seed {args.seed}; device "
        f"{args.device}, {'float32' if args.sft_autocast == 'none' else 'autocast ' + args.sft_autocast}"
        f"{', DiT blocks compiled (--compile-blocks)' if getattr(args, 'compile_blocks', False) else ''}"
        f"{f'; weights: moving average, decay {args.sft_ema_decay}' if getattr(args, 'sft_ema_decay', 0) else ''}.",
        f"- model: that of `{args.init_checkpoint.name}`."
        if args.init_checkpoint is not None
        else f"- model settings over `{args.size}`: {', '.join(args.set) if args.set else 'none'}.",
    ]
    if provenance.get("stop_gate"):
        lines.append(
            f"- `stop_gate/`: the view-grounding head, kept as a STOP gate (STOP only where it sees the named object "
            f"within {provenance['stop_gate']['stop_distance_m']:.2f} m; `WNMPolicy(stop_gate=...)`, "
            "`closed_loop_eval.py --stop-gate`)."
        )
    lines += lineage_section(args.init_checkpoint)
    lines += [
        "",
        "## Evaluation",
    ]
    if evaluation:
        lines.append(
            f"- closed loop on {evaluation['episodes']} held-out episodes (seed {args.eval_seed}): SR "
            f"{evaluation['success']['mean']:.3f} [{evaluation['success']['low']:.3f}, "
            f"{evaluation['success']['high']:.3f}], collisions/ep {evaluation['collisions']['mean']:.2f}."
        )
    else:
        lines.append("- see `summary.md` of the run.")
    lines += [
        "",
        "## Licence",
        "Apache-2.0, like the code that made it. The synthetic data and the built-in encoders carry no third-party "
        "weights.",
        "",
    ]
    return "\n".join(lines)


def _evaluate(policy_factory, label: str, plans, specs, out: Path, workers: int, progress: bool,
              execute_steps: int = 8) -> dict:  # fmt: skip
    from verl_omni.sim.closed_loop import ClosedLoopConfig
    from verl_omni.sim.eval_metrics import aggregate
    from verl_omni.sim.loop_pool import run_closed_loop_pool

    if out.is_file():
        return json.loads(out.read_text())["aggregate"]
    t0 = time.perf_counter()
    loop = ClosedLoopConfig(execute_steps=execute_steps)
    results, _ = run_closed_loop_pool(policy_factory, plans, specs, loop, workers, progress, label)
    agg = aggregate([r.metrics() for r in results])
    # The specs travel with the results so that later analyses (tools/eval/episode_strata.py) can check that they
    # draw the same episodes: ids alone (h0000_ev000, ...) repeat across seeds and levels.
    report = {"label": label, "seconds": time.perf_counter() - t0, "execute_steps": execute_steps, "aggregate": agg,
              "episodes": [r.metrics() for r in results], "specs": [s.to_dict() for s in specs]}  # fmt: skip
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report) + "\n")
    tmp.replace(out)
    _log(f"{label}: SR {agg['success']['mean']:.3f} collisions/ep {agg['collisions']['mean']:.2f} "
         f"({report['seconds']:.0f}s)")  # fmt: skip
    return agg


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad flags before any work starts (nothing is written)."""
    from verl_omni.sim.levels import LEVELS

    if args.level not in LEVELS:
        parser.error(f"--level: unknown {args.level!r}; choose one of {sorted(LEVELS)}")
    for flag in ("scenes", "episodes_per_scene", "goal_variants", "rounds", "dagger_scenes", "round_steps",
                 "batch_size", "eval_scenes", "eval_episodes", "probe_states", "workers",
                 "eval_execute_steps", "dagger_execute_steps"):  # fmt: skip
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.sft_steps < 0 or (args.sft_steps == 0 and args.init_checkpoint is None):
        parser.error(f"--sft-steps must be >= 1 (or 0 with --init-checkpoint: round 0 keeps that checkpoint's "
                     f"weights), got {args.sft_steps}")  # fmt: skip
    if args.drive_workers is None:
        args.drive_workers = args.workers
    if args.drive_workers < 1:
        parser.error(f"--drive-workers must be >= 1, got {args.drive_workers}")
    if args.eval_rounds is not None and not all(0 <= r < args.rounds for r in args.eval_rounds):
        parser.error(f"--eval-rounds must name rounds in 0..{args.rounds - 1} (--rounds {args.rounds}), got "
                     f"{args.eval_rounds}")  # fmt: skip
    if not args.sft_snapshot_s >= 0:
        parser.error(f"--sft-snapshot-s must be >= 0 seconds, got {args.sft_snapshot_s}")
    if not 0.0 <= args.sft_ema_decay < 1.0:
        parser.error(f"--sft-ema-decay must be in [0, 1) (0 = off, e.g. 0.999), got {args.sft_ema_decay}")
    if min(args.eval_stop_votes) < 1:
        parser.error(f"--eval-stop-votes must be >= 1, got {args.eval_stop_votes}")
    if args.init_checkpoint is not None:
        if not (args.init_checkpoint / "checkpoint_manifest.json").is_file():
            parser.error(
                f"--init-checkpoint {args.init_checkpoint}: not a complete checkpoint (no checkpoint_manifest.json)"
            )
        if args.set or args.size != parser.get_default("size"):
            parser.error("--init-checkpoint: the model is the checkpoint's; drop --size/--set")
    if args.eval_stop_gate and args.view_aux_weight <= 0:
        parser.error("--eval-stop-gate needs --view-aux-weight > 0 (the gate is the view head)")
    if not args.eval_plain and not args.eval_stop_gate:
        parser.error("--no-eval-plain needs --eval-stop-gate (otherwise no round would be evaluated)")
    if args.probe_states < 2:
        parser.error("--probe-states must be >= 2 (the ablations swap inputs between states)")
    for flag in ("beta0", "beta_decay"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            parser.error(f"--{flag.replace('_', '-')} must be in [0, 1], got {getattr(args, flag)}")
    if not (args.lr > 0 and args.action_weight >= 0 and args.goal_aux_weight >= 0 and args.view_aux_weight >= 0):
        parser.error(f"--lr must be > 0, --action-weight, --goal-aux-weight and --view-aux-weight >= 0, got "
                     f"{args.lr}, {args.action_weight}, {args.goal_aux_weight}, {args.view_aux_weight}")  # fmt: skip
    for name in ("independent_action_noise", "goal_aux_pure_noise"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.dagger_share is not None and not 0.0 <= args.dagger_share <= 1.0:
        parser.error(f"--dagger-share must be in [0, 1], got {args.dagger_share}")
    if args.profile_sft_steps < 0:
        parser.error(f"--profile-sft-steps must be >= 0 (0 = off), got {args.profile_sft_steps}")
    if args.reuse_encoded is not None and not (args.reuse_encoded / "data").is_dir():
        parser.error(f"--reuse-encoded {args.reuse_encoded}: not a train_stage2.py run folder (no data/); name the "
                     "--workdir of the run whose round-0 rows to take over")  # fmt: skip
    if args.encode_batch is not None and args.encode_batch < 1:
        parser.error(f"--encode-batch must be >= 1, got {args.encode_batch}")
    from verl_omni.models.wnm.sft import TRAINABLE_ENCODERS

    names = [] if args.train_encoders == "none" else args.train_encoders.split(",")
    unknown = [n for n in names if n not in TRAINABLE_ENCODERS]
    if unknown or not names and args.train_encoders != "none":
        parser.error(f"--train-encoders: unknown {unknown}; use 'none' or a comma-separated subset of "
                     f"{','.join(TRAINABLE_ENCODERS)}")  # fmt: skip
    if args.workdir.exists() and not args.workdir.is_dir():
        parser.error(f"--workdir {args.workdir}: exists and is not a directory")


@dataclasses.dataclass
class RoundState:
    """What a round hands to the next: the aggregated training rows and the round-0 held-out material.

    Attributes:
        accumulated: Encoded training rows of every round so far (CPU), features from the latest encoders.
        heldout_rows: Encoded held-out rows of round 0's held-out episodes (held-out loss, instruction gap).
        probe_examples: Held-out expert states of the open-loop probes.
        mean_actions: ``[32, 4]`` mean raw expert action sequence (the probes' constant baseline).
        steps_total: SFT steps of all rounds so far.
    """

    accumulated: object = None
    heldout_rows: object = None
    probe_examples: list | None = None
    mean_actions: object = None
    steps_total: int = 0
    round0_rows: dict | None = None  # round 0's collection digest and rows fingerprint (--reuse-encoded checks them)


def _adopt_round0(run: Path, collection: str, model, trained: tuple[str, ...]) -> RoundState | None:
    """Round 0's rows, held-out rows and probe states of the run in ``run``, with the ``trained`` encoders' features
    recomputed by ``model`` (on its device), or None (the reason logged) when they cannot stand in for encoding
    ``collection`` with ``model``: no finished round 0 there, another collection, or another rows fingerprint."""
    import torch

    from verl_omni.models.wnm.encode_cache import rows_fingerprint
    from verl_omni.models.wnm.encoded_rows import refresh_features

    path = Path(run) / "data" / "r0.rows.pt"
    why, donor = None, None
    if not path.is_file():
        why = f"{path} is not there (that run's round 0 has not finished)"
    else:
        # Our own file (written by _save_round_cache in a run folder); it holds dataclasses, so not weights_only.
        try:
            saved = torch.load(path, map_location="cpu", weights_only=False)
            saved.pop("checkpoint_sha256", None)
            donor = RoundState(**saved)
        except Exception as e:  # truncated, or from another version of this script: encode here instead
            why = f"{path} is unreadable ({type(e).__name__}: {e})"
        info = {} if donor is None else donor.round0_rows or {}
        if why is None and not info:
            why = f"{path} predates the rows fingerprint"
        elif why is None and info["collection"] != collection:
            why = f"{path} was encoded from another collection"
        elif why is None and (info["refreshed"] != sorted(trained)
                              or info["rows_fingerprint"] != rows_fingerprint(model, trained)):  # fmt: skip
            why = (f"{path} was encoded by a model whose VAE, latent statistics, action normalization, config or "
                   "untrained encoders differ from this one's, or that trained other encoders")  # fmt: skip
    if why is not None:
        _log(f"round 0: --reuse-encoded not used: {why}; encoding round 0 here")
        return None
    t0 = time.perf_counter()
    rows, held = donor.accumulated.to(model.device), donor.heldout_rows.to(model.device)
    refresh_features(model, rows, trained)
    refresh_features(model, held, trained)
    _log(f"round 0: took over {rows.examples} encoded states and the held-out rows of {path}; features of "
         f"{', '.join(trained) or 'no encoder'} recomputed with this model in "
         f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
    return dataclasses.replace(donor, accumulated=rows, heldout_rows=held.to("cpu"))


class _CudaMemory:
    """The CUDA caching allocator's peak and retries over a span (nothing on other devices).

    A retry means the allocator freed its cached blocks and synchronized the device to satisfy a request, which
    stalls the host; the SFT time line reports them so that a slow round can be told apart from a slow step.
    """

    def __init__(self, device) -> None:
        import torch

        self.on = torch.device(device).type == "cuda"
        if self.on:
            try:
                torch.cuda.reset_peak_memory_stats(device)
                self.device, self.retries = device, torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            except (RuntimeError, AssertionError):  # a diagnostic: never the reason a round fails
                self.on = False

    def report(self) -> str:
        """``", peak N GiB allocated (M reserved), K allocator retries"`` since construction, or ``""``."""
        if not self.on:
            return ""
        import torch

        try:
            stats = torch.cuda.memory_stats(self.device)
        except (RuntimeError, AssertionError):
            return ""
        return (f", peak {stats.get('allocated_bytes.all.peak', 0) / 2**30:.1f} GiB allocated "
                f"({stats.get('reserved_bytes.all.peak', 0) / 2**30:.1f} reserved), "
                f"{stats.get('num_alloc_retries', 0) - self.retries} allocator retries")  # fmt: skip


def _encode_batch(args) -> int:
    """``--encode-batch``, or its device default (256 on CUDA, 64 elsewhere)."""
    if args.encode_batch is not None:
        return args.encode_batch
    return 256 if str(args.device).startswith("cuda") else 64


@contextlib.contextmanager
def _sft_profiler(args, rnd: int, steps: int, eval_every: int):
    """Yields the step hook of a ``torch.profiler`` run over ``--profile-sft-steps`` SFT steps of round ``rnd``
    (None when off); the operator tables go to ``<workdir>/profile/r<rnd>_sft.txt``, the trace beside them.

    The window lies between two held-out evaluations where the round is long enough (session 26's window held
    one, whose float32 kernels were read as the step's); past the first 20 steps' one-time costs."""
    if args.profile_sft_steps <= 0 or steps < 2:
        yield None
        return
    from verl_omni.utils.trace_summary import chrome_trace_summary, clean_profile_window, step_profiler

    wait, active, clean = clean_profile_window(steps, eval_every, args.profile_sft_steps)
    out = Path(args.workdir) / "profile" / f"r{rnd}_sft.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = out.with_suffix(".json")
    with step_profiler(trace, wait, active) as hook:
        yield hook
    if not trace.is_file():  # the round resumed past the window: nothing was profiled
        return
    # prof.key_averages() walks every event in Python and took minutes for 20 steps of this loop on an H100 host,
    # so the tables are summed from the exported trace instead.
    first = wait + 2 if wait else 1
    inside = "" if clean else "; a held-out evaluation falls inside (the round is too short to avoid it)"
    text = (f"# round {rnd}: {active} SFT steps after {wait} (steps {first}-{first + active - 1}; batch "
            f"{args.batch_size}, autocast {args.sft_autocast}, device {args.device}{inside}); trace: {trace.name}\n\n"
            f"{chrome_trace_summary(trace, active)}")  # fmt: skip
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    _log(f"round {rnd}: SFT profile of {active} steps written to {out}")


def _checkpoint_digest(ckpt: Path) -> str:
    return _file_digest(ckpt / "checkpoint_manifest.json")


def _save_round_cache(cache: Path, ckpt: Path, state: RoundState) -> None:
    """Writes the round's state beside its collection (temporary name, then rename), tied to its checkpoint."""
    import torch

    tmp = cache.with_name(cache.name + ".partial")
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}  # shallow: asdict would unpack rows
    torch.save({"checkpoint_sha256": _checkpoint_digest(ckpt), **fields}, tmp)
    tmp.replace(cache)


def _load_round_cache(cache: Path, ckpt: Path) -> RoundState | None:
    """The state a finished round saved, or None when the round must run (no cache, or another checkpoint).

    A rerun on the same run folder (e.g. the next 10-minute call on a GPU machine) then starts where the last one
    stopped instead of decoding and encoding every earlier round again.
    """
    import torch

    if not (cache.is_file() and (ckpt / "checkpoint_manifest.json").is_file()):
        return None
    # Our own file, written by _save_round_cache in this run folder; it holds dataclasses, so not weights_only.
    try:
        saved = torch.load(cache, map_location="cpu", weights_only=False)
        digest = saved.pop("checkpoint_sha256")
        state = RoundState(**saved)
    except Exception as e:  # truncated or from another version of this script: the round is encoded again
        _log(f"{cache}: unreadable ({type(e).__name__}: {e}); encoding again")
        return None
    if digest != _checkpoint_digest(ckpt):
        _log(f"{cache.name} belongs to another {ckpt.name}; encoding again")
        return None
    return state


def _timed(iterable, timings: dict, key: str):
    """Yields from ``iterable``, adding the seconds spent waiting for each item to ``timings[key]``.

    Tells a slow encoding pass apart: waiting here is decoding (worker processes and the transfer of their frames);
    the rest of the pass is the encoders.
    """
    timings[key] = 0.0
    it = iter(iterable)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            timings[key] += time.perf_counter() - t0
            return
        timings[key] += time.perf_counter() - t0
        yield item


ENCODED_SUFFIX = ".encoded"
SHARD_EPISODES = 1000  # episodes per saved part of a round's encoding (about 6,000 states, 1 GB on two_rooms)


def _file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# PhaseClock.report keys a round's summary keeps (as r<k>_sft_<key>; scripts/bench_stage2_round.py reads them).
_SFT_TIMINGS = ("steps_s", "warmup_s", "heldout_eval_s", "snapshot_s", "refresh_features_s", "probes_s", "steps",
                "warmup_steps", "steady_ms_per_step")  # fmt: skip


def _train_round(args, config, rnd: int, data: Path, ckpt: Path, state: RoundState, train_encoders, progress: bool,
                 timings: dict) -> RoundState:  # fmt: skip
    """Decodes and encodes round ``rnd``'s collection, aggregates it with the earlier rows and trains (SFT).

    A checkpoint already in ``ckpt`` (a run stopped after saving it) is loaded instead of trained again.
    """
    from verl_omni.data.gn0 import list_episode_ids
    from verl_omni.models.wnm import WNMModel, load_wnm_checkpoint, save_wnm_checkpoint, sft
    from verl_omni.models.wnm.encode_cache import EncodeCache, rows_fingerprint
    from verl_omni.models.wnm.sft_resume import SFTResume
    from verl_omni.models.wnm.stop_gate import StopGate, fit_stop_distance, load_stop_gate

    t0 = time.perf_counter()
    state = dataclasses.replace(state)
    if ckpt.is_dir():  # resumed: encode with the round's saved weights (its encoders, statistics, normalization)
        model, source = load_wnm_checkpoint(ckpt, device=args.device), {"checkpoint": _checkpoint_digest(ckpt)}
    elif rnd == 0 and args.init_checkpoint is not None:  # a curriculum: go on from another run's checkpoint
        model = load_wnm_checkpoint(args.init_checkpoint, device=args.device)
        source = {"init_checkpoint": _checkpoint_digest(args.init_checkpoint)}
    elif rnd == 0:
        model, source = WNMModel(config).to(args.device), {"fresh": config.to_dict(), "seed": args.seed}
    else:
        previous = ckpt.with_name(f"stage2_r{rnd - 1}")
        model, source = load_wnm_checkpoint(previous, device=args.device), {"checkpoint": _checkpoint_digest(previous)}
    source["collection"] = _file_digest(data / "collection.json")
    cache = None if ckpt.is_dir() else EncodeCache(data.with_name(data.name + ENCODED_SUFFIX), source, _log)
    adopted = None
    if rnd == 0 and args.reuse_encoded is not None and not ckpt.is_dir():
        adopted = _adopt_round0(args.reuse_encoded, source["collection"], model, tuple(train_encoders))
    if adopted is not None:
        rows = adopted.accumulated
        state.heldout_rows, state.probe_examples, state.mean_actions = (
            adopted.heldout_rows, adopted.probe_examples, adopted.mean_actions)  # fmt: skip
        timings[f"r{rnd}_decode_wait_s"] = 0.0
    else:
        fresh = rnd == 0 and not ckpt.is_dir() and args.init_checkpoint is None  # fit statistics only for a new model
        ids = list_episode_ids(data)
        if rnd == 0:
            train_ids, held_ids = sft.split_episode_ids(ids, 0.05, args.seed)
        else:
            train_ids = ids
        # A fresh model fits its latent statistics and action normalization over all of its examples: one part.
        size = len(train_ids) if fresh else SHARD_EPISODES
        shards = [train_ids[i : i + size] for i in range(0, len(train_ids), size)]
        parts, reused = [], 0
        timings[f"r{rnd}_decode_wait_s"] = 0.0
        for i, part_ids in enumerate(shards):
            part = None if cache is None else cache.load_part(i, model)
            if part is not None:
                reused += 1
            else:
                _log(f"round {rnd}: decoding and encoding {len(part_ids)} episodes (part {i + 1} of {len(shards)})")
                wait = {}
                stream = _timed(sft.iter_expert_examples(data, config.history_frames, config.image_size, progress,
                                                         args.workers, episode_ids=part_ids), wait, "s")  # fmt: skip
                calibrate = fresh and config.vae_kind == "tiny"
                part = sft.encode_examples(model, stream, batch=_encode_batch(args), progress=progress,
                                           calibrate=calibrate, fit_normalization=fresh)  # fmt: skip
                timings[f"r{rnd}_decode_wait_s"] += wait["s"]
                if cache is not None:
                    cache.save_part(i, part, model if fresh else None)
            parts.append(part.to(args.device))
        rows = parts[0] if len(parts) == 1 else sft.EncodedRows.concat(parts)
        del parts
        rest = None if cache is None else cache.load_rest()
        if rest is not None and rnd == 0:
            state.heldout_rows, state.probe_examples, state.mean_actions = (
                rest["heldout_rows"], rest["probe_examples"], rest["mean_actions"])  # fmt: skip
        elif rnd == 0:
            held_ex = sft.load_expert_examples(data, config.history_frames, config.image_size, False, args.workers,
                                               episode_ids=held_ids)  # fmt: skip
            state.heldout_rows = sft.encode_examples(model, held_ex, batch=_encode_batch(args), progress=progress)
            state.probe_examples = sft.subsample(held_ex, args.probe_states)
            state.mean_actions = model.action_normalization.denormalize(rows.actions.double()).mean(0).cpu().numpy()
            del held_ex
        if cache is not None and rest is None:  # later rounds carry round 0's held-out material in their state
            cache.save_rest({"heldout_rows": state.heldout_rows.to("cpu") if rnd == 0 else None,
                             "probe_examples": state.probe_examples if rnd == 0 else None,
                             "mean_actions": state.mean_actions if rnd == 0 else None})  # fmt: skip
        _log(f"round {rnd}: {rows.examples} encoded states, {reused} of {len(shards)} part(s) reused from "
             f"{data.name}{ENCODED_SUFFIX}; {timings[f'r{rnd}_decode_wait_s']:.0f}s spent waiting for decoded episodes "
             f"({args.workers} workers)")  # fmt: skip
    newest_from = 0  # rows before this index are earlier rounds' (SFTConfig.newest_rows_from)
    if state.accumulated is None:
        train_all = rows
    else:
        newest_from = state.accumulated.rows
        train_all = sft.EncodedRows.concat([state.accumulated.to(args.device), rows])
        share = "their share of the aggregate" if args.dagger_share is None else f"{args.dagger_share:.1%}"
        _log(f"round {rnd}: the round's own rows are {1 - newest_from / train_all.rows:.1%} of the aggregate; "
             f"each SFT batch draws {share} from them")  # fmt: skip
    del rows
    heldout = state.heldout_rows.to(args.device)
    timings[f"r{rnd}_load_s"] = time.perf_counter() - t0
    steps = args.sft_steps if rnd == 0 else args.round_steps
    state.steps_total += steps
    _log(f"round {rnd}: {train_all.examples} training states ({train_all.rows} rows) in "
         f"{timings[f'r{rnd}_load_s']:.0f}s; SFT {steps} steps")  # fmt: skip
    if not ckpt.is_dir():
        cfg_sft = sft.SFTConfig(steps=steps, batch_size=args.batch_size, lr=args.lr,
                                action_weight=args.action_weight, eval_every=max(1, steps // 10), eval_rows=256,
                                seed=args.seed + rnd, train_encoders=train_encoders,
                                goal_aux_weight=args.goal_aux_weight,
                                independent_action_noise=args.independent_action_noise,
                                goal_aux_pure_noise=args.goal_aux_pure_noise,
                                view_aux_weight=args.view_aux_weight, autocast=args.sft_autocast,
                                newest_share=args.dagger_share if newest_from else None,
                                newest_rows_from=newest_from, ema_decay=args.sft_ema_decay)  # fmt: skip
        if args.compile_blocks:
            model.transformer.compile_blocks()
        # A DAgger round continues the previous round's view head (the STOP gate) instead of a fresh one.
        previous = ckpt.with_name(f"stage2_r{rnd - 1}") if rnd > 0 else args.init_checkpoint
        prev_gate = load_stop_gate(previous, args.device) if previous is not None else None
        view_head = None if prev_gate is None else prev_gate.head
        # The snapshot lives in the encoding folder: it belongs to these rows and goes with them.
        resume = None if cache is None else SFTResume(cache.root / "sft.pt", args.sft_snapshot_s, _log)
        memory = _CudaMemory(args.device)
        with _sft_profiler(args, rnd, steps, cfg_sft.eval_every) as step_hook:
            result = sft.train_sft(model, train_all, heldout, cfg_sft, progress, view_head=view_head, resume=resume,
                                   step_hook=step_hook)  # fmt: skip
        clock = result["timings"]
        for key in _SFT_TIMINGS:
            timings[f"r{rnd}_sft_{key}"] = clock[key]
        steady = (f"; the first {clock['warmup_steps']} in {clock['warmup_s']:.1f}s, then "
                  f"{clock['steady_ms_per_step']:.1f} ms/step" if clock["warmup_steps"] else "")  # fmt: skip
        _log(f"round {rnd}: SFT time: {clock['steps']} steps in {clock['steps_s']:.1f}s ({clock['ms_per_step']:.1f} "
             f"ms/step{steady}), held-out losses {clock['heldout_eval_s']:.1f}s, snapshots {clock['snapshot_s']:.1f}s, "
             f"feature refresh {clock['refresh_features_s']:.1f}s, probes {clock['probes_s']:.1f}s"
             f"{memory.report()}")  # fmt: skip
        gate = None
        if result["view_head"] is not None:
            try:
                distance = fit_stop_distance(train_all.actions.cpu(), train_all.goal_view.cpu())
            except ValueError as e:  # the checkpoint is still a good policy; it just carries no gate
                _log(f"round {rnd}: no STOP gate saved: {e}")
            else:
                gate = StopGate(result["view_head"].cpu(), distance)
                _log(f"round {rnd}: STOP gate: the expert stops within {distance:.2f} m of the named object in "
                     f"{gate.quantile:.0%} of its STOP states with the object in view (STOP within "
                     f"{gate.within_steps} steps)")  # fmt: skip
        prov = {
            "tool": "scripts/train_stage2.py",
            "round": rnd,
            "level": args.level,
            "train_rows": int(train_all.rows),
            "train_states": int(train_all.examples),
            "sft_steps_total": state.steps_total,
            "trained_encoders": list(train_encoders),
            "init_checkpoint": None
            if args.init_checkpoint is None or rnd > 0
            else {"path": str(args.init_checkpoint), "manifest_sha256": _checkpoint_digest(args.init_checkpoint)},
            "initial_heldout_loss": result["initial_heldout"],
            "final_heldout_loss": result["final_heldout"],
            "instruction_gap": result["instruction_gap"],
            "goal_direction": result["goal_direction"],
            "instruction_gap_pure_noise": result["instruction_gap_pure_noise"],
            "goal_direction_pure_noise": result["goal_direction_pure_noise"],
            "object_view": result["object_view"],
            "object_view_pure_noise": result["object_view_pure_noise"],
            "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        model.eval()
        if gate is not None:
            prov["stop_gate"] = {"stop_distance_m": gate.stop_distance_m, "quantile": gate.quantile,
                                 "within_steps": gate.within_steps}  # fmt: skip
        save_wnm_checkpoint(model.to("cpu"), ckpt, prov, readme=_readme(ckpt.name, args, rnd, prov, None, model.config),
                            stop_gate=gate)  # fmt: skip
        _log(f"round {rnd}: SFT {steps} steps, held-out loss {result['initial_heldout']['loss']:.3f} -> "
             f"{result['final_heldout']['loss']:.3f} (action {result['final_heldout']['action']:.3f}); action loss "
             f"with another episode's instruction {result['instruction_gap']['action_swapped']:.3f} (gap "
             f"{result['instruction_gap']['gap']:+.4f})")  # fmt: skip
        if result["goal_aux_losses"]:
            aux, k = result["goal_aux_losses"], max(1, len(result["goal_aux_losses"]) // 10)
            gd = result["goal_direction"]
            _log(f"round {rnd}: goal-direction loss {sum(aux[:k]) / k:.3f} -> {sum(aux[-k:]) / k:.3f}; held-out "
                 f"bearing error {gd['bearing_error_deg']:.1f} deg with the own instruction, "
                 f"{gd['bearing_error_deg_swapped']:.1f} with another's (constant {gd['constant']:.1f})")  # fmt: skip
        ig = result["instruction_gap_pure_noise"]
        _log(f"round {rnd}: at pure noise, action loss {ig['action']:.4f} own / {ig['action_swapped']:.4f} another's "
             f"instruction (gap {ig['gap']:+.4f})")  # fmt: skip
        for label, ov in (("spread noise", result["object_view"]), ("pure noise", result["object_view_pure_noise"])):
            if ov is not None:
                _log(f"round {rnd}: view grounding at {label}: named object in view told right in "
                     f"{ov['visible_accuracy']:.1%} own / {ov['visible_accuracy_swapped']:.1%} another's instruction "
                     f"(majority {ov['base_rate']:.1%}); its bearing off by {ov['bearing_error_deg']:.1f} / "
                     f"{ov['bearing_error_deg_swapped']:.1f} deg, its distance by {ov['distance_error_m']:.2f} / "
                     f"{ov['distance_error_m_swapped']:.2f} m")  # fmt: skip
    else:  # resumed: the earlier rounds' rows were encoded by older encoders; describe them with this round's
        sft.refresh_features(model, train_all, train_encoders)
        sft.refresh_features(model, heldout, train_encoders)
    # train_sft refreshed the cached features with the trained encoders: later rounds reuse them as they are.
    if rnd == 0:  # what another run checks before it takes these rows over (--reuse-encoded)
        state.round0_rows = {"collection": source["collection"], "refreshed": sorted(train_encoders),
                             "rows_fingerprint": rows_fingerprint(model, tuple(train_encoders))}  # fmt: skip
    state.accumulated = train_all.to("cpu")
    state.heldout_rows = heldout.to("cpu")
    del model, train_all, heldout
    return state


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    import torch

    from verl_omni.models.wnm import WNMConfig
    from verl_omni.sim.collector import CollectorConfig, SynthesisConfig
    from verl_omni.sim.dagger import collect_dagger_round, dagger_collection_meta, write_collection_meta
    from verl_omni.sim.heldout import sample_episode_specs, synthesize_heldout_scenes
    from verl_omni.sim.label_args import label_fields
    from verl_omni.sim.levels import get_level
    from verl_omni.sim.loop_pool import reuse_when_in_process
    from verl_omni.sim.probes import format_probe_table, probe_policy
    from verl_omni.sim.reference_policies import make_scripted_policy
    from verl_omni.sim.render import CameraConfig
    from verl_omni.sim.wnm_policy import WNMPolicy

    sys.path.insert(0, str(REPO / "tools/checkpoint"))
    from make_tiny_wnm_checkpoint import parse_overrides

    level = get_level(args.level)
    progress = not args.no_progress
    work = args.workdir.resolve()
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "ckpt").mkdir(exist_ok=True)
    (work / "eval").mkdir(exist_ok=True)
    overrides = parse_overrides(args.set)
    config = WNMConfig.from_size(args.size, **overrides)
    if args.init_checkpoint is not None:  # the model is the checkpoint's (loaded and sha256-verified here once)
        from verl_omni.models.wnm import load_wnm_checkpoint

        config = load_wnm_checkpoint(args.init_checkpoint).config
    args.image_size = list(config.image_size)
    if args.synthesize_only:
        _synthesize(args, work / "data" / "r0")
        _log(f"--synthesize-only: {work / 'data' / 'r0'} is ready; no training or evaluation")
        return 0
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    # Held-out scenes and episodes: their own seed stream, never used for training.
    task_cfg = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point=args.goal_point)
    held_plans = synthesize_heldout_scenes(args.eval_scenes, args.eval_seed, level.floorplan(), task=task_cfg)
    plans = {p.scene_id: p for p in held_plans}
    specs = sample_episode_specs(held_plans, args.eval_episodes, args.eval_seed, task_cfg)
    evals: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name in () if args.skip_baselines else BASELINES:
        evals[name] = _evaluate(functools.partial(make_scripted_policy, name, plans), name, plans, specs,
                                work / "eval" / f"{name}.json", args.drive_workers, progress)  # fmt: skip
    timings["baselines_eval_s"] = time.perf_counter() - t0

    torch.manual_seed(args.seed)
    state = RoundState()
    train_encoders = () if args.train_encoders == "none" else tuple(args.train_encoders.split(","))
    prev_ckpt: Path | None = None
    # Probes of rounds an earlier call measured stay in the summary when --eval-rounds skips them now (only this
    # run's rounds: a folder once run with more rounds keeps no stale entries).
    probes = json.loads((work / "probes.json").read_text()) if (work / "probes.json").is_file() else {}
    probes = {k: v for k, v in probes.items() if k in {f"stage2_r{r}" for r in range(args.rounds)}}
    for rnd in range(args.rounds):
        data = work / "data" / f"r{rnd}"
        t0 = time.perf_counter()
        if rnd == 0:
            _synthesize(args, data)
        elif not (data / "collection.json").is_file():
            beta = args.beta0 * args.beta_decay ** (rnd - 1)
            learner = functools.partial(WNMPolicy.from_checkpoint, prev_ckpt, device=args.device)
            h, w = config.image_size
            cfg = SynthesisConfig(
                num_scenes=args.dagger_scenes,
                episodes_per_scene=args.episodes_per_scene,
                floorplan=level.floorplan(),
                collector=CollectorConfig(camera=CameraConfig(width=w, height=h),
                                          min_goal_distance_m=level.min_goal_distance_m,
                                          **label_fields(args)),
            )  # fmt: skip
            tmp = data.with_name(data.name + ".partial")
            tmp_occ = data.with_name(data.name + "_occ.partial")
            for d in (tmp, tmp_occ):
                if d.exists():
                    shutil.rmtree(d)
                d.mkdir(parents=True)
            (tmp / "episodes").mkdir()
            offset = args.scenes + (rnd - 1) * args.dagger_scenes  # fresh training scenes every round
            summary = collect_dagger_round(learner, cfg, args.seed, beta, tmp / "episodes", tmp_occ,
                                           workers=args.workers, scene_offset=offset, progress=progress,
                                           drive_workers=args.drive_workers,
                                           execute_steps=args.dagger_execute_steps)  # fmt: skip
            meta = dagger_collection_meta(cfg, args.seed, beta, {"name": prev_ckpt.name})
            meta["level"], meta["dagger_summary"] = level.name, summary
            write_collection_meta(tmp / "collection.json", meta)
            tmp_occ.replace(data.with_name(data.name + "_occ"))
            tmp.replace(data)
            _log(f"DAgger round {rnd} (beta {beta:.3f}): {summary}")
        timings[f"r{rnd}_collect_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ckpt = work / "ckpt" / f"stage2_r{rnd}"
        cache = work / "data" / f"r{rnd}.rows.pt"
        cached = _load_round_cache(cache, ckpt)
        if cached is not None:  # a finished round: skip decoding, encoding and SFT
            state = cached
            _log(f"round {rnd}: reusing {ckpt.name} and its {state.accumulated.examples} encoded states ({cache.name})")
        else:
            torch.set_float32_matmul_precision(args.matmul_precision)
            try:
                state = _train_round(args, config, rnd, data, ckpt, state, train_encoders, progress, timings)
            finally:  # evaluation and DAgger driving below stay at full float32
                torch.set_float32_matmul_precision("highest")
            _save_round_cache(cache, ckpt, state)
            shutil.rmtree(data.with_name(data.name + ENCODED_SUFFIX), ignore_errors=True)  # the round cache has them
        timings[f"r{rnd}_sft_s"] = time.perf_counter() - t0 - timings.get(f"r{rnd}_load_s", 0.0)

        prev_ckpt = ckpt
        if args.eval_rounds is not None and rnd not in args.eval_rounds:  # keep what an earlier call measured
            kept = [r for r in sorted((work / "eval").glob(f"{ckpt.name}*.json"))
                    if r.stem == ckpt.name or r.stem.startswith(f"{ckpt.name}_")]  # fmt: skip
            for report in kept:
                evals[report.stem] = json.loads(report.read_text())["aggregate"]
            _log(f"round {rnd}: not in --eval-rounds; {len(kept)} earlier report(s) kept, no new evaluation or probe")
            continue
        t0 = time.perf_counter()
        factory = functools.partial(WNMPolicy.from_checkpoint, ckpt, device=args.device, name=ckpt.name)
        policy = factory()  # the probes below need it here; one drive worker reuses it
        source = reuse_when_in_process(factory, policy, args.drive_workers)
        xs = "" if args.eval_execute_steps == 8 else f"_x{args.eval_execute_steps}"  # other settings, other reports
        ev = functools.partial(_evaluate, plans=plans, specs=specs, workers=args.drive_workers, progress=progress,
                               execute_steps=args.eval_execute_steps)  # fmt: skip
        gated_eval = None  # the gated policy (the round's headline when on) runs first: a call cut off keeps it
        if args.eval_stop_gate and not (ckpt / "stop_gate").is_dir():
            _log(f"{ckpt.name}: no stop_gate/ (see the round's log above); gated evaluation skipped")
        elif args.eval_stop_gate:  # the same episodes and noise, STOP only where the view head allows it
            votes = max(args.eval_stop_votes)
            label = f"{ckpt.name}_gate" + (f"_votes{votes}" if votes > 1 else "") + xs
            gated = functools.partial(WNMPolicy.from_checkpoint, ckpt, device=args.device, name=label,
                                      stop_votes=votes, stop_gate=True)  # fmt: skip
            gated_eval = label, ev(gated, label, out=work / "eval" / f"{label}.json")
        if args.eval_plain:
            label = ckpt.name + xs
            evals[label] = ev(source, label, out=work / "eval" / f"{label}.json")
        for votes in sorted(set(args.eval_stop_votes) - {1}):  # the same episodes and noise, STOP by majority
            label = f"{ckpt.name}_votes{votes}{xs}"
            voted = functools.partial(WNMPolicy.from_checkpoint, ckpt, device=args.device, name=label, stop_votes=votes)
            evals[label] = ev(voted, label, out=work / "eval" / f"{label}.json")
        if gated_eval is not None:
            evals[gated_eval[0]] = gated_eval[1]
        probes[ckpt.name] = probe_policy(policy, state.probe_examples, state.mean_actions)
        _log(f"probe {ckpt.name}:\n{format_probe_table(probes[ckpt.name])}")
        timings[f"r{rnd}_eval_s"] = time.perf_counter() - t0
        del policy
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    timings["total_s"] = time.perf_counter() - t_start
    summary = {"level": level.name, "evaluations": evals, "probes": probes, "timings": timings,
               "episodes": len(specs), "arguments": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    (work / "probes.json").write_text(json.dumps(probes, indent=1) + "\n")
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"Stage II on `{level.name}`: {len(specs)} held-out episodes over {len(plans)} scenes "
             f"(seed {args.eval_seed}); 95% intervals.", "",
             "| policy | SR | OSR | SPL | collisions/ep | premature STOP | progress (m) | path (m) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip

    def ci(m):
        return f"{m['mean']:.3f} [{m['low']:.3f}, {m['high']:.3f}]" if m.get("low") is not None else f"{m['mean']:.3f}"

    for name, agg in evals.items():
        lines.append(
            f"| {name} | {ci(agg['success'])} | {ci(agg['oracle_success'])} | {agg['spl']['mean']:.3f} | "
            f"{agg['collisions']['mean']:.2f} | {agg['premature_stop']['mean']:.3f} | {agg['progress']['mean']:.2f} | "
            f"{agg['path_length']['mean']:.2f} |"
        )
    for name, p in probes.items():
        lines += [
            "",
            f"Open-loop probe of `{name}` on {len(state.probe_examples)} held-out states:",
            "",
            format_probe_table(p),
        ]
    # Seconds only: the step counts and ms/step that the summary also keeps would read as seconds on this line.
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items() if k.endswith("_s"))]
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
