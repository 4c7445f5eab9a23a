#!/usr/bin/env python
"""Merge the trained DiT of a Stage-III actor checkpoint into a copy of the complete base checkpoint.

The output is a complete WNM checkpoint: the base's frozen parts, config.json and action_normalization.json
byte for byte, the transformer weights of the actor (in the base's file/shard layout and dtypes), a README.md
model card of its own (run, step, training settings, the base's card as lineage), and a new
checkpoint_manifest.json with fresh sha256s and the provenance (base manifest hash, run, step, actor dir).

Refusals write nothing: an existing --output-dir, an actor trained from a checkpoint with another contract
(the differing fields are listed), tensors missing/unexpected/of another shape, a missing or truncated DCP
shard file, an incomplete checkpoint, a file that differs from the checkpoint's checkpoint_files.json (size or
sha256; checked before any shard is read).

Examples:
    python tools/checkpoint/export_wnm_checkpoint.py --base-vln $WNM3D_INITIAL_CHECKPOINT \\
        --actor-checkpoint $WAM_OUTPUT_DIR/global_step_200 --output-dir /ckpt/wnm3d_stage3_step200 --dry-run
    python tools/checkpoint/export_wnm_checkpoint.py --base-vln $WNM3D_INITIAL_CHECKPOINT \\
        --actor-checkpoint $WAM_OUTPUT_DIR/global_step_200 --output-dir /ckpt/wnm3d_stage3_step200

Exit codes: 0 done (or dry run printed); 2 refused or bad arguments, nothing written; 3 failed while
writing, nothing written (the staging directory is removed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_REFUSED, EXIT_FAILED = 0, 2, 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-vln", required=True, type=Path, help="complete base WNM checkpoint the run started from")
    p.add_argument(
        "--actor-checkpoint",
        required=True,
        type=Path,
        help="run checkpoint <WAM_OUTPUT_DIR>/global_step_N (or its actor/), or a hot-save snapshot",
    )
    p.add_argument("--output-dir", required=True, type=Path, help="directory to create (must not exist)")
    p.add_argument("--dry-run", action="store_true", help="print tensors and what would change; write nothing")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p.parse_args(argv)


def _print_table(changes, casts) -> None:
    width = max([len(c.name) for c in changes] + [6])
    print(f"{'tensor':<{width}}  {'shape':<22}{'dtype':<10}{'max|delta|':>12}  changed")
    for c in sorted(changes, key=lambda c: c.name):
        dtype = str(c.spec.dtype).removeprefix("torch.")
        if c.name in casts:
            dtype += f" (from {str(c.actor_dtype).removeprefix('torch.')})"
        shape = "x".join(str(d) for d in c.spec.shape) or "scalar"
        print(f"{c.name:<{width}}  {shape:<22}{dtype:<10}{c.max_abs_delta:>12.4g}  {'yes' if c.changed else 'no'}")


def _print_summary(plan, result, elapsed: float, dry: bool) -> None:
    changes = result.changes
    n_changed = len(result.changed)
    params = sum(int(_numel(c.spec.shape)) for c in changes)
    dtypes: dict[str, int] = {}
    for c in changes:
        key = str(c.spec.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + 1
    top = sorted((c for c in changes if c.max_abs_delta > 0), key=lambda c: c.max_abs_delta, reverse=True)[:5]
    head = "dry run (nothing written)" if dry else f"wrote {result.output_dir}"
    print(f"\n{head}")
    print(f"  base        {plan.base_dir} (manifest sha256 {plan.base_manifest_sha256[:16]}...)")
    print(f"  actor       {plan.actor.actor_dir} (step {plan.actor.step}, run {plan.actor.run_output_dir})")
    print(f"  tensors     {len(changes)} ({params:,} values; dtypes {dtypes}), changed {n_changed}")
    if plan.casts:
        print(f"  casts       {len(plan.casts)} tensor(s) cast from the actor's fp32 master weights to the base dtype")
    if top:
        print("  largest max|delta|: " + ", ".join(f"{c.name} {c.max_abs_delta:.3g}" for c in top))
    verb = "would rewrite" if dry else "rewrote"
    print(
        f"  files       {verb} {len(plan.rewritten_files)} transformer file(s); {len(plan.copied_files)} copied as is"
    )
    if n_changed == 0:
        print("  warning     no tensor differs from the base: the actor never changed the weights (step 0?)")
    print(f"  elapsed     {elapsed:.1f}s")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from verl_omni.models.wnm.checkpoint import CheckpointError, ContractMismatchError
    from verl_omni.models.wnm.export import ExportError, check_output_dir, dry_run, export_checkpoint, plan_export

    t0 = time.time()
    try:
        out = check_output_dir(args.output_dir)
        plan = plan_export(args.base_vln, args.actor_checkpoint)
        if not args.dry_run:
            check_output_dir(out, plan.bytes_needed())
    except (ExportError, CheckpointError, ContractMismatchError) as e:
        print(f"error: {e}\nnothing was written.", file=sys.stderr)
        return EXIT_REFUSED

    total = len(plan.layout.files) + (0 if args.dry_run else len(plan.copied_files))
    bar = tqdm(total=total, desc="export" if not args.dry_run else "compare", unit="file", disable=args.no_progress)

    def progress(name: str) -> None:
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update(1)

    try:
        result = dry_run(plan, progress) if args.dry_run else export_checkpoint(plan, out, progress)
    except (ExportError, CheckpointError) as e:
        bar.close()
        print(f"error: {e}\nnothing was written.", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:
        bar.close()
        print(f"error: writing {out} failed: {e}\nnothing was written (staging removed).", file=sys.stderr)
        return EXIT_FAILED
    bar.close()
    if args.dry_run:
        _print_table(result.changes, plan.casts)
        print(f"\noutput {out} is free; the export would write the files listed above")
    _print_summary(plan, result, time.time() - t0, args.dry_run)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
