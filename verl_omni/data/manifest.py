"""``manifest.json`` of a Stage-III dataset directory: building, atomic writing, reading, validation.

Every data tool writes one manifest beside its shards. It records the format version,
counts (episodes, records, rows, skipped and skipped-by-reason), each shard with its row count and
sha256, the data-contract checkpoint's model-config and transform-metadata hashes, the complete
``action_normalization.json``, the tool's arguments and the source roots.

Everything except the ``run`` section (timestamps, worker counts, speed) is a deterministic function
of the inputs and arguments; :func:`manifest_content_sha256` hashes the manifest without it, so two runs
with the same inputs have equal content hashes. ``validate_manifest`` is the one check the tools and
``validate.sh`` share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_omni.data.hashing import canonical_json_sha256, file_sha256
from verl_omni.data.schema import ROWS_FORMAT, SPLITS

MANIFEST_FORMAT = "verl-omni-stage3-manifest/1"
MANIFEST_NAME = "manifest.json"
KINDS = ("converted", "train_subset", "event_val")
RUN_SECTION = "run"
REQUIRED_KEYS = (
    "format",
    "kind",
    "rows_format",
    "tool",
    "args",
    "source_root",
    "occupancy_root",
    "checkpoint",
    "action_normalization",
    "counts",
    "shards",
)
CHECKPOINT_KEYS = ("model_config", "transform_metadata", "model_config_hash", "transform_metadata_hash")
COUNT_KEYS = ("episodes", "records", "rows", "rows_by_split", "skipped", "skipped_by_reason")


class ManifestError(ValueError):
    """A manifest file is missing or not a Stage-III manifest."""


def checkpoint_section(contract: Mapping[str, Any], checkpoint_path: str | Path) -> dict:
    """The manifest's ``checkpoint`` section from a ``read_checkpoint_contract`` result."""
    missing = [k for k in (*CHECKPOINT_KEYS, "action_normalization") if k not in contract]
    if missing:
        raise ManifestError(f"checkpoint contract of {checkpoint_path} lacks {missing}")
    section = {k: contract[k] for k in CHECKPOINT_KEYS}
    section["path"] = str(Path(checkpoint_path).expanduser().resolve())
    section["action_normalization_sha256"] = canonical_json_sha256(contract["action_normalization"])
    return section


def build_manifest(
    *,
    kind: str,
    tool: str,
    args: Mapping[str, Any],
    source_root: str | Path,
    occupancy_root: str | Path,
    checkpoint: Mapping[str, Any],
    action_normalization: Mapping[str, Any],
    counts: Mapping[str, Any],
    shards: list[Mapping[str, Any]],
    run: Mapping[str, Any],
    **sections: Any,
) -> dict:
    """Assembles a manifest dict (see module docstring); extra keyword sections are stored as given."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    # A JSON round trip: deep copy (callers keep their dicts) and an early error on unserializable values.
    copy = json.loads(
        json.dumps(
            {
                "args": args,
                "checkpoint": checkpoint,
                "action_normalization": action_normalization,
                "counts": counts,
                "shards": shards,
                "run": run,
                "sections": sections,
            },
            allow_nan=False,
        )
    )
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": kind,
        "rows_format": ROWS_FORMAT,
        "tool": tool,
        "args": copy["args"],
        "source_root": str(source_root),
        "occupancy_root": str(occupancy_root),
        "checkpoint": copy["checkpoint"],
        "action_normalization": copy["action_normalization"],
        "counts": copy["counts"],
        "shards": copy["shards"],
        RUN_SECTION: copy["run"],
    }
    for key, value in copy["sections"].items():
        if key in manifest:
            raise ValueError(f"section {key!r} is reserved")
        manifest[key] = value
    return manifest


def manifest_content_sha256(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest without its ``run`` section (equal for equal inputs and arguments)."""
    return canonical_json_sha256({k: v for k, v in manifest.items() if k != RUN_SECTION})


def write_manifest(directory: str | Path, manifest: Mapping[str, Any]) -> Path:
    """Writes ``<directory>/manifest.json`` via a temp file + rename; refuses to overwrite."""
    path = Path(directory) / MANIFEST_NAME
    if path.exists():
        raise FileExistsError(f"{path}: already exists; refusing to overwrite")
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def resolve_manifest_path(path: str | Path) -> Path:
    """Accepts a manifest file, a directory containing ``manifest.json``, or a Parquet shard beside one."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p / MANIFEST_NAME
    if p.suffix == ".parquet":
        return p.with_name(MANIFEST_NAME)
    return p


def read_manifest(path: str | Path) -> dict:
    """Reads a manifest (file or directory).

    Raises:
        ManifestError: missing file, invalid JSON, or not a Stage-III manifest.
    """
    p = resolve_manifest_path(path)
    if not p.is_file():
        raise ManifestError(f"{p}: manifest not found")
    try:
        manifest = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise ManifestError(f"{p}: field 'format' is {fmt!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


def manifest_contract(manifest: Mapping[str, Any]) -> dict:
    """The checkpoint contract recorded in a manifest, in ``read_checkpoint_contract``'s layout."""
    ckpt = manifest["checkpoint"]
    contract = {k: ckpt[k] for k in CHECKPOINT_KEYS}
    contract["action_normalization"] = manifest["action_normalization"]
    return contract


def shard_paths(manifest_path: str | Path, manifest: Mapping[str, Any], split: str | None = None) -> list[Path]:
    """Absolute shard paths of a manifest in recorded order, optionally of one split only."""
    base = resolve_manifest_path(manifest_path).parent
    return [base / s["file"] for s in manifest["shards"] if split is None or s["split"] == split]


def _structure_problems(m: Mapping[str, Any], where: str) -> tuple[list[str], bool]:
    """Problems of the manifest's own content, and whether the shards can be checked against it."""
    missing = [f"{where}: missing field {k!r}" for k in REQUIRED_KEYS if k not in m]
    if missing:
        return missing, False
    problems = []
    if m["kind"] not in KINDS:
        problems.append(f"{where}: field 'kind' is {m['kind']!r}, expected one of {KINDS}")
    if m["rows_format"] != ROWS_FORMAT:
        problems.append(f"{where}: field 'rows_format' is {m['rows_format']!r}, this code reads {ROWS_FORMAT!r}")
    ckpt = m["checkpoint"]
    if not isinstance(ckpt, dict):
        problems.append(f"{where}: field 'checkpoint' must be an object")
    else:
        problems += [f"{where}: checkpoint.{k} missing" for k in CHECKPOINT_KEYS if not ckpt.get(k)]
    norm = m["action_normalization"]
    if not isinstance(norm, dict):
        problems.append(f"{where}: field 'action_normalization' must be an object")
    else:
        from verl_omni.data.actions import ActionNormalization

        try:
            ActionNormalization.from_dict(norm, source=f"{where}: action_normalization")
        except ValueError as e:
            problems.append(str(e))
    counts, shards = m["counts"], m["shards"]
    if not isinstance(counts, dict) or any(k not in counts for k in COUNT_KEYS):
        return problems + [f"{where}: field 'counts' must be an object with {list(COUNT_KEYS)}"], False
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        return problems + [f"{where}: field 'shards' must be a list of objects"], False
    shards_ok = True
    for s in shards:
        lacking = [k for k in ("file", "split", "rows", "sha256") if k not in s]
        if lacking:
            problems.append(f"{where}: shard entry {s} lacks {lacking}")
            shards_ok = False
        elif s["split"] not in SPLITS or "/" in s["file"] or s["file"].startswith("."):
            problems.append(f"{where}: shard entry {s['file']!r} has a bad split or file name")
            shards_ok = False
    by_reason = counts["skipped_by_reason"]
    if not isinstance(by_reason, dict) or sum(by_reason.values()) != counts["skipped"]:
        problems.append(
            f"{where}: counts.skipped ({counts['skipped']}) != sum of counts.skipped_by_reason ({by_reason})"
        )
    if not shards_ok:
        return problems, False
    total = sum(s["rows"] for s in shards)
    if total != counts["rows"]:
        problems.append(f"{where}: shards hold {total} rows but counts.rows is {counts['rows']}")
    for split in SPLITS:
        n = sum(s["rows"] for s in shards if s["split"] == split)
        recorded = counts["rows_by_split"].get(split, 0)
        if n != recorded:
            problems.append(f"{where}: {split} shards hold {n} rows but counts.rows_by_split.{split} is {recorded}")
    return problems, True


def _shard_problems(manifest_path: Path, m: Mapping[str, Any], check_hashes: bool) -> list[str]:
    import pyarrow.parquet as pq

    from verl_omni.data.schema import schema_problems

    problems = []
    base = manifest_path.parent
    for s in m["shards"]:
        p = base / s["file"]
        if not p.is_file():
            problems.append(f"{p}: shard listed in {manifest_path} is missing")
            continue
        if check_hashes and file_sha256(p) != s["sha256"]:
            problems.append(f"{p}: sha256 differs from the manifest; the shard was modified or replaced")
            continue
        try:
            meta = pq.read_metadata(p)
            schema = pq.read_schema(p)
        except OSError as e:
            problems.append(f"{p}: not a readable Parquet file ({e})")
            continue
        if meta.num_rows != s["rows"]:
            problems.append(f"{p}: has {meta.num_rows} rows, manifest says {s['rows']}")
        problems += [f"{p}: {msg}" for msg in schema_problems(schema)]
    return problems


def _reference_problems(
    manifest_path: Path, m: Mapping[str, Any], source_root: Path, occupancy_root: Path
) -> list[str]:
    from verl_omni.data.parquet_io import read_shards

    problems = []
    try:
        table = read_shards(shard_paths(manifest_path, m), columns=["history_video", "target_video", "occupancy"])
    except (OSError, ValueError) as e:
        return [f"{manifest_path}: cannot read shards to check references ({e})"]
    videos = set(table.column("history_video").to_pylist()) | set(table.column("target_video").to_pylist())
    missing = sorted(v for v in videos if not (source_root / v).is_file())
    if missing:
        problems.append(
            f"{len(missing)} referenced video(s) not found under source root {source_root}, "
            f"e.g. {missing[:3]}; fix source_root or restore the collection"
        )
    scenes = set(table.column("occupancy").to_pylist())
    missing = sorted(s for s in scenes if not (occupancy_root / s / "occupancy.png").is_file())
    if missing:
        problems.append(f"{len(missing)} occupancy scene(s) not found under {occupancy_root}, e.g. {missing[:3]}")
    return problems


def contract_problems(manifest: Mapping[str, Any], checkpoint: str | Path | Mapping[str, Any], where: str) -> list[str]:
    """Differences between the manifest's recorded contract and a checkpoint (dir or contract dict)."""
    from verl_omni.contracts import check_contract_compatibility

    report = check_contract_compatibility(manifest_contract(manifest), checkpoint)
    return [
        f"{where}: data contract differs from checkpoint {checkpoint if isinstance(checkpoint, (str, Path)) else ''}"
        f": {d}"
        for d in report.differences
    ]


def validate_manifest(
    path: str | Path,
    *,
    check_hashes: bool = True,
    require_no_skipped: bool = True,
    checkpoint: str | Path | Mapping[str, Any] | None = None,
    expected_rows: int | None = None,
    min_rows: int | None = None,
    kind: str | None = None,
    check_references: bool = False,
    source_root: str | Path | None = None,
    occupancy_root: str | Path | None = None,
) -> list[str]:
    """Checks a dataset directory against its manifest; returns one message per problem (empty = valid).

    Args:
        path: ``manifest.json`` or the directory holding it.
        check_hashes: Recompute every shard's sha256.
        require_no_skipped: Report ``counts.skipped != 0`` (downstream training requires 0).
        checkpoint: Checkpoint dir or contract dict that must be contract-compatible with the data.
        expected_rows: Exact total row count required (e.g. ``WAM_EXPECTED_TRAIN_SIZE``).
        min_rows: Minimum total row count (e.g. ``WAM_VAL_MAX_SAMPLES``).
        kind: Required manifest kind.
        check_references: Check that every referenced video and occupancy scene exists.
        source_root: Override of the recorded collection root (data moved to another machine).
        occupancy_root: Override of the recorded occupancy root.
    """
    p = resolve_manifest_path(path)
    where = str(p)
    try:
        m = read_manifest(p)
    except ManifestError as e:
        return [str(e)]
    problems, shards_checkable = _structure_problems(m, where)
    if not shards_checkable:
        return problems
    counts = m["counts"]
    if kind is not None and m["kind"] != kind:
        problems.append(f"{where}: kind is {m['kind']!r}, expected {kind!r}")
    if require_no_skipped and counts["skipped"] != 0:
        reasons = {k: v for k, v in counts["skipped_by_reason"].items() if v}
        problems.append(
            f"{where}: counts.skipped is {counts['skipped']} ({reasons}); Stage-III needs 0: fix or remove "
            f"the listed episodes (see skipped_items) and convert again"
        )
    if expected_rows is not None and counts["rows"] != expected_rows:
        problems.append(f"{where}: counts.rows is {counts['rows']}, expected exactly {expected_rows}")
    if min_rows is not None and counts["rows"] < min_rows:
        problems.append(f"{where}: counts.rows is {counts['rows']}, need at least {min_rows}")
    if counts["rows"] == 0:
        problems.append(f"{where}: dataset has no rows")
    problems += _shard_problems(p, m, check_hashes)
    if checkpoint is not None:
        problems += contract_problems(m, checkpoint, where)
    if check_references and not problems:
        src = Path(source_root) if source_root is not None else Path(m["source_root"])
        occ = Path(occupancy_root) if occupancy_root is not None else Path(m["occupancy_root"])
        problems += _reference_problems(p, m, src, occ)
    return problems
