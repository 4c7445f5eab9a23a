"""The directory layout of a training run, shared by the trainer (:mod:`verl_omni.trainer.checkpointing`) and
the exporter (:mod:`verl_omni.models.wnm.export`), which both import it from here.

::

    <output_dir>/
      latest_checkpointed_iteration.txt     step N of the newest complete checkpoint (written last)
      global_step_N/                        one checkpoint (global_step_N.partial/ while it is written)
        trainer_state.json                  driver state: step, data position, metrics, resolved config
        checkpoint_files.json               size + sha256 of every other file of the checkpoint
        actor/                              FSDP2 shards (.metadata, __<rank>_0.distcp), per-rank extra state,
                                            model_contract.json

Names, the pointer, the completeness test and the per-checkpoint file manifest (writing and verifying it) live
here; the resume choice, provenance and the commit protocol stay in :mod:`verl_omni.trainer.checkpointing`.
Standard library only (and :mod:`verl_omni.data.hashing`): no torch, no Ray.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verl_omni.data.hashing import file_sha256

POINTER = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
FILES_MANIFEST = "checkpoint_files.json"
FILES_FORMAT = "wnm-stage3-checkpoint-files/1"


# ----- layout -----------------------------------------------------------------------------------------
def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"global_step_{step}"


def partial_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"global_step_{step}.partial"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(ckpt: Path) -> bool:
    """A finished checkpoint has the driver state and the sharded actor metadata (files present; see
    :func:`verify_checkpoint` for their integrity)."""
    return (ckpt / TRAINER_STATE).is_file() and (ckpt / "actor" / ".metadata").is_file()


def checkpoint_steps(output_dir: str | Path) -> list[int]:
    """Steps of every ``global_step_N`` directory (complete or not), newest first."""
    steps = []
    for p in Path(output_dir).glob("global_step_*"):
        tail = p.name.rsplit("_", 1)[1]
        if p.is_dir() and tail.isdigit():
            steps.append(int(tail))
    return sorted(steps, reverse=True)


def latest_step(output_dir: str | Path) -> int | None:
    """Step of the newest complete-looking checkpoint, or None (files present; not hash-verified).

    Follows the pointer; if the pointer is missing or names an incomplete directory (killed between the
    rename and the pointer write, or a directory removed by hand), falls back to the newest complete
    ``global_step_N``.
    """
    out = Path(output_dir)
    ptr = out / POINTER
    if ptr.is_file():
        try:
            step = int(ptr.read_text().strip())
            if is_complete(step_dir(out, step)):
                return step
        except ValueError:
            pass
    for s in checkpoint_steps(out):
        if is_complete(step_dir(out, s)):
            return s
    return None


# ----- file manifests ----------------------------------------------------------------------------------
def _files_of(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != FILES_MANIFEST)


def _hash_all(root: Path, rels: list[str]) -> list[str]:
    # hashlib releases the GIL: one thread per file (the ranks' shards) hashes them in parallel.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(rels)))) as pool:
        return list(pool.map(lambda r: file_sha256(root / r), rels))


def write_files_manifest(ckpt: Path, step: int) -> Path:
    """Writes ``checkpoint_files.json`` (size and sha256 of every file under ``ckpt``) atomically."""
    ckpt = Path(ckpt)
    rels = _files_of(ckpt)
    digests = _hash_all(ckpt, rels)
    files = {r: {"size": (ckpt / r).stat().st_size, "sha256": d} for r, d in zip(rels, digests, strict=True)}
    manifest = {"format": FILES_FORMAT, "step": int(step), "files": files}
    path = ckpt / FILES_MANIFEST
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def files_manifest_sha256(ckpt: Path) -> str | None:
    """Identity of a checkpoint: sha256 of its ``checkpoint_files.json`` (None when it has none)."""
    path = Path(ckpt) / FILES_MANIFEST
    return file_sha256(path) if path.is_file() else None


def verify_checkpoint(ckpt: Path, *, hashes: bool = True) -> list[str]:
    """Problems of a checkpoint directory against its file manifest (empty = intact).

    Every problem names the file and what is wrong with it. Sizes are checked first (cheap); with
    ``hashes`` every file's sha256 is recomputed too.
    """
    ckpt = Path(ckpt)
    path = ckpt / FILES_MANIFEST
    if not ckpt.is_dir():
        return [f"{ckpt}: not a directory"]
    if not path.is_file():
        missing = [n for n in (TRAINER_STATE, "actor/.metadata") if not (ckpt / n).is_file()]
        what = f"incomplete (lacks {', '.join(missing)})" if missing else "unverifiable"
        return [f"{path}: missing; the checkpoint is {what} (copied without it, or written by an older version)"]
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FILES_FORMAT or not isinstance(files, dict):
            raise ValueError(f"field 'format' is {manifest.get('format')!r}, expected {FILES_FORMAT!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return [f"{path}: unreadable file manifest ({type(e).__name__}: {e})"]
    problems = []
    present = []
    for rel, entry in sorted(files.items()):
        p = ckpt / rel
        if not p.is_file():
            problems.append(f"{p}: missing (the manifest lists {entry['size']} bytes)")
            continue
        size = p.stat().st_size
        if size != entry["size"]:
            problems.append(f"{p}: {size} bytes, the manifest records {entry['size']} (truncated or replaced)")
            continue
        present.append(rel)
    if hashes and present:
        for rel, digest in zip(present, _hash_all(ckpt, present), strict=True):
            if digest != files[rel]["sha256"]:
                problems.append(f"{ckpt / rel}: sha256 differs from the manifest (the file is corrupted or replaced)")
    return problems
