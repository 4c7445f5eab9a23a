#!/usr/bin/env python
"""Write a complete (randomly initialised, optionally SFT-trained) WNM checkpoint of a small size.

Without ``--collection`` the checkpoint holds a random model with identity action normalization. With
``--collection DIR`` the action normalization and the tiny VAE's latent statistics are computed from the
collection's expert data, and ``--sft-steps N`` first trains the DiT by flow matching on it (a Stage-II
stand-in), holding out whole episodes to report the held-out loss before and after.

Example:
    python tools/checkpoint/make_tiny_wnm_checkpoint.py --output-dir /tmp/ckpt --collection /tmp/gn0 --sft-steps 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output-dir", required=True, type=Path, help="checkpoint directory to create (must not exist)")
    p.add_argument("--size", default="tiny", help="WNMConfig size preset (default: tiny)")
    p.add_argument("--variant", default="wnm_3d", choices=["wnm_3d", "wnm_2d"])
    p.add_argument("--collection", type=Path, help="GN0 collection root with expert data")
    p.add_argument("--sft-steps", type=int, default=0, help="flow-matching steps on the collection (default 0)")
    p.add_argument("--max-queries", type=int, default=160, help="use at most this many query states (default 160)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--action-weight", type=float, default=1.0, help="weight of the action term of the SFT loss (default 1.0)"
    )
    p.add_argument("--heldout-fraction", type=float, default=0.2, help="fraction of episodes held out")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-mb", type=float, default=2048.0, help="shard tensors of a part above this size")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one WNMConfig field of the preset (JSON value, e.g. vae_kind=tiny or text_encoder_layers=2);\n"
        "repeatable. Used to build random checkpoints at a real size with the built-in frozen encoders.",
    )
    return p.parse_args(argv)


def parse_overrides(items: list[str]) -> dict:
    """``FIELD=VALUE`` strings -> dict; VALUE is JSON when it parses (numbers, lists, true), else a string."""
    import json

    out = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[field.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[field.strip()] = raw
    return out


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMModel, save_wnm_checkpoint, sft

    if args.output_dir.exists():
        return fail(f"--output-dir {args.output_dir}: already exists; choose a new directory (never overwritten)")
    if args.sft_steps < 0:
        return fail(f"--sft-steps must be >= 0, got {args.sft_steps}")
    if args.sft_steps and args.collection is None:
        return fail("--sft-steps needs --collection (the expert data to train on)")
    if args.max_queries < 2:
        return fail(f"--max-queries must be >= 2, got {args.max_queries}")
    if not 0 < args.heldout_fraction < 1:
        return fail(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    if args.max_shard_mb <= 0:
        return fail(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    try:
        config = WNMConfig.from_size(args.size, variant=args.variant, **parse_overrides(args.set))
        sft_cfg = sft.SFTConfig(
            steps=max(1, args.sft_steps),
            batch_size=args.batch_size,
            lr=args.lr,
            action_weight=args.action_weight,
            eval_every=args.eval_every,
            seed=args.seed,
        )
    except (TypeError, ValueError) as e:
        return fail(f"--size/--variant/--set/--batch-size/--lr/--action-weight/--eval-every: {e}")
    progress = not args.no_progress
    provenance: dict = {
        "tool": "make_tiny_wnm_checkpoint",
        "size": args.size,
        "variant": args.variant,
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "sft_batch_size": args.batch_size,
        "sft_lr": args.lr,
        "sft_action_weight": args.action_weight,
    }
    t0 = time.time()
    torch.manual_seed(args.seed)
    result = None
    if args.collection is None:
        model = WNMModel(config, ActionNormalization.identity())
    else:
        from verl_omni.data.gn0 import CollectionError, read_collection_info

        try:
            info = read_collection_info(args.collection)
            # The collection's frame rate is part of the data contract; the model records the same one.
            config = WNMConfig.from_size(
                args.size, variant=args.variant, **{**parse_overrides(args.set), "fps": info.fps}
            )
            examples = sft.load_expert_examples(args.collection, config.history_frames, config.image_size, progress)
            examples = sft.subsample(examples, args.max_queries)
            train_ex, held_ex = sft.split_by_episode(examples, args.heldout_fraction, args.seed)
        except (CollectionError, ValueError) as e:
            return fail(f"--collection {args.collection}: {e}")
        normalization = sft.fit_action_normalization(train_ex)
        model = WNMModel(config, normalization)
        train = sft.encode_examples(model, train_ex, progress=progress, calibrate=config.vae_kind == "tiny")
        held = sft.encode_examples(model, held_ex, progress=progress)
        provenance.update(
            collection=str(args.collection.resolve()),
            train_episodes=len({e.episode_id for e in train_ex}),
            heldout_episodes=len({e.episode_id for e in held_ex}),
            train_rows=train.rows,
            heldout_rows=held.rows,
        )
        print(
            f"expert data: {len(train_ex)} train / {len(held_ex)} held-out query states "
            f"({train.rows} / {held.rows} rows); action normalization mean={list(normalization.mean)} "
            f"std={list(normalization.std)}"
        )
        if args.sft_steps:
            result = sft.train_sft(model, train, held, sft_cfg, progress)
            print("\nloss curve (step, train loss over the interval, held-out loss):")
            for step, tr, he in result["curve"]:
                print(f"  {step:6d}  {'-' if tr is None else f'{tr:9.4f}':>9}  {he:9.4f}")
            provenance.update(
                initial_heldout_loss=result["initial_heldout"],
                final_heldout_loss=result["final_heldout"],
                loss_curve=[list(c) for c in result["curve"]],
            )
    model.eval()
    path = save_wnm_checkpoint(model, args.output_dir, provenance, int(args.max_shard_mb * 1024 * 1024))
    n_train = sum(p.numel() for p in model.transformer.parameters())
    n_frozen = sum(p.numel() for p in model.parameters()) - n_train
    print(f"\nwrote {path}")
    print(f"  size={args.size} variant={args.variant} trainable={n_train:,} frozen={n_frozen:,} params")
    if result is not None:
        ini, fin = result["initial_heldout"], result["final_heldout"]
        print(
            f"  held-out flow-matching loss: initial {ini['loss']:.4f} (video {ini['video']:.4f}, action "
            f"{ini['action']:.4f}) -> final {fin['loss']:.4f} (video {fin['video']:.4f}, action {fin['action']:.4f})"
        )
    print(f"  elapsed {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
