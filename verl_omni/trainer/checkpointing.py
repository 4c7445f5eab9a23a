"""Checkpoint directory layout of a training run: the crash-safe ``latest`` pointer, per-checkpoint file
manifests, the choice of the checkpoint to resume from, and the run directory's provenance.

::

    <output_dir>/
      latest_checkpointed_iteration.txt     step N of the newest complete checkpoint (written last)
      run_provenance.json                   what the run was started with (compared on every relaunch)
      global_step_N/
        trainer_state.json                  step, data position, metrics, resolved config (driver)
        checkpoint_files.json               size + sha256 of every other file (driver, before the rename)
        actor/                              written by the actor workers
          .metadata, __<rank>_0.distcp      FSDP2 sharded model + optimizer (torch.distributed.checkpoint)
          extra_state_rank_<r>.pt           RNG states, LR scheduler, weight version (per rank)
          model_contract.json               model config, transform metadata, action normalization,
                                            initial checkpoint path: what the exporter checks against

A checkpoint is first written to ``global_step_N.partial/``; when every worker and the driver finished,
the driver hashes every file into ``checkpoint_files.json`` and only then renames the directory to
``global_step_N/``; the pointer is replaced after the rename. A crash at any moment leaves either the
previous checkpoint as ``latest`` or the new one complete, and a file damaged later (a copy cut short, a
full disk, a bit flip) no longer matches its recorded size or hash.

On resume :func:`choose_resume` verifies checkpoints newest first: the newest intact one is used and every
newer damaged one is reported (the driver logs it and writes the TensorBoard scalar
``checkpoint/resume_fallback``); when no checkpoint is intact it refuses with the way out. A damaged
checkpoint is never named as the one to resume from.

Provenance (:func:`run_provenance`) is a flat mapping ``item -> value``: the recipe, every locked constant,
every other setting, the identities of both checkpoints and of both datasets (content hashes of their
manifests, not their paths) and the topology. :func:`compare_provenance` names each differing item; only
the items in :data:`RESUMABLE_KNOBS` may change on resume, and only when ``WAM_RESUME_OVERRIDE`` lists them
(the accepted change is logged in the file's ``history``). ``validate.sh`` and the driver run the same
comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_omni.data.hashing import file_sha256 as _sha256

# The run-directory layout (names, pointer, file manifests) is shared with the exporter; re-exported here.
from verl_omni.utils.run_layout import (  # noqa: F401
    FILES_FORMAT,
    FILES_MANIFEST,
    POINTER,
    TRAINER_STATE,
    atomic_write_text,
    checkpoint_steps,
    files_manifest_sha256,
    is_complete,
    latest_step,
    partial_dir,
    step_dir,
    verify_checkpoint,
    write_files_manifest,
)

PROVENANCE = "run_provenance.json"
PROVENANCE_FORMAT = "wnm-stage3-run-provenance/1"
OVERRIDE_VAR = "WAM_RESUME_OVERRIDE"

# Settings that may change when a run resumes (only with an explicit WAM_RESUME_OVERRIDE): run length,
# intervals, bookkeeping and execution options that leave the optimisation problem unchanged.
RESUMABLE_KNOBS = {
    "trainer.total_steps": "WAM_TOTAL_STEPS",
    "trainer.save_freq": "WAM_SAVE_FREQ",
    "trainer.val_freq": "WAM_VAL_FREQ",
    "trainer.log_media_freq": "",
    "trainer.max_checkpoints_to_keep": "",
    "trainer.experiment_name": "",
    "algorithm.max_nonfinite_updates": "",
    "data.val_max_samples": "WAM_VAL_MAX_SAMPLES",
    "actor.compile": "WAM_COMPILE",
    "actor.attention_backend": "WAM_ATTENTION_BACKEND",
    "actor.param_offload": "",
    "actor.optimizer_offload": "",  # field removed (never read); kept so older run directories can resume
    "actor.gradient_checkpointing": "",
    "actor.checkpoint_blocks": "",
    "actor.activation_memory_budget": "",
    "rollout.backend": "WAM_ROLLOUT_BACKEND",
    "reward.num_workers": "WAM_REWARD_WORKERS",
}
# Config fields replaced by identities (paths may move; their content may not change) or not compared.
_PATH_ITEMS = {
    "model.initial_checkpoint",
    "model.data_contract_checkpoint",
    "data.train_root",
    "data.val_file",
    "trainer.output_dir",
    "trainer.resume",
}


class CheckpointIntegrityError(RuntimeError):
    """No checkpoint of the run directory is intact; the message says what is damaged and what to do."""


class ProvenanceError(ValueError):
    """A relaunch into a run directory differs from what the run was started with."""


@dataclass
class ResumeChoice:
    """Outcome of :func:`choose_resume`: the step to resume from (None = start fresh) and the newer
    checkpoints that were skipped because they are damaged (``[(step, problems)]``, newest first)."""

    step: int | None
    path: Path | None
    damaged: list[tuple[int, list[str]]] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        return self.step is not None and bool(self.damaged)

    def describe_damage(self) -> str:
        lines = []
        for step, problems in self.damaged:
            lines.append(f"  global_step_{step} is damaged:")
            lines += [f"    {p}" for p in problems[:5]]
            if len(problems) > 5:
                lines.append(f"    (+{len(problems) - 5} more)")
        return "\n".join(lines)


def choose_resume(output_dir: str | Path) -> ResumeChoice:
    """The newest intact checkpoint of ``output_dir`` and the damaged ones newer than it.

    Raises:
        CheckpointIntegrityError: checkpoints exist but none is intact; the message lists each damaged
            file and the ways out.
    """
    out = Path(output_dir)
    damaged: list[tuple[int, list[str]]] = []
    for step in checkpoint_steps(out):
        problems = verify_checkpoint(step_dir(out, step))
        if not problems:
            return ResumeChoice(step, step_dir(out, step), damaged)
        damaged.append((step, problems))
    if not damaged:
        return ResumeChoice(None, None)
    choice = ResumeChoice(None, None, damaged)
    names = " ".join(str(step_dir(out, s)) for s, _ in damaged)
    raise CheckpointIntegrityError(
        f"no intact checkpoint in {out}; nothing was loaded:\n{choice.describe_damage()}\nWays out: restore the "
        f"listed files from a copy of the run (then relaunch), or move the damaged checkpoint(s) aside "
        f'(e.g. `for d in {names}; do mv "$d" "$d.damaged"; done`) to train this run again from the initial '
        "checkpoint, or set a new WAM_OUTPUT_DIR"
    )


def latest_intact(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes :func:`verify_checkpoint` (for messages), or None."""
    try:
        return choose_resume(output_dir).path
    except CheckpointIntegrityError:
        return None


# ----- writing -------------------------------------------------------------------------------------------
def begin(output_dir: str | Path, step: int) -> Path:
    """Creates a clean ``global_step_N.partial/actor`` and returns the partial directory."""
    part = partial_dir(output_dir, step)
    if part.exists():
        shutil.rmtree(part)  # leftovers of a crash during an earlier attempt at the same step
    (part / "actor").mkdir(parents=True)
    return part


def commit(output_dir: str | Path, step: int, trainer_state: dict) -> Path:
    """Writes the driver state and the file manifest, renames the partial directory and moves the pointer
    (in that order)."""
    out = Path(output_dir)
    part = partial_dir(out, step)
    atomic_write_text(part / TRAINER_STATE, json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
    write_files_manifest(part, step)
    final = step_dir(out, step)
    if final.exists():
        # A run re-doing a step it had already saved: after falling back from a damaged checkpoint, or a
        # resume=never run refused earlier. Keep the old one aside rather than deleting user data.
        aside = out / f"global_step_{step}.replaced"
        if aside.exists():
            aside = out / f"global_step_{step}.replaced.{int(time.time())}"
        final.rename(aside)
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


# ----- provenance ------------------------------------------------------------------------------------------
def dataset_identity(path: str | Path) -> str:
    """``kind:content-sha256`` of a dataset's manifest (file, its directory, or a Parquet file beside it).

    The content hash leaves out the manifest's ``run`` section (timestamps), so equal data built twice has
    one identity, and a moved directory keeps it.
    """
    from verl_omni.data.manifest import ManifestError, manifest_content_sha256, read_manifest

    try:
        m = read_manifest(path)
    except ManifestError as e:
        return f"unreadable: {e}"
    return f"{m.get('kind')}:{manifest_content_sha256(m)}"


def checkpoint_identity(path: str | Path) -> str:
    """sha256 of a WNM checkpoint's ``checkpoint_manifest.json`` (which lists every file's sha256)."""
    from verl_omni.contracts import MANIFEST_NAME

    p = Path(path) / MANIFEST_NAME
    return f"checkpoint_manifest:{_sha256(p)}" if p.is_file() else f"unreadable: {p} not found"


def run_provenance(cfg_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``item -> value`` record of a run from its resolved config (``Stage3Config.to_dict()``)."""
    from verl_omni.trainer.locked_recipe import flatten, is_locked_key

    flat = flatten(cfg_dict)
    items: dict[str, Any] = {}
    for key, value in sorted(flat.items()):
        if key in _PATH_ITEMS:
            continue
        if key == "recipe":
            items["recipe"] = value
        elif is_locked_key(key):
            items[f"locked:{key}"] = value
        elif key.startswith("topology."):
            items[f"topology:{key}"] = value
        else:
            items[f"setting:{key}"] = value
    topo = cfg_dict.get("topology", {})
    per_node = topo.get("gpus_per_node") or topo.get("cpu_workers_per_node")
    items["topology:world_size"] = int(topo.get("nnodes", 1)) * int(per_node or 0)
    model, data = cfg_dict.get("model", {}), cfg_dict.get("data", {})
    items["checkpoint:model.initial_checkpoint"] = checkpoint_identity(model.get("initial_checkpoint", ""))
    items["checkpoint:model.data_contract_checkpoint"] = checkpoint_identity(model.get("data_contract_checkpoint", ""))
    items["dataset:data.train_root"] = dataset_identity(data.get("train_root", ""))
    items["dataset:data.val_file"] = dataset_identity(data["val_file"]) if data.get("val_file") else None
    return json.loads(json.dumps(items, sort_keys=True, default=str))  # the values as a JSON round trip reads them


def _knob(item: str) -> str:
    return item.split(":", 1)[1] if ":" in item else item


def requested_overrides(env: Mapping[str, str] | None = None) -> set[str]:
    """Config keys listed in ``WAM_RESUME_OVERRIDE`` (comma/space separated; variable names accepted)."""
    raw = (env if env is not None else os.environ).get(OVERRIDE_VAR, "")
    by_var = {v: k for k, v in RESUMABLE_KNOBS.items() if v}
    return {by_var.get(t, t) for t in raw.replace(",", " ").split() if t}


@dataclass
class ProvenanceCheck:
    """Result of :func:`check_provenance`: what to record and what to log."""

    action: str  # "new" (nothing recorded yet), "same", "override" or "replaced" (no checkpoint existed)
    record: dict
    messages: list[str] = field(default_factory=list)


def _fmt(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def check_provenance(
    output_dir: str | Path, current: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> ProvenanceCheck:
    """Compares ``current`` (:func:`run_provenance`) with ``output_dir/run_provenance.json``.

    Returns what to write (by the driver: :func:`write_provenance`) and what to log. A run directory
    without a recorded provenance or without any checkpoint accepts the current one.

    Raises:
        ProvenanceError: an item differs and is not overridable, or overridable but not listed in
            ``WAM_RESUME_OVERRIDE``; the message names each item (recorded vs now) and the two ways out.
    """
    out = Path(output_dir)
    path = out / PROVENANCE
    now = {"format": PROVENANCE_FORMAT, "items": dict(current), "history": [], "checkpoints": {}}
    has_ckpt = bool(checkpoint_steps(out))
    if not path.is_file():
        msgs = []
        if has_ckpt:
            msgs.append(f"{path} not found: recording the current provenance (earlier steps were not recorded)")
        return ProvenanceCheck("new", now, msgs)
    try:
        old = json.loads(path.read_text())
        if old.get("format") != PROVENANCE_FORMAT or not isinstance(old.get("items"), dict):
            raise ValueError(f"field 'format' is {old.get('format')!r}, expected {PROVENANCE_FORMAT!r}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ProvenanceError(
            f"{path}: unreadable ({e}); restore it from a copy of the run or set a new WAM_OUTPUT_DIR"
        ) from e
    recorded = old["items"]
    now["history"] = list(old.get("history", []))
    now["checkpoints"] = dict(old.get("checkpoints", {}))
    diffs = [
        (item, recorded.get(item, "<absent>"), current.get(item, "<absent>"))
        for item in sorted(set(recorded) | set(current))
        if recorded.get(item, "<absent>") != current.get(item, "<absent>")
    ]
    if not diffs:
        return ProvenanceCheck("same", now)
    if not has_ckpt:
        names = ", ".join(d[0] for d in diffs)
        now["history"].append({"time": time.time(), "replaced_without_checkpoint": [d[0] for d in diffs]})
        return ProvenanceCheck("replaced", now, [f"{path}: no checkpoint yet, recording the new provenance ({names})"])
    allowed = requested_overrides(env)
    blocking = [d for d in diffs if _knob(d[0]) not in allowed or _knob(d[0]) not in RESUMABLE_KNOBS]
    if blocking:
        lines = [f"{out} was started with other inputs; refusing to resume onto them ({len(blocking)} item(s)):"]
        for item, was, is_ in blocking:
            knob = _knob(item)
            tag = " [may change on resume]" if knob in RESUMABLE_KNOBS else ""
            lines.append(f"  {item}{tag}: recorded {_fmt(was)}, now {_fmt(is_)}")
        overridable = [_knob(d[0]) for d in blocking if _knob(d[0]) in RESUMABLE_KNOBS]
        lines.append("Ways out:")
        lines.append("  1. start a new run: set WAM_OUTPUT_DIR to a new directory (this one stays as it is);")
        if overridable and len(overridable) == len(blocking):
            lines.append(
                f"  2. keep this run and accept the change (logged in {path}): "
                f"{OVERRIDE_VAR}={','.join(overridable)} bash recipes/wnm_3d/stage3/launch.sh"
            )
        else:
            lines.append(
                f"  2. or restore the recorded inputs; only {', '.join(sorted(RESUMABLE_KNOBS))} may change on "
                f"resume, with {OVERRIDE_VAR}=<key,...> (logged)"
            )
        raise ProvenanceError("\n".join(lines))
    entry = {"time": time.time(), "override": {item: {"recorded": was, "now": is_} for item, was, is_ in diffs}}
    now["history"].append(entry)
    msgs = [f"{OVERRIDE_VAR}: accepted {item}: {_fmt(was)} -> {_fmt(is_)}" for item, was, is_ in diffs]
    return ProvenanceCheck("override", now, msgs)


def read_provenance(output_dir: str | Path) -> dict | None:
    path = Path(output_dir) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


def write_provenance(output_dir: str | Path, record: Mapping[str, Any]) -> Path:
    path = Path(output_dir) / PROVENANCE
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return path


def record_checkpoint(output_dir: str | Path, step: int, ckpt: Path) -> None:
    """Adds a checkpoint's identity (sha256 of its file manifest) to the run provenance."""
    rec = read_provenance(output_dir)
    if rec is None:
        return
    rec.setdefault("checkpoints", {})[str(step)] = files_manifest_sha256(ckpt)
    write_provenance(output_dir, rec)


def foreign_checkpoint_problem(output_dir: str | Path, step: int, ckpt: Path) -> str | None:
    """A message when ``ckpt`` is not the checkpoint this run recorded for ``step`` (copied in from
    another run, or rewritten), else None."""
    rec = read_provenance(output_dir) or {}
    recorded = (rec.get("checkpoints") or {}).get(str(step))
    if recorded is None:
        return None
    actual = files_manifest_sha256(ckpt)
    if actual != recorded:
        return (
            f"checkpoint:{ckpt.name}: recorded {recorded}, now {actual}: {ckpt} is not the checkpoint this run "
            f"wrote at step {step} (copied in from another run?). Ways out: restore the run's own checkpoint, "
            "or set a new WAM_OUTPUT_DIR"
        )
    return None
