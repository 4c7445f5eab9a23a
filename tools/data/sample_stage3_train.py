#!/usr/bin/env python
"""Build the deterministic Stage-III training subset from a converted dataset.

Takes the train split of --source-manifest (which must be valid and have counts.skipped == 0), keeps
at most one row per source episode, and writes exactly --train-size rows chosen by stable hashes of
--seed. Refuses a size larger than the number of eligible episodes. The output manifest records the
source manifest's sha256, its content hash, the seed and the size; the checkpoint contract and action
normalization are carried over unchanged.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from verl_omni.data.cli_common import EXIT_CODES_HELP, EXIT_OK, CliError, positive_int, rate, run_cli

TOOL = "sample_stage3_train"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--source-manifest", required=True, help="manifest.json of the converted dataset (or its directory)")
    p.add_argument("--output-dir", required=True, help="new directory for the subset (must not exist)")
    p.add_argument("--train-size", type=positive_int, required=True, help="exact number of rows to keep")
    p.add_argument("--shard-size", type=positive_int, default=2048, help="rows per Parquet shard (default 2048)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed (default 42)")
    p.add_argument(
        "--event-share",
        metavar="EVENT=SHARE",
        help="take this share of the rows from query states labelled with EVENT (e.g. collision_precursor=0.25), "
        "still one row per episode; default: no preference",
    )
    return p


def parse_event_share(value: str | None) -> tuple[str | None, float]:
    """``EVENT=SHARE`` -> ``(event, share)``; None -> ``(None, 0.0)``. Raises CliError naming the flag."""
    from verl_omni.data.schema import EVENT_NAMES

    if value is None:
        return None, 0.0
    event, sep, share = value.partition("=")
    if not sep or event not in EVENT_NAMES:
        raise CliError(f"--event-share {value!r}: expected EVENT=SHARE with EVENT one of {list(EVENT_NAMES)}")
    try:
        fraction = float(share)
    except ValueError:
        raise CliError(f"--event-share {value!r}: SHARE must be a number in (0, 1]") from None
    if not 0.0 < fraction <= 1.0:
        raise CliError(f"--event-share {value!r}: SHARE must be in (0, 1]")
    return event, fraction


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    event, event_share = parse_event_share(args.event_share)
    from verl_omni.data.hashing import file_sha256
    from verl_omni.data.manifest import (
        ManifestError,
        build_manifest,
        manifest_content_sha256,
        read_manifest,
        resolve_manifest_path,
        shard_paths,
        validate_manifest,
        write_manifest,
    )
    from verl_omni.data.parquet_io import read_shard, read_shards, write_table_shards
    from verl_omni.data.sampling import SubsetTooLargeError, sample_one_row_per_episode
    from verl_omni.data.staging import OutputExistsError, check_output_dir_free, staged_output_dir

    try:
        out_dir = check_output_dir_free(args.output_dir)
    except OutputExistsError as e:
        raise CliError(str(e)) from e
    source_path = resolve_manifest_path(args.source_manifest).resolve()
    problems = validate_manifest(source_path, kind="converted")
    if problems:
        raise CliError(
            f"--source-manifest {source_path} is not a usable converted dataset:\n  " + "\n  ".join(problems)
        )
    try:
        source = read_manifest(source_path)
    except ManifestError as e:
        raise CliError(str(e)) from e

    started = time.perf_counter()
    # Only the two id columns of the whole converted set are read; the chosen rows are then taken shard by
    # shard, so memory grows with the subset, not with the collection.
    train_paths = shard_paths(source_path, source, split="train")
    ids = read_shards(train_paths, columns=["sample_id", "episode_id"] + (["events"] if event else []))
    sample_ids = ids.column("sample_id").to_pylist()
    episode_ids = ids.column("episode_id").to_pylist()
    eligible = len(set(episode_ids))
    has_event = [event in (ev or ()) for ev in ids.column("events").to_pylist()] if event else None
    try:
        picked = sample_one_row_per_episode(sample_ids, episode_ids, args.train_size, args.seed, has_event, event_share)
    except SubsetTooLargeError as e:
        raise CliError(
            f"--train-size {args.train_size}: {e} in the train split of {source_path}; lower --train-size "
            f"or convert more episodes (nothing was written)"
        ) from e
    subset = _take_rows(train_paths, picked, read_shard)
    with_event = None
    if event:
        with_event = sum(bool(has_event[i]) for i in picked)
        wanted = round(event_share * args.train_size)
        if with_event < wanted:
            episodes_with = len({e for e, h in zip(episode_ids, has_event) if h})
            print(
                f"warning: --event-share {args.event_share}: {wanted} rows asked for, but only {episodes_with} "
                f"episodes have a {event} row; the other rows follow the plain rule",
                file=sys.stderr,
            )
    scenes = sorted(set(subset.column("scene_id").to_pylist()))

    with staged_output_dir(out_dir) as tmp:
        shards = [s.to_dict() for s in write_table_shards(subset, tmp, "train", "train", args.shard_size)]
        elapsed = time.perf_counter() - started
        manifest = build_manifest(
            kind="train_subset",
            tool=TOOL,
            args={
                "source_manifest": str(source_path),
                "train_size": args.train_size,
                "shard_size": args.shard_size,
                "seed": args.seed,
                "event_share": args.event_share,
            },
            source_root=source["source_root"],
            occupancy_root=source["occupancy_root"],
            checkpoint=source["checkpoint"],
            action_normalization=source["action_normalization"],
            counts={
                "episodes": args.train_size,
                "records": args.train_size,
                "rows": args.train_size,
                "rows_by_split": {"train": args.train_size, "val": 0},
                "skipped": 0,
                "skipped_by_reason": {k: 0 for k in source["counts"]["skipped_by_reason"]},
            },
            shards=shards,
            run={
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "elapsed_s": round(elapsed, 3),
                "rows_per_s": round(rate(args.train_size, elapsed), 2),
            },
            provenance={
                "source_manifest": str(source_path),
                "source_manifest_sha256": file_sha256(source_path),
                "source_content_sha256": manifest_content_sha256(source),
                "source_counts": source["counts"],
                "eligible_episodes": eligible,
                "eligible_rows": ids.num_rows,
                "seed": args.seed,
                "train_size": args.train_size,
                "rule": "one row per source episode; rows and episodes ranked by sha256(seed, id)"
                + (f"; {args.event_share} of the rows first from {event} rows" if event else ""),
                "rows_with_event": None if event is None else {event: with_event},
            },
            collection=source.get("collection"),
            occupancy_scenes={s: source.get("occupancy_scenes", {}).get(s) for s in scenes},
        )
        write_manifest(tmp, manifest)

    print(
        f"wrote {out_dir}: {args.train_size} rows from {args.train_size} distinct episodes "
        f"(eligible: {eligible} episodes, {ids.num_rows} train rows) in {len(shards)} shard(s)"
    )
    if event:
        print(f"{with_event} of the {args.train_size} rows carry {event} (--event-share {args.event_share})")
    print(f"speed: {rate(args.train_size, elapsed):.1f} rows/s ({elapsed:.2f} s)")
    print(f"manifest content sha256: {manifest_content_sha256(manifest)}")
    return EXIT_OK


def _take_rows(paths: list, picked, read_shard):
    """Rows at global positions ``picked`` (in that order) of the concatenation of ``paths``, one shard in
    memory at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    picked = np.asarray(picked, dtype=np.int64)
    bounds = np.cumsum([0] + [pq.read_metadata(p).num_rows for p in paths])
    parts, where = [], []
    for k, path in enumerate(paths):
        mine = np.nonzero((picked >= bounds[k]) & (picked < bounds[k + 1]))[0]
        if len(mine):
            parts.append(read_shard(path).take(pa.array(picked[mine] - bounds[k])))
            where.append(mine)
    table = pa.concat_tables(parts)
    order = np.empty(len(picked), dtype=np.int64)
    order[np.concatenate(where)] = np.arange(len(picked))
    return table.take(pa.array(order))


if __name__ == "__main__":
    sys.exit(run_cli(main))
