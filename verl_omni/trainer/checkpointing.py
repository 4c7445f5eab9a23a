"""Checkpoint directory layout of a training run, and the crash-safe ``latest`` pointer.

::

    <output_dir>/
      latest_checkpointed_iteration.txt     step N of the newest complete checkpoint (written last)
      global_step_N/
        trainer_state.json                  step, data position, metrics, resolved config (driver)
        actor/                              written by the actor workers
          .metadata, __<rank>_0.distcp      FSDP2 sharded model + optimizer (torch.distributed.checkpoint)
          extra_state_rank_<r>.pt           RNG states, LR scheduler, weight version (per rank)
          model_contract.json               model config, transform metadata, action normalization,
                                            initial checkpoint path: what the exporter checks against

A checkpoint is first written to ``global_step_N.partial/`` and renamed to ``global_step_N/`` only
when every worker and the driver finished; the pointer is replaced after the rename. A crash at any
moment leaves either the previous checkpoint as ``latest`` or the new one complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

POINTER = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"


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
    """A finished checkpoint has the driver state and the sharded actor metadata."""
    return (ckpt / TRAINER_STATE).is_file() and (ckpt / "actor" / ".metadata").is_file()


def latest_step(output_dir: str | Path) -> int | None:
    """Step of the newest complete checkpoint, or None.

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
    steps = []
    for p in out.glob("global_step_*"):
        if p.is_dir() and not p.name.endswith(".partial"):
            try:
                steps.append(int(p.name.rsplit("_", 1)[1]))
            except ValueError:
                continue
    for s in sorted(steps, reverse=True):
        if is_complete(step_dir(out, s)):
            return s
    return None


def begin(output_dir: str | Path, step: int) -> Path:
    """Creates a clean ``global_step_N.partial/actor`` and returns the partial directory."""
    part = partial_dir(output_dir, step)
    if part.exists():
        shutil.rmtree(part)  # leftovers of a crash during an earlier attempt at the same step
    (part / "actor").mkdir(parents=True)
    return part


def commit(output_dir: str | Path, step: int, trainer_state: dict) -> Path:
    """Writes the driver state, renames the partial directory and moves the pointer (in that order)."""
    out = Path(output_dir)
    part = partial_dir(out, step)
    atomic_write_text(part / TRAINER_STATE, json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
    final = step_dir(out, step)
    if final.exists():
        # Only possible when a run re-does a step it had already saved (resume with resume=never into the
        # same directory is refused earlier); keep the old one aside rather than deleting user data.
        final.rename(out / f"global_step_{step}.replaced")
    part.rename(final)
    atomic_write_text(out / POINTER, f"{step}\n")
    return final


def prune(output_dir: str | Path, keep: int) -> list[Path]:
    """Removes all but the newest ``keep`` complete checkpoints (``keep == 0`` keeps everything)."""
    if keep <= 0:
        return []
    out = Path(output_dir)
    complete = sorted(
        (int(p.name.rsplit("_", 1)[1]), p)
        for p in out.glob("global_step_*")
        if p.is_dir() and p.name.rsplit("_", 1)[1].isdigit() and is_complete(p)
    )
    removed = []
    for _, p in complete[:-keep]:
        shutil.rmtree(p)
        removed.append(p)
    return removed


def read_trainer_state(ckpt: Path) -> dict:
    path = Path(ckpt) / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: checkpoint has no trainer state; it is incomplete") from e
