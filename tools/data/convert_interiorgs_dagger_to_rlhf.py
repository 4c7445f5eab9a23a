#!/usr/bin/env python
"""Convert a GN0 DAgger collection into Stage-III Parquet shards and a manifest.

One row per (query state, instruction variant); frames stay in the source MP4s and rows reference them
by path (relative to --input-root) and frame index. Expert actions are normalized with the
--checkpoint's action_normalization.json. Episodes go to the train or val split by a stable hash of
(--split-seed, episode id). Invalid records are skipped, counted by reason and listed in the manifest.

The output directory is built beside --output-dir under a temporary name and renamed at the end; the
shards are byte-identical for equal inputs and arguments, whatever --workers is.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from verl_omni.data.cli_common import (
    EXIT_CODES_HELP,
    EXIT_NOT_USABLE,
    EXIT_OK,
    CliError,
    check_action_scale,
    existing_dir,
    fraction,
    load_checkpoint_contract,
    parse_action_scale,
    positive_int,
    print_skips,
    rate,
    run_cli,
)

TOOL = "convert_interiorgs_dagger_to_rlhf"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input-root", required=True, help="GN0 collection root (collection.json + episodes/)")
    p.add_argument(
        "--output-dir", required=True, help="new directory for the shards and manifest.json (must not exist)"
    )
    p.add_argument("--checkpoint", required=True, help="data-contract WNM checkpoint (defines action normalization)")
    p.add_argument("--occupancy-root", required=True, help="InteriorGS occupancy scenes root (<scene_id>/occupancy.*)")
    p.add_argument("--shard-size", type=positive_int, default=2048, help="rows per Parquet shard (default 2048)")
    p.add_argument("--val-fraction", type=fraction, default=0.0, help="fraction of episodes in the val split")
    p.add_argument("--split-seed", type=int, default=42, help="seed of the episode split hash (default 42)")
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1: in-process)")
    p.add_argument("--worker-prefetch", type=positive_int, default=4, help="episodes in flight per worker (default 4)")
    p.add_argument(
        "--action-scale",
        type=parse_action_scale,
        default=None,
        help="optional assertion: comma-separated action std (dx,dy,dyaw[,stop]) that must equal the "
        "checkpoint's; a difference is an error (the checkpoint always wins)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from verl_omni.data.convert import EpisodeTask, run_conversion, scene_fingerprints
    from verl_omni.data.gn0 import CollectionError, list_episode_ids, read_collection_info
    from verl_omni.data.manifest import build_manifest, checkpoint_section, manifest_content_sha256, write_manifest
    from verl_omni.data.parquet_io import ShardWriter
    from verl_omni.data.schema import SPLITS
    from verl_omni.data.staging import OutputExistsError, check_output_dir_free, staged_output_dir

    # Everything that can be checked is checked before a single byte is written.
    try:
        out_dir = check_output_dir_free(args.output_dir)
    except OutputExistsError as e:
        raise CliError(str(e)) from e
    try:
        info = read_collection_info(args.input_root)
    except CollectionError as e:
        raise CliError(str(e)) from e
    occupancy_root = existing_dir("--occupancy-root", args.occupancy_root)
    contract = load_checkpoint_contract(args.checkpoint)
    checkpoint = existing_dir("--checkpoint", args.checkpoint)
    normalization = contract["action_normalization"]
    check_action_scale(args.action_scale, normalization, checkpoint)
    episode_ids = list_episode_ids(info.root)
    if not episode_ids:
        raise CliError(f"--input-root {info.root}: no episode directories under episodes/")
    meta = contract["transform_metadata"]
    if list(meta.get("image_size", info.image_size)) != list(info.image_size):
        print(
            f"note: collection image size {list(info.image_size)} differs from the checkpoint's "
            f"{meta.get('image_size')}; frames are stored as recorded",
            file=sys.stderr,
        )

    tasks = [
        EpisodeTask(
            input_root=str(info.root),
            occupancy_root=str(occupancy_root),
            episode_id=eid,
            normalization=normalization,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
        )
        for eid in episode_ids
    ]
    started = time.perf_counter()
    with staged_output_dir(out_dir) as tmp:
        writers = {s: ShardWriter(tmp, s, s, args.shard_size) for s in SPLITS}

        def sink(result) -> None:
            # Results arrive in sorted episode order and rows are sorted within an episode, so shard
            # contents are a function of the inputs only.
            for row in result.rows:
                writers[row.split].add([row])

        tally = run_conversion(tasks, args.workers, args.worker_prefetch, sink, desc="convert")
        shards = [info_.to_dict() for s in SPLITS for info_ in writers[s].close()]
        elapsed = time.perf_counter() - started
        manifest = build_manifest(
            kind="converted",
            tool=TOOL,
            args={
                "input_root": str(info.root),
                "checkpoint": str(checkpoint),
                "occupancy_root": str(occupancy_root),
                "shard_size": args.shard_size,
                "val_fraction": args.val_fraction,
                "split_seed": args.split_seed,
                "action_scale": list(args.action_scale) if args.action_scale else None,
            },
            source_root=info.root,
            occupancy_root=occupancy_root,
            checkpoint=checkpoint_section(contract, checkpoint),
            action_normalization=normalization,
            counts=tally.counts(),
            shards=shards,
            run={
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "workers": args.workers,
                "worker_prefetch": args.worker_prefetch,
                "elapsed_s": round(elapsed, 3),
                "rows_per_s": round(rate(tally.rows, elapsed), 2),
            },
            collection=info.raw,
            occupancy_scenes=scene_fingerprints(occupancy_root, tally.scenes),
            skipped_items=[s.to_dict() for s in tally.skipped_items],
        )
        write_manifest(tmp, manifest)

    counts = manifest["counts"]
    print(
        f"wrote {out_dir}: {counts['rows']} rows ({counts['rows_by_split']['train']} train, "
        f"{counts['rows_by_split']['val']} val) in {len(shards)} shard(s) from {counts['records']} query records "
        f"of {counts['episodes']} episodes"
    )
    print(
        f"speed: {rate(tally.rows, elapsed):.1f} rows/s, {rate(tally.episodes, elapsed):.2f} episodes/s "
        f"with {args.workers} worker(s) ({elapsed:.2f} s)"
    )
    print(f"manifest content sha256: {manifest_content_sha256(manifest)}")
    print_skips(manifest["skipped_items"])
    if counts["skipped"] or counts["rows"] == 0:
        print(
            f"NOT USABLE AS IS: counts.skipped = {counts['skipped']}, rows = {counts['rows']}; Stage III requires "
            f"counts.skipped == 0 and rows > 0",
            file=sys.stderr,
        )
        return EXIT_NOT_USABLE
    print("counts.skipped == 0: output is usable")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main))
