"""The checkpoint contract: what a WNM checkpoint promises the data, the trainer and the exporter.

A checkpoint's contract is three JSON sections: ``model_config`` and ``transform_metadata`` (both in its
``config.json``) and ``action_normalization`` (``action_normalization.json``), plus the sha256 of each
section's canonical JSON. Two sides are compatible when all three sections are identical; converted data
records the contract of the checkpoint it was converted with (``manifest.json``), so the same rule compares
a dataset with a checkpoint.

This module reads and compares contracts without building a model: it imports only the standard library and
:mod:`verl_omni.data.hashing`, so the data tools and the contract check use it without importing torch or
diffusers. Writing and loading complete checkpoints is :mod:`verl_omni.models.wnm.checkpoint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_omni.data.hashing import canonical_json, canonical_json_sha256, file_sha256

CHECKPOINT_FORMAT = "wnm-checkpoint/1"
MANIFEST_FORMAT = "wnm-checkpoint-manifest/1"
MANIFEST_NAME = "checkpoint_manifest.json"
CONFIG_NAME = "config.json"
NORMALIZATION_NAME = "action_normalization.json"
CONTRACT_SECTIONS = ("model_config", "transform_metadata", "action_normalization")
# The model variants: wnm_3d (geometry tokens in the context) and the wnm_2d baseline (none). Each has its pipeline
# package, verl_omni.pipelines.<variant>.
VARIANTS = ("wnm_3d", "wnm_2d")
# The credit layers every reward, advantage, log-prob and loss is keyed by, in this order (one visual layer, then
# the navigation and STOP layers of each of the action's chunks). Defined here, torch-free, so that the config
# and the contract check read the same names as the rollout (verl_omni.pipelines.wnm_shared.layers).
NUM_CHUNKS = 4
LAYER_NAMES: tuple[str, ...] = (
    "visual",
    *(f"nav_{k}" for k in range(1, NUM_CHUNKS + 1)),
    *(f"stop_{k}" for k in range(1, NUM_CHUNKS + 1)),
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CONFIG_NAME",
    "CONTRACT_SECTIONS",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "NORMALIZATION_NAME",
    "LAYER_NAMES",
    "NUM_CHUNKS",
    "VARIANTS",
    "CheckpointError",
    "ContractMismatchError",
    "ContractReport",
    "VariantMismatchError",
    "canonical_json",
    "check_checkpoint_variant",
    "check_contract_compatibility",
    "contract_of",
    "contract_sections_diff",
    "file_sha256",
    "json_hash",
    "read_checkpoint_contract",
    "read_json",
    "read_manifest",
    "verify_files",
]


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, tampered with, or disagrees with its config."""


class ContractMismatchError(ValueError):
    """Two checkpoints / a checkpoint and a data manifest are not contract-compatible."""


class VariantMismatchError(ContractMismatchError):
    """A checkpoint is of another model variant than the configuration asks for."""


def json_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj`` (sorted keys, no whitespace)."""
    return canonical_json_sha256(obj)


def read_json(path: Path) -> Any:
    """JSON of a checkpoint file; a missing or malformed file is a :class:`CheckpointError` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: file is missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


# ----- manifest -----------------------------------------------------------------------------------------
def read_manifest(ckpt_dir: Path) -> dict:
    """``checkpoint_manifest.json`` of a checkpoint, after checking its format and that it lists files."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_json(ckpt_dir / MANIFEST_NAME)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: field 'format' must be {MANIFEST_FORMAT!r}")
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: field 'files' is missing or empty")
    return manifest


def verify_files(ckpt_dir: Path, manifest: dict, only: list[str] | None = None) -> None:
    """Checks presence and sha256 of manifest entries (all, or the names in ``only``)."""
    ckpt_dir = Path(ckpt_dir)
    files = manifest["files"]
    for name in only if only is not None else sorted(files):
        entry = files.get(name)
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: no sha256 entry for {name}")
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {MANIFEST_NAME} but missing")
        digest = file_sha256(path)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{path}: sha256 mismatch (manifest {entry['sha256'][:12]}..., file {digest[:12]}...)"
            )


# ----- contract -----------------------------------------------------------------------------------------
def _with_hashes(sections: dict) -> dict:
    return {**sections, **{f"{k}_hash": json_hash(v) for k, v in sections.items()}}


def contract_of(config, normalization) -> dict:
    """The contract dict of an in-memory model config (``WNMConfig``) and ``ActionNormalization``."""
    return _with_hashes(
        {
            "model_config": config.to_dict(),
            "transform_metadata": config.transform_metadata(),
            "action_normalization": normalization.to_dict(),
        }
    )


def read_checkpoint_contract(ckpt_dir: str | Path) -> dict:
    """Reads (and sha256-verifies) a checkpoint's config and normalization.

    Returns:
        dict with ``model_config``, ``transform_metadata``, ``action_normalization`` and their sha256 hashes
        ``model_config_hash``, ``transform_metadata_hash``, ``action_normalization_hash``.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory does not exist")
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest, only=[CONFIG_NAME, NORMALIZATION_NAME])
    cfg = read_json(ckpt_dir / CONFIG_NAME)
    if not isinstance(cfg, dict) or cfg.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{ckpt_dir / CONFIG_NAME}: field 'format' must be {CHECKPOINT_FORMAT!r}")
    for key in ("model_config", "transform_metadata"):
        if not isinstance(cfg.get(key), dict):
            raise CheckpointError(f"{ckpt_dir / CONFIG_NAME}: field {key!r} is missing or not an object")
    norm = read_json(ckpt_dir / NORMALIZATION_NAME)
    return _with_hashes(
        {
            "model_config": cfg["model_config"],
            "transform_metadata": cfg["transform_metadata"],
            "action_normalization": norm,
        }
    )


def contract_sections_diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Appends one line per differing leaf of two JSON values to ``out`` (``path`` names the root)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            p = f"{path}.{k}"
            if k not in a:
                out.append(f"{p}: absent in a, {b[k]!r} in b")
            elif k not in b:
                out.append(f"{p}: {a[k]!r} in a, absent in b")
            else:
                contract_sections_diff(a[k], b[k], p, out)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        if list(a) != list(b):
            for i, (x, y) in enumerate(zip(a, b)):
                contract_sections_diff(x, y, f"{path}[{i}]", out)
    elif a != b or type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)):
        out.append(f"{path}: {a!r} != {b!r}")


@dataclass
class ContractReport:
    """Outcome of :func:`check_contract_compatibility`.

    Attributes:
        ok: True when model config, transform metadata and action normalization are identical.
        differences: One line per differing field, e.g. ``transform_metadata.image_size[0]: 64 != 32``.
        a / b: Descriptions of the two sides.
    """

    ok: bool
    differences: list[str] = field(default_factory=list)
    a: str = "a"
    b: str = "b"

    def raise_if_incompatible(self, context_msg: str = "") -> None:
        if not self.ok:
            head = f"{context_msg}: " if context_msg else ""
            lines = "\n  ".join(self.differences)
            raise ContractMismatchError(f"{head}contract mismatch between a={self.a} and b={self.b}:\n  {lines}")


def _as_contract(x: str | Path | dict) -> tuple[dict, str]:
    if isinstance(x, dict):
        return x, "<contract dict>"
    return read_checkpoint_contract(x), str(x)


def check_contract_compatibility(a: str | Path | dict, b: str | Path | dict) -> ContractReport:
    """THE compatibility rule: identical model config, transform metadata and action normalization.

    Args:
        a / b: A checkpoint directory or a contract dict (as returned by :func:`read_checkpoint_contract`, or
            any dict carrying the three sections, e.g. a data manifest's).

    Returns:
        A :class:`ContractReport` naming every differing field.
    """
    ca, na = _as_contract(a)
    cb, nb = _as_contract(b)
    diffs: list[str] = []
    for section in CONTRACT_SECTIONS:
        if section not in ca or section not in cb:
            where = "a" if section not in ca else "b"
            diffs.append(f"{section}: missing in {where}")
            continue
        contract_sections_diff(ca[section], cb[section], section, diffs)
    return ContractReport(ok=not diffs, differences=diffs, a=na, b=nb)


def check_checkpoint_variant(
    ckpt_dir: str | Path,
    variant: str,
    field: str = "model.variant",
    contract: dict | None = None,
    remedy: str | None = None,
) -> None:
    """Refuses a checkpoint whose ``model_config.variant`` is not the configured ``variant``.

    Args:
        ckpt_dir: The checkpoint directory (named in the message with its ``config.json``).
        variant: The configured variant (``wnm_3d`` or ``wnm_2d``).
        field: Where ``variant`` was configured, named in the message (e.g. ``model.variant``).
        contract: The checkpoint's contract when already read (:func:`read_checkpoint_contract`), else None.
        remedy: What the message tells the user to do (default: set ``field`` to the checkpoint's variant, or
            start from a checkpoint of ``variant``).

    Raises:
        VariantMismatchError: Naming both values, the checkpoint's ``config.json`` and ``field``.
        CheckpointError: The checkpoint is unreadable.
    """
    ckpt_dir = Path(ckpt_dir)
    if contract is None:
        contract = read_checkpoint_contract(ckpt_dir)
    found = contract["model_config"].get("variant")
    if found != variant:
        if remedy is not None:
            hint = remedy
        elif found in VARIANTS:
            hint = f"set {field}: {found} to train this checkpoint, or start from a {variant} checkpoint"
        else:
            hint = f"start from a {variant} checkpoint"
        raise VariantMismatchError(
            f"{field} is {variant!r} but the checkpoint {ckpt_dir / CONFIG_NAME} has model_config.variant "
            f"{found!r}: {hint}"
        )
