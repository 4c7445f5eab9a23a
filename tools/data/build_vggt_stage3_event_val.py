#!/usr/bin/env python
"""Build the event-balanced Stage-III validation Parquet from a GN0 collection.

Converts every episode that does not appear in the Parquet files under --exclude-parquet-dir (the
training sample), then selects --per-event rows for each of the four events (collision_precursor,
premature_stop_risk, required_stop, near_goal_continuation): one row per query state, spread over as
many episodes as possible, scarce events first. Writes <output-dir>/event_val.parquet and manifest.json.

When an event has fewer candidates than --per-event, the tool reports the short events and writes
nothing, unless --allow-short is given (then the shortfall is recorded and the exit code is 3).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from verl_omni.data.cli_common import (
    EXIT_CODES_HELP,
    EXIT_INPUT,
    EXIT_NOT_USABLE,
    EXIT_OK,
    CliError,
    existing_dir,
    load_checkpoint_contract,
    positive_int,
    print_skips,
    rate,
    run_cli,
)

TOOL = "build_vggt_stage3_event_val"
OUTPUT_FILE = "event_val.parquet"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input-root", required=True, help="GN0 collection root (collection.json + episodes/)")
    p.add_argument("--output-dir", required=True, help="new directory for event_val.parquet + manifest.json")
    p.add_argument("--checkpoint", required=True, help="data-contract WNM checkpoint (defines action normalization)")
    p.add_argument(
        "--exclude-parquet-dir",
        required=True,
        help="directory of Parquet files (e.g. the training sample); their episodes are excluded",
    )
    p.add_argument("--occupancy-root", required=True, help="InteriorGS occupancy scenes root")
    p.add_argument("--per-event", type=positive_int, required=True, help="rows per event type")
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1: in-process)")
    p.add_argument("--worker-prefetch", type=positive_int, default=4, help="episodes in flight per worker (default 4)")
    p.add_argument("--seed", type=int, default=0, help="selection seed (default 0)")
    p.add_argument(
        "--allow-short",
        action="store_true",
        help="write the set even when an event has fewer than --per-event candidates (exit code 3)",
    )
    return p


def excluded_episodes(exclude_dir: Path) -> tuple[set[str], list[dict]]:
    """Episode ids in every Parquet file under ``exclude_dir`` and the files read (name + sha256)."""
    from verl_omni.data.hashing import file_sha256
    from verl_omni.data.parquet_io import read_shard

    files = sorted(exclude_dir.rglob("*.parquet"))
    if not files:
        raise CliError(f"--exclude-parquet-dir {exclude_dir}: no .parquet files; pass the training sample directory")
    episodes: set[str] = set()
    for f in files:
        try:
            episodes.update(read_shard(f, columns=["episode_id"]).column("episode_id").to_pylist())
        except (OSError, ValueError, KeyError) as e:
            raise CliError(f"--exclude-parquet-dir: {f}: cannot read its episode_id column ({e})") from e
    return episodes, [{"file": str(f.relative_to(exclude_dir)), "sha256": file_sha256(f)} for f in files]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from verl_omni.data.convert import EpisodeTask, run_conversion, scene_fingerprints
    from verl_omni.data.event_val import select_event_balanced
    from verl_omni.data.gn0 import CollectionError, list_episode_ids, read_collection_info
    from verl_omni.data.hashing import file_sha256
    from verl_omni.data.manifest import (
        MANIFEST_NAME,
        ManifestError,
        build_manifest,
        checkpoint_section,
        contract_problems,
        manifest_content_sha256,
        read_manifest,
        write_manifest,
    )
    from verl_omni.data.parquet_io import ShardInfo, write_table_atomic
    from verl_omni.data.schema import EVENT_NAMES, rows_to_table
    from verl_omni.data.staging import OutputExistsError, check_output_dir_free, staged_output_dir

    try:
        out_dir = check_output_dir_free(args.output_dir)
    except OutputExistsError as e:
        raise CliError(str(e)) from e
    try:
        info = read_collection_info(args.input_root)
    except CollectionError as e:
        raise CliError(str(e)) from e
    occupancy_root = existing_dir("--occupancy-root", args.occupancy_root)
    exclude_dir = existing_dir("--exclude-parquet-dir", args.exclude_parquet_dir)
    contract = load_checkpoint_contract(args.checkpoint)
    checkpoint = existing_dir("--checkpoint", args.checkpoint)
    excluded, excluded_files = excluded_episodes(exclude_dir)
    if (exclude_dir / MANIFEST_NAME).is_file():
        # The excluded set must come from the same data contract, or the two sets are not comparable.
        try:
            problems = contract_problems(read_manifest(exclude_dir / MANIFEST_NAME), contract, str(exclude_dir))
        except ManifestError as e:
            raise CliError(f"--exclude-parquet-dir: {e}") from e
        if problems:
            raise CliError("--exclude-parquet-dir was built with another data contract:\n  " + "\n  ".join(problems))
    all_ids = list_episode_ids(info.root)
    unknown = len(excluded - set(all_ids))
    if unknown:
        print(
            f"warning: {unknown} of {len(excluded)} excluded episodes are not in --input-root {info.root}; "
            f"check that --exclude-parquet-dir was built from this collection",
            file=sys.stderr,
        )
    candidates_ids = [e for e in all_ids if e not in excluded]
    if not candidates_ids:
        raise CliError(f"--input-root {info.root}: all {len(all_ids)} episodes are excluded by {exclude_dir}")
    normalization = contract["action_normalization"]
    tasks = [
        EpisodeTask(str(info.root), str(occupancy_root), eid, normalization, split="val") for eid in candidates_ids
    ]

    started = time.perf_counter()
    rows = []
    tally = run_conversion(tasks, args.workers, args.worker_prefetch, lambda r: rows.extend(r.rows), desc="event-val")
    selection = select_event_balanced(
        [r.sample_id for r in rows],
        [r.episode_id for r in rows],
        [r.query_t for r in rows],
        [r.events for r in rows],
        per_event=args.per_event,
        seed=args.seed,
        excluded_episodes=excluded,
    )
    report = {
        e: f"{len(selection.selected[e])}/{args.per_event} (candidates {selection.candidates[e]})" for e in EVENT_NAMES
    }
    for event, line in report.items():
        print(f"  {event}: {line}")
    if selection.short:
        short = ", ".join(f"{e} has {n}" for e, n in selection.short.items())
        message = (
            f"fewer than --per-event {args.per_event} selectable rows: {short}; lower --per-event, "
            f"collect more episodes with these events, or pass --allow-short"
        )
        if not args.allow_short:
            raise CliError(message + " (nothing was written)", EXIT_INPUT)
        print(f"warning: {message}", file=sys.stderr)
    chosen = [rows[i] for i in selection.all_rows]

    with staged_output_dir(out_dir) as tmp:
        table = rows_to_table(chosen)
        write_table_atomic(table, tmp / OUTPUT_FILE)
        shard = ShardInfo(file=OUTPUT_FILE, split="val", rows=len(chosen), sha256=file_sha256(tmp / OUTPUT_FILE))
        elapsed = time.perf_counter() - started
        counts = tally.counts()
        counts.update(rows=len(chosen), rows_by_split={"train": 0, "val": len(chosen)})
        manifest = build_manifest(
            kind="event_val",
            tool=TOOL,
            args={
                "input_root": str(info.root),
                "checkpoint": str(checkpoint),
                "exclude_parquet_dir": str(exclude_dir),
                "occupancy_root": str(occupancy_root),
                "per_event": args.per_event,
                "seed": args.seed,
                "allow_short": args.allow_short,
            },
            source_root=info.root,
            occupancy_root=occupancy_root,
            checkpoint=checkpoint_section(contract, checkpoint),
            action_normalization=normalization,
            counts=counts,
            shards=[shard.to_dict()],
            run={
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "workers": args.workers,
                "worker_prefetch": args.worker_prefetch,
                "elapsed_s": round(elapsed, 3),
                "rows_per_s": round(rate(tally.rows, elapsed), 2),
            },
            selection={
                "per_event": args.per_event,
                "candidates": selection.candidates,
                "selected": {e: len(v) for e, v in selection.selected.items()},
                "short": selection.short,
                "sample_ids": {e: [rows[i].sample_id for i in v] for e, v in selection.selected.items()},
                "excluded_episodes": len(excluded),
                "excluded_files": excluded_files,
            },
            collection=info.raw,
            occupancy_scenes=scene_fingerprints(occupancy_root, {r.scene_id for r in chosen}),
            skipped_items=[s.to_dict() for s in tally.skipped_items],
        )
        write_manifest(tmp, manifest)

    print(
        f"wrote {out_dir / OUTPUT_FILE}: {len(chosen)} rows ({args.per_event} per event requested) from "
        f"{len({r.episode_id for r in chosen})} episodes; {len(excluded)} episodes excluded"
    )
    print(f"speed: {rate(tally.rows, elapsed):.1f} converted rows/s with {args.workers} worker(s) ({elapsed:.2f} s)")
    print(f"manifest content sha256: {manifest_content_sha256(manifest)}")
    print_skips(manifest["skipped_items"])
    if counts["skipped"] or selection.short:
        print(
            f"NOT USABLE AS IS: counts.skipped = {counts['skipped']}, short events = {selection.short}", file=sys.stderr
        )
        return EXIT_NOT_USABLE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main))
