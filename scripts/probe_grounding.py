#!/usr/bin/env python
"""Does an architecture ground its instruction in the views? Several model arms on the same real data, on CPU.

The Stage-II checkpoints trained so far never read their instruction (the instruction gap is zero), although a
text-only task shows the text path works (``scripts/probe_instruction_path.py``). What is missing is grounding:
finding *the named* object in the views. This probe measures it directly and cheaply, so that an architecture
can be chosen before GPU time goes into it:

- data: a ``one_room`` collection with goal variants (every driven state labelled for K goals, each with its own
  instruction, so that only the instruction tells the labels apart), split by *scene*: held-out rows come from
  houses never trained on;
- model: the tiny WNM layout with a shortened history (``--history-frames`` taken evenly from the 33 of each
  query, the newest included; the 33-frame target clip, the 32-step action chunk, the current view and the four
  geometry views are unchanged). A proxy for speed on 2 CPU cores: history tokens shrink, the grounding path
  does not;
- every arm trains the Stage-II SFT recipe (``sft.train_sft``, built-in encoders trained, goal-direction head
  on) from the same initial weights, rows, noise and steps;
- reported per arm, on the held-out scenes: the instruction gap (action loss with another row's instruction
  minus with its own) and the goal-direction head's bearing error with the own and another instruction
  (:func:`sft.goal_direction_gap`), beside the error of a constant answer. A grounded model has both gaps > 0.

    python scripts/probe_grounding.py --workdir runs/grounding --arms plain gated

Outputs ``<workdir>/grounding_<arm>.json`` per arm and prints a table. The collection is built once in
``<workdir>/data`` (``tools/data/synthesize_gn0_collection.py``) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Arm name -> WNMConfig overrides. All arms share everything else.
ARMS: dict[str, dict] = {
    "plain": {},
    "pooled": {"pooled_text_modulation": True},
    "gated": {"text_gated_context": True},
    "gated_pooled": {"text_gated_context": True, "pooled_text_modulation": True},
}


def _log(msg: str) -> None:
    print(f"[grounding {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, type=Path, help="run folder (the collection in it is reused)")
    p.add_argument("--arms", nargs="+", default=["plain", "gated"], choices=sorted(ARMS), help="model arms")
    p.add_argument("--level", default="one_room", help="task level (default one_room)")
    p.add_argument("--scenes", type=int, default=40, help="scenes (default 40)")
    p.add_argument("--episodes-per-scene", type=int, default=4, help="driven episodes per scene (default 4)")
    p.add_argument("--goal-variants", type=int, default=3, help="goals per driven trajectory (default 3)")
    from verl_omni.sim.label_args import add_label_arguments

    add_label_arguments(p)
    p.add_argument("--heldout-scenes", type=float, default=0.2, help="fraction of scenes held out (default 0.2)")
    p.add_argument("--history-frames", type=int, default=5, help="history frames, 1 + 4k >= 5 (default 5)")
    p.add_argument("--steps", type=int, default=600, help="SFT steps per arm (default 600)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per step (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--goal-aux-weight", type=float, default=1.0, help="goal-direction loss weight (default 1)")
    p.add_argument(
        "--independent-action-noise", type=float, default=0.0, help="SFTConfig.independent_action_noise (default 0)"
    )
    p.add_argument("--goal-aux-pure-noise", type=float, default=0.0, help="SFTConfig.goal_aux_pure_noise (default 0)")
    p.add_argument("--view-aux-weight", type=float, default=0.0, help="SFTConfig.view_aux_weight (default 0: off)")
    p.add_argument("--device", default="cpu", help="torch device of SFT (default cpu)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="WNMConfig override, all arms")
    p.add_argument("--seed", type=int, default=0, help="seed of data, weights and SFT draws (default 0)")
    p.add_argument("--workers", type=int, default=1, help="processes for synthesis and decoding (default 1)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def _synthesize(args, out: Path) -> None:
    from train_stage2 import synthesize_collection  # scripts/ is on sys.path when this file runs

    synthesize_collection(
        out, scenes=args.scenes, episodes_per_scene=args.episodes_per_scene, seed=args.seed, workers=args.workers,
        level=args.level, goal_variants=args.goal_variants, label_expert=args.label_expert,
        face_goal_object=args.face_goal_object, goal_point=args.goal_point, log=_log,
    )  # fmt: skip


def split_by_scene(episode_ids: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Whole scenes (``s0003`` of ``s0003_e001_g1``) held out; returns ``(train_ids, heldout_ids)``."""
    import numpy as np

    scenes = sorted({e.split("_")[0] for e in episode_ids})
    if len(scenes) < 2:
        raise ValueError(f"need >= 2 scenes to hold one out, the collection has {len(scenes)}")
    order = np.random.default_rng(seed).permutation(len(scenes))
    held = {scenes[i] for i in order[: min(len(scenes) - 1, max(1, round(fraction * len(scenes))))]}
    return [e for e in episode_ids if e.split("_")[0] not in held], [e for e in episode_ids if e.split("_")[0] in held]


def shorten(examples, frames: int):
    """Keeps ``frames`` evenly spaced frames of every example's history (the oldest and the newest included)."""
    import numpy as np

    for e in examples:
        e.history = e.history[np.linspace(0, e.history.shape[0] - 1, frames).round().astype(int)]
    return examples


def view_oracle(data: Path, episode_ids: list[str]) -> dict:
    """What the current view alone can tell about the goal, on the given episodes' query states.

    For each query state: is the named object in the current view (the renderer's rays,
    :func:`verl_omni.sim.probes.goal_object_in_view`), and the bearing error of an ideal detector of it, which
    answers the object's bearing when it is seen and the states' mean goal direction when it is not. This bounds
    what grounding in the newest frame can give, beside the constant answer.

    Returns:
        ``{"states", "visible_share", "oracle_bearing_error_deg", "oracle_error_when_visible_deg", "constant"}``.
    """
    import math

    import numpy as np

    from verl_omni.data.actions import wrap_angle
    from verl_omni.data.gn0 import parse_episode
    from verl_omni.models.wnm.goal_probe import goal_polar
    from verl_omni.sim.floorplan import FloorPlan
    from verl_omni.sim.search_expert import goal_object_in_view

    plans: dict[str, FloorPlan] = {}
    truth, seen = [], []
    for eid in episode_ids:
        ep = parse_episode(data, eid)
        name = json.loads((data / "episodes" / eid / "episode.json").read_text())["goal_object"]["name"]
        if ep.scene_id not in plans:
            plans[ep.scene_id] = FloorPlan.load(data.with_name(data.name + "_occ") / ep.scene_id)
        plan = plans[ep.scene_id]
        index = next(f.index for f in plan.furniture if f.name == name)
        for q in ep.queries:
            c, s_, _ = goal_polar(ep.poses[q.t], ep.goal)
            truth.append(math.atan2(s_, c))
            seen.append(goal_object_in_view(plan, ep.poses[q.t], index))
    truth = np.array(truth)
    mean_dir = math.atan2(np.sin(truth).mean(), np.cos(truth).mean())
    constant = np.abs(wrap_angle(mean_dir - truth))
    visible = np.array([b is not None for b in seen])
    oracle = np.array([abs(wrap_angle(b - t)) if b is not None else c for b, t, c in zip(seen, truth, constant)])
    return {
        "states": int(len(truth)),
        "visible_share": float(visible.mean()),
        "oracle_bearing_error_deg": float(np.degrees(oracle.mean())),
        "oracle_error_when_visible_deg": float(np.degrees(oracle[visible].mean())) if visible.any() else None,
        "constant": float(np.degrees(constant.mean())),
    }


def _copy_rows(rows):
    from verl_omni.models.wnm import sft

    return sft.EncodedRows(**{k: None if v is None else v.clone() for k, v in rows.__dict__.items()})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.view_aux_weight >= 0 and args.goal_aux_weight >= 0 and args.steps >= 1):
        parser.error(f"--view-aux-weight and --goal-aux-weight must be >= 0 and --steps >= 1, got "
                     f"{args.view_aux_weight}, {args.goal_aux_weight}, {args.steps}")  # fmt: skip
    if args.history_frames < 5 or (args.history_frames - 1) % 4:
        parser.error(f"--history-frames must be 1 + 4k >= 5 (the geometry encoder looks at 4 views), got "
                     f"{args.history_frames}")  # fmt: skip
    import copy

    import torch

    from verl_omni.data.gn0 import list_episode_ids
    from verl_omni.models.wnm import WNMConfig, WNMModel, sft

    sys.path.insert(0, str(REPO / "tools/checkpoint"))
    from make_tiny_wnm_checkpoint import parse_overrides

    progress = not args.no_progress
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = args.workdir / "data"
    t0 = time.perf_counter()
    _synthesize(args, data)
    ids = list_episode_ids(data)
    train_ids, held_ids = split_by_scene(ids, args.heldout_scenes, args.seed)
    _log(f"{len(train_ids)} training and {len(held_ids)} held-out episodes ({time.perf_counter() - t0:.0f}s)")
    oracle = view_oracle(data, held_ids)
    _log(f"held-out states: the named object is in the current view in {oracle['visible_share']:.0%}; an ideal "
         f"detector of it errs by {oracle['oracle_bearing_error_deg']:.1f} deg on the goal bearing "
         f"({oracle['oracle_error_when_visible_deg']:.1f} when it sees it), a constant answer by "
         f"{oracle['constant']:.1f}")  # fmt: skip
    (args.workdir / "view_oracle.json").write_text(json.dumps(oracle, indent=1) + "\n")

    overrides = parse_overrides(args.set)
    base_fields = {"history_frames": args.history_frames, "text_max_length": 64, **overrides}
    torch.manual_seed(args.seed)
    base = WNMModel(WNMConfig.from_size("tiny", **base_fields))
    # Encoded once per (data, history length, seed): the base model is rebuilt from the seed, and the statistics
    # that encoding fitted (latent mean/std, action normalization) are saved with the rows.
    cache = args.workdir / f"rows_h{args.history_frames}_seed{args.seed}.pt"
    if cache.is_file():
        saved = torch.load(cache, map_location="cpu", weights_only=False)  # our own file, holds dataclasses
        read = {"train": saved["train"], "heldout": saved["heldout"]}
        base.set_latent_statistics(saved["latents_mean"], saved["latents_std"])
        base.action_normalization = saved["action_normalization"]
        _log(f"reusing {cache}")
    else:
        read = {}
        for name, subset in (("train", train_ids), ("heldout", held_ids)):
            t1 = time.perf_counter()
            # The collection's queries hold 33-frame histories; they are read whole and shortened to the model's.
            ex = sft.load_expert_examples(data, 33, base.config.image_size, progress, args.workers, subset)
            read[name] = sft.encode_examples(base, shorten(ex, args.history_frames), batch=32, progress=progress,
                                             calibrate=name == "train", fit_normalization=name == "train")  # fmt: skip
            _log(f"{name}: {read[name].examples} states, {read[name].rows} rows ({time.perf_counter() - t1:.0f}s)")
            del ex
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # arms started together may both encode
        torch.save({**read, "latents_mean": base.latents_mean.flatten().tolist(),
                    "latents_std": base.latents_std.flatten().tolist(),
                    "action_normalization": base.action_normalization}, tmp)  # fmt: skip
        tmp.replace(cache)
    results = {}
    for arm in args.arms:
        t1 = time.perf_counter()
        torch.manual_seed(args.seed)  # same transformer initialisation in every arm (new modules come last)
        cfg = WNMConfig.from_size("tiny", **base_fields, **ARMS[arm])
        frozen = {"vae": base.vae, "tokenizer": base.tokenizer}
        for part in ("text_encoder", "image_encoder", "geometry_encoder"):
            frozen[part] = copy.deepcopy(getattr(base, part))  # trained per arm: each starts from the same weights
        model = WNMModel(cfg, copy.deepcopy(base.action_normalization), frozen=frozen)
        model.set_latent_statistics(base.latents_mean.flatten().tolist(), base.latents_std.flatten().tolist())
        sft_cfg = sft.SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, action_weight=4.0,
                                eval_every=max(1, args.steps // 5), eval_rows=min(256, read["heldout"].rows),
                                seed=args.seed, train_encoders=sft.TRAINABLE_ENCODERS,
                                goal_aux_weight=args.goal_aux_weight,
                                independent_action_noise=args.independent_action_noise,
                                goal_aux_pure_noise=args.goal_aux_pure_noise,
                                view_aux_weight=args.view_aux_weight)  # fmt: skip
        model.to(args.device)
        train_rows, held_rows = _copy_rows(read["train"]).to(args.device), _copy_rows(read["heldout"]).to(args.device)
        res = sft.train_sft(model, train_rows, held_rows, sft_cfg, progress)
        aux = res["goal_aux_losses"]
        k = max(1, len(aux) // 10)
        results[arm] = {
            "config_overrides": ARMS[arm],
            "final_heldout": res["final_heldout"],
            "instruction_gap": res["instruction_gap"],
            "instruction_gap_pure_noise": res["instruction_gap_pure_noise"],
            "goal_direction": res["goal_direction"],
            "goal_direction_pure_noise": res["goal_direction_pure_noise"],
            "object_view": res["object_view"],
            "object_view_pure_noise": res["object_view_pure_noise"],
            "goal_aux_loss_first_last": [sum(aux[:k]) / k, sum(aux[-k:]) / k] if aux else None,
            "wall_s": time.perf_counter() - t1,
        }
        meta = {"arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "train_states": read["train"].examples, "heldout_states": read["heldout"].examples}  # fmt: skip
        tag = f"_ian{args.independent_action_noise:g}" if args.independent_action_noise else ""
        tag += f"_pure{args.goal_aux_pure_noise:g}" if args.goal_aux_pure_noise else ""
        tag += f"_aux{args.goal_aux_weight:g}" if args.goal_aux_weight != 1.0 else ""
        tag += f"_view{args.view_aux_weight:g}" if args.view_aux_weight else ""
        out = args.workdir / f"grounding_{arm}{tag}.json"
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({**meta, **results[arm]}, indent=1) + "\n")
        tmp.replace(out)
        _log(f"{arm}: done in {results[arm]['wall_s']:.0f}s -> {out}")
    notes = [f"independent action noise {args.independent_action_noise:g}"] if args.independent_action_noise else []
    if args.goal_aux_pure_noise:
        notes.append(f"goal head at pure noise on {args.goal_aux_pure_noise:g} of the rows")
    tag = f" ({', '.join(notes)})" if notes else ""
    print(f"held-out scenes{tag}; 'stratified': noise levels spread over (0, 1); 'pure noise': sigma = 1, where only "
          "the history and the instruction inform the answer")  # fmt: skip
    print("| arm | noise | action loss own / swapped | gap | bearing error own / swapped (deg) | gap | constant |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    nan = float("nan")
    for arm, r in results.items():
        for label, suffix in (("stratified", ""), ("pure noise", "_pure_noise")):
            ig, gd = r["instruction_gap" + suffix], r["goal_direction" + suffix] or {}
            print(f"| {arm} | {label} | {ig['action']:.4f} / {ig['action_swapped']:.4f} | {ig['gap']:+.4f} | "
                  f"{gd.get('bearing_error_deg', nan):.1f} / {gd.get('bearing_error_deg_swapped', nan):.1f} | "
                  f"{gd.get('gap', nan):+.1f} | {gd.get('constant', nan):.1f} |")  # fmt: skip
    if args.view_aux_weight:
        print("\nview grounding (is the named object in the current frame, and where):")
        print("| arm | noise | in view told right, own / swapped | majority | its bearing error own / swapped (deg) |")
        print("| --- | --- | --- | --- | --- |")
        for arm, r in results.items():
            for label, suffix in (("stratified", ""), ("pure noise", "_pure_noise")):
                ov = r["object_view" + suffix]
                print(f"| {arm} | {label} | {ov['visible_accuracy']:.3f} / {ov['visible_accuracy_swapped']:.3f} | "
                      f"{ov['base_rate']:.3f} | {ov['bearing_error_deg']:.1f} / "
                      f"{ov['bearing_error_deg_swapped']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
