"""Merge a trained DiT from a Stage-III actor checkpoint into a copy of its complete base checkpoint.

An actor checkpoint (``<run>/global_step_N/actor/`` or a hot-save snapshot ``<dest>/actor/``, see
``verl_omni.utils.run_layout``) is a torch.distributed.checkpoint (DCP) save of
``{"model": DiT state dict, "optimizer": ...}`` written by the FSDP ranks, plus ``model_contract.json``. The
export reads only the ``model.*`` entries, without a process group (DCP reassembles the FSDP shards into
full tensors), and writes a complete WNM checkpoint (layout in :mod:`verl_omni.models.wnm.checkpoint`) that
differs from the base only in the transformer weight files, the manifest and the model card (``README.md``: the
export's own, quoting the base's card as its lineage; :func:`.model_card.stage3_card`).

Order of work, so that a refusal writes nothing::

    plan_export        read-only: actor layout, the checkpoint's checkpoint_files.json (size + sha256 of every
                       file, when the trainer wrote one), trainer state, base manifest (sha256 of every file), the ONE
                       contract check, tensor names/shapes/dtypes, DCP data files present and long enough
    export_checkpoint  stage beside the output (same filesystem, so the final rename is atomic), copy every
                       base file except the transformer weight files, write those one base file at a time
                       (memory holds one file's tensors), verify copies against the base manifest, write the
                       new manifest, rename into place
    dry_run            the same comparison as the export, nothing written

No temporary file is created outside the staging directory; large data never goes through ``TMPDIR``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from verl_omni.utils import run_layout

from .checkpoint import (
    INDEX_NAME,
    MANIFEST_NAME,
    MODEL_INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    ContractMismatchError,
    canonical_json,
    check_contract_compatibility,
    file_sha256,
    model_index,
    read_manifest,
    verify_files,
)
from .model_card import CARD_NAME, stage3_card

DCP_METADATA = run_layout.DCP_METADATA
MODEL_CONTRACT = "model_contract.json"
MODEL_PREFIX = "model."
TRANSFORMER_DIR = "transformer"
# safetensors reports the dtype of a lazily opened tensor only as its format code; this maps the codes the
# format defines (https://github.com/huggingface/safetensors, "Format") to torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class ExportError(ValueError):
    """The export is refused (bad actor checkpoint, tensor mismatch, missing shard file, existing output)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class ActorCheckpoint:
    """A Stage-III actor checkpoint located on disk.

    Attributes:
        actor_dir: Directory with the DCP ``.metadata`` and ``model_contract.json``.
        checkpoint_dir: Its parent (``global_step_N`` or the hot-save destination), holding ``trainer_state.json``.
        step: Training step the weights belong to (after that step's update).
        run_output_dir: The run's output directory (from the saved config when available).
        hot_save: True for a snapshot taken by ``hot_save_verl_fsdp.py``.
        contract: The parsed ``model_contract.json``.
        config: The trainer's config tree saved with the checkpoint (empty when it holds none).
    """

    actor_dir: Path
    checkpoint_dir: Path
    step: int
    run_output_dir: str
    hot_save: bool
    contract: dict
    config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BaseTransformerLayout:
    """How the base checkpoint stores its transformer.

    Attributes:
        folder: ``<base>/transformer``.
        files: Weight file name -> tensor names stored in it, in the base's order.
        specs: Tensor name -> shape/dtype in the base.
        metadata: Weight file name -> its safetensors header metadata (kept on rewrite).
        index_name: The index file name when the transformer is sharded, else None.
    """

    folder: Path
    files: dict[str, list[str]]
    specs: dict[str, TensorSpec]
    metadata: dict[str, dict[str, str] | None]
    index_name: str | None


@dataclass(frozen=True)
class TensorChange:
    """What the export does to one tensor.

    Attributes:
        name: Tensor name in the transformer state dict.
        spec: Shape and dtype written (always the base's).
        actor_dtype: Dtype stored by the actor (differs from ``spec.dtype`` only for a cast).
        max_abs_delta: ``max |new - base|`` computed in float64 (0 for empty tensors).
        changed: False when the written tensor is bit-identical to the base's.
    """

    name: str
    spec: TensorSpec
    actor_dtype: torch.dtype
    max_abs_delta: float
    changed: bool


@dataclass
class ExportPlan:
    """Everything checked before any byte is written (see :func:`plan_export`)."""

    base_dir: Path
    base_manifest: dict
    base_manifest_sha256: str
    actor: ActorCheckpoint
    layout: BaseTransformerLayout
    actor_specs: dict[str, TensorSpec]
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)

    @property
    def rewritten_files(self) -> list[str]:
        """Manifest names of the transformer weight files the export replaces."""
        return [f"{TRANSFORMER_DIR}/{name}" for name in self.layout.files]

    @property
    def copied_files(self) -> list[str]:
        """Manifest names of the base files copied byte for byte."""
        rewritten = set(self.rewritten_files)
        return [name for name in sorted(self.base_manifest["files"]) if name not in rewritten]

    def bytes_needed(self) -> int:
        return sum(int(e.get("bytes", 0)) for e in self.base_manifest["files"].values())


@dataclass(frozen=True)
class ExportResult:
    """Outcome of :func:`export_checkpoint` / :func:`dry_run`."""

    output_dir: Path | None
    changes: list[TensorChange]
    provenance: dict

    @property
    def changed(self) -> list[TensorChange]:
        return [c for c in self.changes if c.changed]


# ----- reading the actor checkpoint ---------------------------------------------------------------------
def resolve_actor_checkpoint(path: str | Path) -> ActorCheckpoint:
    """Locates the actor directory (:func:`verl_omni.utils.run_layout.locate_checkpoint`: complete, files
    matching their manifest) and reads its contract and the driver's trainer state.

    Args:
        path: ``<run>/global_step_N``, ``<run>/global_step_N/actor``, or a hot-save destination (or its
            ``actor/``).

    Raises:
        ExportError: not an actor checkpoint, incomplete (no trainer state / a ``.partial`` directory), or a
            malformed ``model_contract.json``.
    """
    try:
        located = run_layout.locate_checkpoint(path)
    except run_layout.CheckpointLayoutError as e:
        raise ExportError(f"--actor-checkpoint {e}") from e
    actor_dir, ckpt_dir, state = located.actor_dir, located.checkpoint_dir, located.state
    config = state.get("config") if isinstance(state.get("config"), dict) else {}
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    run_dir = trainer.get("output_dir") or str(ckpt_dir.parent)
    contract_path = actor_dir / MODEL_CONTRACT
    if not contract_path.is_file():
        raise ExportError(
            f"{contract_path}: missing; rank 0 of a Stage-III actor writes it with every checkpoint, so this is "
            f"not a complete Stage-III actor checkpoint"
        )
    contract = _read_json(contract_path)
    if not isinstance(contract, dict):
        raise ExportError(f"{contract_path}: must hold a JSON object")
    return ActorCheckpoint(
        actor_dir=actor_dir,
        checkpoint_dir=ckpt_dir,
        step=located.step,
        run_output_dir=str(run_dir),
        hot_save=bool(state.get("hot_save", False)),
        contract=contract,
        config=config,
    )


def read_dcp_model_specs(actor_dir: Path) -> dict[str, TensorSpec]:
    """Shapes/dtypes of the ``model.*`` tensors of a DCP checkpoint, after checking their data files.

    Returns:
        Tensor name (without the ``model.`` prefix) -> full (unsharded) shape and dtype.

    Raises:
        ExportError: unreadable metadata, a non-tensor ``model.*`` entry, no model tensors at all, or a data
            file that is missing or shorter than the metadata says.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(actor_dir)).read_metadata()
    except Exception as e:  # pickle/IO errors of a damaged .metadata all mean the same to the user
        raise ExportError(f"{actor_dir / DCP_METADATA}: unreadable DCP metadata ({type(e).__name__}: {e})") from e
    specs: dict[str, TensorSpec] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(MODEL_PREFIX):
            continue
        name = fqn[len(MODEL_PREFIX) :]
        if not isinstance(md, TensorStorageMetadata):
            raise ExportError(f"{actor_dir / DCP_METADATA}: entry {fqn!r} is not a tensor ({type(md).__name__})")
        specs[name] = TensorSpec(tuple(int(d) for d in md.size), md.properties.dtype)
    if not specs:
        raise ExportError(f"{actor_dir / DCP_METADATA}: holds no 'model.*' tensors; not a Stage-III actor checkpoint")
    problem = run_layout.dcp_data_file_problem(actor_dir, metadata.storage_data or {}, MODEL_PREFIX)
    if problem:
        raise ExportError(problem)
    return specs


def load_actor_tensors(actor_dir: Path, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Reads full (unsharded) ``model.*`` tensors from a DCP checkpoint in this process, no process group.

    Args:
        actor_dir: DCP checkpoint directory.
        specs: Names (without ``model.``) and the shapes/dtypes the DCP metadata gives for them.

    Returns:
        Name -> CPU tensor in the DCP dtype; only the requested names are read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    tensors = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}
    with warnings.catch_warnings():
        # Loading without a process group is the point here; DCP warns about it on every call.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # The nested key reproduces the "model." prefix the workers saved under; other entries are never read.
        dcp.load({"model": tensors}, storage_reader=FileSystemReader(str(actor_dir)), no_dist=True)
    return tensors


# ----- reading the base checkpoint ----------------------------------------------------------------------
def read_base_layout(base_dir: Path) -> BaseTransformerLayout:
    """Lists the base transformer's weight files, tensor names, shapes, dtypes and header metadata."""
    folder = base_dir / TRANSFORMER_DIR
    index_path = folder / INDEX_NAME
    files: dict[str, list[str]] = {}
    index_name = None
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"{index_path}: field 'weight_map' is missing or empty")
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        index_name = INDEX_NAME
    elif (folder / WEIGHTS_NAME).is_file():
        files[WEIGHTS_NAME] = []
    else:
        raise ExportError(f"{folder}: neither {WEIGHTS_NAME} nor {INDEX_NAME}; the base checkpoint has no transformer")
    specs: dict[str, TensorSpec] = {}
    metadata: dict[str, dict[str, str] | None] = {}
    for fname in list(files):
        path = folder / fname
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata[fname] = f.metadata()
                names = list(f.keys())
                for name in names:
                    sl = f.get_slice(name)
                    code = sl.get_dtype()
                    if code not in SAFETENSORS_DTYPES:
                        raise ExportError(f"{path}: tensor {name!r} has dtype {code}, which the export does not handle")
                    specs[name] = TensorSpec(tuple(int(d) for d in sl.get_shape()), SAFETENSORS_DTYPES[code])
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path}: unreadable safetensors file ({e})") from e
        if index_name is None:
            files[fname] = names
        elif sorted(names) != sorted(files[fname]):
            raise ExportError(f"{index_path}: weight_map disagrees with the tensors stored in {fname}")
    return BaseTransformerLayout(folder, files, specs, metadata, index_name)


def compare_specs(
    base: dict[str, TensorSpec], actor: dict[str, TensorSpec]
) -> tuple[list[str], dict[str, tuple[torch.dtype, torch.dtype]]]:
    """Tensor-by-tensor agreement of the actor's DiT with the base transformer.

    The actor keeps fp32 master weights (it loads the base with ``dtype=float32``), so a floating-point base
    stored in a lower precision is legitimate: those tensors are cast back to the base dtype on export.
    Every other difference is an error.

    Returns:
        ``(problems, casts)``: one line per problem (missing, unexpected, shape, dtype), and
        name -> (actor dtype, base dtype) for the tensors that will be cast.
    """
    problems: list[str] = []
    missing = sorted(set(base) - set(actor))
    unexpected = sorted(set(actor) - set(base))
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the base transformer missing in the actor, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) not in the base transformer, e.g. {unexpected[:3]}")
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name in sorted(set(base) & set(actor)):
        b, a = base[name], actor[name]
        if b.shape != a.shape:
            problems.append(f"tensor {name!r}: actor shape {list(a.shape)}, base shape {list(b.shape)}")
        elif b.dtype != a.dtype:
            if a.dtype.is_floating_point and b.dtype.is_floating_point and a.dtype.itemsize > b.dtype.itemsize:
                casts[name] = (a.dtype, b.dtype)
            else:
                problems.append(f"tensor {name!r}: actor dtype {a.dtype}, base dtype {b.dtype}")
    return problems, casts


def tensor_change(name: str, base: torch.Tensor, new: torch.Tensor, actor_dtype: torch.dtype) -> TensorChange:
    """Compares the tensor about to be written with the base's (``new`` already in the base dtype)."""
    changed = not torch.equal(base, new)
    if new.numel() == 0:
        delta = 0.0
    else:
        delta = float((new.to(torch.float64) - base.to(torch.float64)).abs().max())
    return TensorChange(name, TensorSpec(tuple(base.shape), base.dtype), actor_dtype, delta, changed)


# ----- plan ---------------------------------------------------------------------------------------------
def plan_export(base_dir: str | Path, actor_checkpoint: str | Path | ActorCheckpoint) -> ExportPlan:
    """Every read-only check of the export.

    Args:
        base_dir: Complete base checkpoint (``--base-vln``).
        actor_checkpoint: Actor checkpoint path (see :func:`resolve_actor_checkpoint`) or an already resolved one.

    Raises:
        ExportError / CheckpointError: unusable inputs (message names the file and the field or tensor).
        ContractMismatchError: the actor was trained from a checkpoint with another contract (lists the fields).
    """
    base_dir = Path(base_dir).expanduser().resolve()
    if not base_dir.is_dir():
        raise ExportError(f"--base-vln {base_dir}: directory does not exist")
    actor = (
        actor_checkpoint
        if isinstance(actor_checkpoint, ActorCheckpoint)
        else resolve_actor_checkpoint(actor_checkpoint)
    )
    manifest = read_manifest(base_dir)
    # The export promises byte-identical frozen parts: prove the base is intact before copying it.
    verify_files(base_dir, manifest)
    report = check_contract_compatibility(actor.contract, base_dir)
    report.a = str(actor.actor_dir / MODEL_CONTRACT)
    report.raise_if_incompatible("the actor checkpoint was trained from a model with a different contract")
    layout = read_base_layout(base_dir)
    unlisted = [f"{TRANSFORMER_DIR}/{n}" for n in layout.files if f"{TRANSFORMER_DIR}/{n}" not in manifest["files"]]
    if unlisted:
        raise ExportError(f"{base_dir / MANIFEST_NAME}: transformer file {unlisted[0]} is not listed in the manifest")
    actor_specs = read_dcp_model_specs(actor.actor_dir)
    problems, casts = compare_specs(layout.specs, actor_specs)
    if problems:
        lines = "\n  ".join(problems)
        raise ExportError(
            f"{actor.actor_dir}: the actor's DiT does not match the base transformer of {base_dir}:\n  {lines}"
        )
    return ExportPlan(
        base_dir=base_dir,
        base_manifest=manifest,
        base_manifest_sha256=file_sha256(base_dir / MANIFEST_NAME),
        actor=actor,
        layout=layout,
        actor_specs=actor_specs,
        casts=casts,
    )


def _merged_files(plan: ExportPlan) -> Iterator[tuple[str, dict[str, torch.Tensor], list[TensorChange]]]:
    """Per base weight file: the tensors to write (base dtype, base names) and what changed."""
    for fname, names in plan.layout.files.items():
        actor = load_actor_tensors(plan.actor.actor_dir, {n: plan.actor_specs[n] for n in names})
        base = load_file(str(plan.layout.folder / fname))
        out: dict[str, torch.Tensor] = {}
        changes: list[TensorChange] = []
        for name in names:
            new = actor.pop(name).to(plan.layout.specs[name].dtype).contiguous()
            if new.is_floating_point() and not bool(torch.isfinite(new).all()):
                raise ExportError(
                    f"{plan.actor.actor_dir}: tensor {name!r} holds NaN or inf values; refusing to export it"
                )
            changes.append(tensor_change(name, base[name], new, plan.actor_specs[name].dtype))
            out[name] = new
        del base
        yield fname, out, changes


def provenance_of(plan: ExportPlan, changes: list[TensorChange]) -> dict:
    """Provenance recorded in the exported checkpoint's manifest."""
    a = plan.actor
    return {
        "tool": "export_wnm_checkpoint",
        "exported_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_checkpoint": str(plan.base_dir),
        "base_manifest_sha256": plan.base_manifest_sha256,
        "base_provenance": plan.base_manifest.get("provenance"),
        "run_output_dir": a.run_output_dir,
        "step": a.step,
        "actor_checkpoint": str(a.actor_dir),
        "hot_save": a.hot_save,
        "initial_checkpoint": a.contract.get("initial_checkpoint"),
        "tensors": len(changes),
        "changed_tensors": sum(c.changed for c in changes),
        "dtype_casts": {n: [str(s), str(d)] for n, (s, d) in sorted(plan.casts.items())},
    }


# ----- dry run and export -------------------------------------------------------------------------------
def dry_run(plan: ExportPlan, progress: Callable[[str], None] | None = None) -> ExportResult:
    """What the export would change, tensor by tensor; writes nothing."""
    changes: list[TensorChange] = []
    for fname, _, file_changes in _merged_files(plan):
        changes.extend(file_changes)
        if progress:
            progress(fname)
    return ExportResult(None, changes, provenance_of(plan, changes))


def check_output_dir(output_dir: str | Path, bytes_needed: int = 0) -> Path:
    """Refuses an existing output directory and a filesystem without room for the copy."""
    out = Path(output_dir).expanduser().resolve()
    if out.exists() or out.is_symlink():
        raise ExportError(f"--output-dir {out}: already exists; choose a new directory (exports never overwrite)")
    parent = _existing_ancestor(out.parent)
    free = shutil.disk_usage(parent).free
    if bytes_needed and free < bytes_needed:
        raise ExportError(
            f"--output-dir {out}: needs {bytes_needed / 2**30:.2f} GiB but {parent} has {free / 2**30:.2f} GiB free"
        )
    return out


def export_checkpoint(
    plan: ExportPlan,
    output_dir: str | Path,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Writes the merged checkpoint (staged beside ``output_dir``, renamed into place at the end).

    Args:
        plan: From :func:`plan_export`.
        output_dir: Must not exist.
        progress: Called with each file name once it is written or copied.

    Returns:
        The result with every tensor's change and the provenance written to the manifest.
    """
    out = check_output_dir(output_dir, plan.bytes_needed())
    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside the output (same filesystem: the final rename is atomic); mkdir, not mkdtemp, so the directory
    # gets the user's umask permissions instead of 0700.
    stage = out.parent / f".{out.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        files = plan.base_manifest["files"]
        for name in plan.copied_files:
            dst = stage / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plan.base_dir / name, dst)
            if progress:
                progress(name)
        changes: list[TensorChange] = []
        (stage / TRANSFORMER_DIR).mkdir(exist_ok=True)
        for fname, tensors, file_changes in _merged_files(plan):
            # Same names, dtypes and header metadata as the base file: an unchanged tensor set gives a
            # byte-identical file, and the base's index stays valid as copied.
            save_file(tensors, str(stage / TRANSFORMER_DIR / fname), metadata=plan.layout.metadata[fname])
            changes.extend(file_changes)
            del tensors
            if progress:
                progress(f"{TRANSFORMER_DIR}/{fname}")
        # The card is the export's own (a Stage-III checkpoint), quoting the base's card as its lineage.
        card = stage3_card(out.name, plan.base_dir, plan.base_manifest_sha256, plan.actor.step,
                           plan.actor.run_output_dir, sum(c.changed for c in changes), len(changes),
                           plan.actor.config or None)  # fmt: skip
        (stage / CARD_NAME).write_text(card)
        new_files: dict[str, dict] = {}
        rewritten = {*plan.rewritten_files, CARD_NAME}
        for name in sorted(files):
            path = stage / name
            digest = file_sha256(path)
            if name not in rewritten and digest != files[name]["sha256"]:
                raise ExportError(f"{path}: copy differs from the base file (sha256 {digest[:12]}...); disk problem?")
            new_files[name] = {"sha256": digest, "bytes": path.stat().st_size}
        if CARD_NAME not in new_files:  # a base without a card
            card_path = stage / CARD_NAME
            new_files[CARD_NAME] = {"sha256": file_sha256(card_path), "bytes": card_path.stat().st_size}
        if MODEL_INDEX_NAME not in new_files:  # a base written before checkpoints had model_index.json
            (stage / MODEL_INDEX_NAME).write_text(json.dumps(model_index(), indent=2, sort_keys=True) + "\n")
            digest = file_sha256(stage / MODEL_INDEX_NAME)
            new_files[MODEL_INDEX_NAME] = {"sha256": digest, "bytes": (stage / MODEL_INDEX_NAME).stat().st_size}
        provenance = provenance_of(plan, changes)
        manifest = {k: v for k, v in plan.base_manifest.items() if k not in ("files", "provenance", "created_utc")}
        manifest.update(
            created_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            provenance=json.loads(canonical_json(provenance)),
            files=new_files,
        )
        (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():  # appeared while we were writing: never replace it
            raise ExportError(f"--output-dir {out}: was created by someone else during the export; nothing replaced")
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return ExportResult(out, changes, provenance)


# ----- helpers ------------------------------------------------------------------------------------------
def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from e


__all__ = [
    "ActorCheckpoint",
    "BaseTransformerLayout",
    "CheckpointError",
    "ContractMismatchError",
    "ExportError",
    "ExportPlan",
    "ExportResult",
    "TensorChange",
    "TensorSpec",
    "check_output_dir",
    "compare_specs",
    "dry_run",
    "export_checkpoint",
    "load_actor_tensors",
    "plan_export",
    "read_base_layout",
    "read_dcp_model_specs",
    "resolve_actor_checkpoint",
    "tensor_change",
]
