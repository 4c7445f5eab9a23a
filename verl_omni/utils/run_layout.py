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

Names, the pointer, the completeness test, the per-checkpoint file manifest (writing and verifying it) and
locating one checkpoint for a reader (:func:`locate_checkpoint`, :func:`dcp_data_file_problem`; used by the
exporter) live here; the resume choice, provenance and the commit protocol stay in
:mod:`verl_omni.trainer.checkpointing`.
Standard library only (and :mod:`verl_omni.data.hashing`): no torch, no Ray.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from verl_omni.data.hashing import file_sha256

POINTER = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
FILES_MANIFEST = "checkpoint_files.json"
FILES_FORMAT = "wnm-stage3-checkpoint-files/1"
ACTOR_DIR = "actor"
DCP_METADATA = ".metadata"  # written last by torch.distributed.checkpoint: a shard set without it is unfinished


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
    return (ckpt / TRAINER_STATE).is_file() and (ckpt / ACTOR_DIR / DCP_METADATA).is_file()


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


# ----- locating one checkpoint ---------------------------------------------------------------------------
class CheckpointLayoutError(ValueError):
    """A directory that is not a complete, intact checkpoint; the message starts with the path at fault."""


@dataclass(frozen=True)
class LocatedCheckpoint:
    """A complete checkpoint whose files match their manifest.

    Attributes:
        actor_dir: The FSDP2 shard directory (``.../actor``).
        checkpoint_dir: The checkpoint (``global_step_N`` or a hot-save destination).
        state: Its ``trainer_state.json``.
        step: ``state["step"]``.
    """

    actor_dir: Path
    checkpoint_dir: Path
    state: dict
    step: int


def locate_checkpoint(path: str | Path) -> LocatedCheckpoint:
    """Finds the checkpoint at ``path`` and checks it is complete and intact before anything reads a shard.

    Args:
        path: ``<run>/global_step_N``, ``<run>/global_step_N/actor``, or a hot-save destination (or its
            ``actor/``).

    Raises:
        CheckpointLayoutError: not a checkpoint, incomplete (a ``.partial`` directory, no trainer state), files
            that differ from :data:`FILES_MANIFEST`, or an unreadable trainer state.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise CheckpointLayoutError(f"{path}: directory does not exist")
    if (path / ACTOR_DIR / DCP_METADATA).is_file():
        actor_dir, ckpt_dir = path / ACTOR_DIR, path
    elif (path / DCP_METADATA).is_file():
        actor_dir, ckpt_dir = path, path.parent
    else:
        raise CheckpointLayoutError(
            f"{path}: no {DCP_METADATA} in it or in {path / ACTOR_DIR}; pass a run's global_step_N directory "
            f"(or its {ACTOR_DIR}/) or a hot-save snapshot"
        )
    if ckpt_dir.name.endswith(".partial"):
        raise CheckpointLayoutError(
            f"{ckpt_dir}: a .partial checkpoint is incomplete (the run stopped while writing it); use a complete "
            "global_step_N"
        )
    state_path = ckpt_dir / TRAINER_STATE
    if not state_path.is_file():
        raise CheckpointLayoutError(
            f"{ckpt_dir}: {TRAINER_STATE} is missing, so the checkpoint is incomplete (the driver writes it after "
            "every worker finished); use a complete checkpoint"
        )
    if (ckpt_dir / FILES_MANIFEST).is_file():
        # The trainer (and the hot save) record every file's size and sha256: check them before reading any.
        problems = verify_checkpoint(ckpt_dir)
        if problems:
            shown = "\n  ".join(problems[:10]) + (f"\n  (+{len(problems) - 10} more)" if len(problems) > 10 else "")
            raise CheckpointLayoutError(
                f"{ckpt_dir}: its files do not match {FILES_MANIFEST}:\n  {shown}\n"
                "copy the checkpoint again from the run, or use another global_step_N"
            )
    try:
        state = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointLayoutError(f"{state_path}: not valid JSON ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointLayoutError(f"{state_path}: must hold a JSON object")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointLayoutError(f"{state_path}: field 'step' must be a non-negative integer, got {step!r}")
    return LocatedCheckpoint(actor_dir=actor_dir, checkpoint_dir=ckpt_dir, state=state, step=step)


def dcp_data_file_problem(actor_dir: Path, storage_data: dict, prefix: str = "") -> str | None:
    """Whether every data file holding a tensor whose name starts with ``prefix`` exists and is long enough.

    Args:
        actor_dir: The DCP shard directory.
        storage_data: ``Metadata.storage_data`` of its ``.metadata``: index (with ``fqn``) -> storage info (with
            ``relative_path``, ``offset``, ``length``).
        prefix: Only tensors whose name starts with it (e.g. ``model.``) are needed.

    Returns:
        The first problem (a missing or truncated file, named with one tensor it holds), or None.
    """
    needed: dict[str, tuple[int, str]] = {}
    for index, info in storage_data.items():
        if not index.fqn.startswith(prefix):
            continue
        end = int(info.offset) + int(info.length)
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for rel, (end, fqn) in sorted(needed.items()):
        p = Path(actor_dir) / rel
        if not p.is_file():
            return (
                f"{p}: DCP shard file is missing (it holds {fqn!r} among others); the actor checkpoint is "
                f"incomplete, copy every file of {actor_dir} and retry"
            )
        size = p.stat().st_size
        if size < end:
            return f"{p}: DCP shard file is truncated ({size} bytes, {fqn!r} needs {end}); copy it again from the run"
    return None
