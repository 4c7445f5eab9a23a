"""Complete WNM checkpoint directories (DESIGN 3.4) and the one contract-compatibility check.

Layout written by :func:`save_wnm_checkpoint`::

    config.json                 {"format", "model_config", "transform_metadata"}
    model_index.json            {"_class_name": "WNMDiTPipeline", "format"}: the Diffusers-style pipeline index
                                vLLM-Omni reads to find the pipeline (optional when loading, for older checkpoints)
    action_normalization.json   verl_omni.data.actions.ActionNormalization.to_dict()
    transformer/                model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    vae/                        config.json (diffusers AutoencoderKLWan config) + model.safetensors
    text_encoder/ tokenizer/    builtin: config.json / tokenizer_config.json + model.safetensors;
                                umt5: transformers save_pretrained output
    image_encoder/              builtin: config.json + model.safetensors; clip: transformers save_pretrained output
    geometry_encoder/           config.json {"kind"} + model.safetensors (absent for wnm_2d)
    checkpoint_manifest.json    sha256 + size of every other file, provenance, contract hashes

Loading verifies every manifest entry (presence and sha256) before reading any weight, then builds the whole
model in local variables; any error raises before anything is returned, so loading never half-succeeds.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from verl_omni.data.actions import ActionNormalization

from .config import WNMConfig
from .encoders import ByteTokenizer, CLIPImageEncoder, HFTokenizer, UMT5TextEncoder, tiny_vae_config
from .model import WNMModel, build_geometry_encoder, build_image_encoder, build_text_encoder

CHECKPOINT_FORMAT = "wnm-checkpoint/1"
MANIFEST_FORMAT = "wnm-checkpoint-manifest/1"
MANIFEST_NAME = "checkpoint_manifest.json"
CONFIG_NAME = "config.json"
NORMALIZATION_NAME = "action_normalization.json"
MODEL_INDEX_NAME = "model_index.json"
# The pipeline class vLLM-Omni's engine builds for a WNM checkpoint (verl_omni/pipelines/wnm_vllm_omni/pipeline.py).
PIPELINE_CLASS_NAME = "WNMDiTPipeline"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
CONTRACT_SECTIONS = ("model_config", "transform_metadata", "action_normalization")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, tampered with, or disagrees with its config."""


class ContractMismatchError(ValueError):
    """Two checkpoints / a checkpoint and a data manifest are not contract-compatible."""


# ----- small helpers ------------------------------------------------------------------------------------
def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def json_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj`` (sorted keys, no whitespace)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: file is missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


# ----- tensors ------------------------------------------------------------------------------------------
def save_state_dict(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> list[str]:
    """Writes tensors as one safetensors file, or as shards plus an HF-style index when larger than
    ``max_shard_bytes``. Returns the written file names."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for k, v in tensors.items():  # greedy, in state-dict order; a tensor larger than the limit gets its own shard
        if shards[-1] and used + sizes[k] > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][k] = v
        used += sizes[k]
    n = len(shards)
    weight_map, names = {}, []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
    _write_json(folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*names, INDEX_NAME]


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Reads tensors written by :func:`save_state_dict` (single file or index + shards)."""
    index_path = folder / INDEX_NAME
    try:
        if index_path.is_file():
            index = _read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: field 'weight_map' is missing or empty")
            out: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = folder / shard
                if not shard_path.is_file():
                    raise CheckpointError(f"{index_path}: shard {shard} is missing")
                out.update(load_file(str(shard_path)))
            absent = sorted(k for k, f in weight_map.items() if k not in out)
            if absent:
                raise CheckpointError(
                    f"{index_path}: tensor {absent[0]!r} is indexed but not in {weight_map[absent[0]]}"
                )
            return out
        path = folder / WEIGHTS_NAME
        if not path.is_file():
            raise CheckpointError(f"{folder}: neither {WEIGHTS_NAME} nor {INDEX_NAME} exists")
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{folder}: unreadable safetensors ({e})") from e


def load_state_dict_strict(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Loads tensors into a module after checking names and shapes; errors name the tensor and ``where``."""
    own = module.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    if missing:
        raise CheckpointError(
            f"{where}: tensor {missing[0]!r} required by the config is missing ({len(missing)} missing)"
        )
    if unexpected:
        raise CheckpointError(f"{where}: tensor {unexpected[0]!r} is not part of the model built from the config")
    for k, v in own.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{where}: tensor {k!r} has shape {tuple(tensors[k].shape)} but the config implies {tuple(v.shape)}"
            )
    module.load_state_dict(tensors, strict=True)


# ----- manifest -----------------------------------------------------------------------------------------
def _list_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def read_manifest(ckpt_dir: Path) -> dict:
    manifest = _read_json(ckpt_dir / MANIFEST_NAME)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: field 'format' must be {MANIFEST_FORMAT!r}")
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: field 'files' is missing or empty")
    return manifest


def verify_files(ckpt_dir: Path, manifest: dict, only: list[str] | None = None) -> None:
    """Checks presence and sha256 of manifest entries (all, or the names in ``only``)."""
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
def contract_of(config: WNMConfig, normalization: ActionNormalization) -> dict:
    """The contract dict of an in-memory model config + normalization."""
    sections = {
        "model_config": config.to_dict(),
        "transform_metadata": config.transform_metadata(),
        "action_normalization": normalization.to_dict(),
    }
    return {**sections, **{f"{k}_hash": json_hash(v) for k, v in sections.items()}}


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
    cfg = _read_json(ckpt_dir / CONFIG_NAME)
    if not isinstance(cfg, dict) or cfg.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{ckpt_dir / CONFIG_NAME}: field 'format' must be {CHECKPOINT_FORMAT!r}")
    for key in ("model_config", "transform_metadata"):
        if not isinstance(cfg.get(key), dict):
            raise CheckpointError(f"{ckpt_dir / CONFIG_NAME}: field {key!r} is missing or not an object")
    norm = _read_json(ckpt_dir / NORMALIZATION_NAME)
    sections = {
        "model_config": cfg["model_config"],
        "transform_metadata": cfg["transform_metadata"],
        "action_normalization": norm,
    }
    return {**sections, **{f"{k}_hash": json_hash(v) for k, v in sections.items()}}


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            p = f"{path}.{k}"
            if k not in a:
                out.append(f"{p}: absent in a, {b[k]!r} in b")
            elif k not in b:
                out.append(f"{p}: {a[k]!r} in a, absent in b")
            else:
                _diff(a[k], b[k], p, out)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        if list(a) != list(b):
            for i, (x, y) in enumerate(zip(a, b)):
                _diff(x, y, f"{path}[{i}]", out)
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
        _diff(ca[section], cb[section], section, diffs)
    return ContractReport(ok=not diffs, differences=diffs, a=na, b=nb)


# ----- save ---------------------------------------------------------------------------------------------
def _save_frozen(model: WNMModel, root: Path, max_shard_bytes: int) -> None:
    cfg = model.config
    vae_dir = root / "vae"
    vae_dir.mkdir()
    model.vae.save_config(str(vae_dir))
    save_state_dict(model.vae.state_dict(), vae_dir, max_shard_bytes)

    if cfg.text_encoder_kind == "builtin":
        (root / "tokenizer").mkdir()
        _write_json(root / "tokenizer" / "tokenizer_config.json", model.tokenizer.to_dict())
        (root / "text_encoder").mkdir()
        _write_json(root / "text_encoder" / CONFIG_NAME, {"kind": "builtin", "text_dim": cfg.text_dim})
        save_state_dict(model.text_encoder.state_dict(), root / "text_encoder", max_shard_bytes)
    else:
        model.tokenizer.tokenizer.save_pretrained(str(root / "tokenizer"))
        model.text_encoder.model.save_pretrained(str(root / "text_encoder"), safe_serialization=True)

    if cfg.image_encoder_kind == "builtin":
        (root / "image_encoder").mkdir()
        _write_json(root / "image_encoder" / CONFIG_NAME, {"kind": "builtin", "image_dim": cfg.image_dim})
        save_state_dict(model.image_encoder.state_dict(), root / "image_encoder", max_shard_bytes)
    else:
        model.image_encoder.model.save_pretrained(str(root / "image_encoder"), safe_serialization=True)

    if model.geometry_encoder is not None:
        geo = root / "geometry_encoder"
        geo.mkdir()
        _write_json(geo / CONFIG_NAME, {"kind": cfg.geometry_encoder_kind, "geometry_dim": cfg.geometry_dim})
        save_state_dict(model.geometry_encoder.state_dict(), geo, max_shard_bytes)


def save_wnm_checkpoint(
    model: WNMModel,
    out_dir: str | Path,
    provenance: dict,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    readme: str | None = None,
) -> Path:
    """Writes a complete checkpoint directory; never overwrites.

    Args:
        model: The model to save.
        out_dir: Target directory; must not exist. Written under a temporary sibling name, then renamed.
        provenance: JSON-serialisable facts (base checkpoint, step, run, tool arguments).
        max_shard_bytes: Tensors of a part beyond this size are sharded with an index.
        readme: Optional model card written as ``README.md`` (data, steps, hyper-parameters, licence); it is
            listed in the manifest like every other file.

    Returns:
        The checkpoint directory.
    """
    if not isinstance(model, WNMModel):
        raise TypeError(f"save_wnm_checkpoint needs a WNMModel, got {type(model).__name__}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(
            f"{out_dir}: already exists; choose a new output directory (checkpoints are never overwritten)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        cfg = model.config
        contract = contract_of(cfg, model.action_normalization)
        _write_json(
            tmp / CONFIG_NAME,
            {
                "format": CHECKPOINT_FORMAT,
                "model_config": contract["model_config"],
                "transform_metadata": contract["transform_metadata"],
            },
        )
        _write_json(tmp / NORMALIZATION_NAME, contract["action_normalization"])
        _write_json(tmp / MODEL_INDEX_NAME, model_index())
        save_state_dict(model.transformer.state_dict(), tmp / "transformer", max_shard_bytes)
        _save_frozen(model, tmp, max_shard_bytes)
        if readme is not None:
            (tmp / "README.md").write_text(readme)
        files = {
            name: {"sha256": file_sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in _list_files(tmp)
        }
        manifest = {
            "format": MANIFEST_FORMAT,
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "provenance": json.loads(canonical_json(provenance)),
            "model_config_hash": contract["model_config_hash"],
            "transform_metadata_hash": contract["transform_metadata_hash"],
            "action_normalization_hash": contract["action_normalization_hash"],
            "trainable_parameters": sum(p.numel() for p in model.transformer.parameters()),
            "files": files,
        }
        _write_json(tmp / MANIFEST_NAME, manifest)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def model_index() -> dict:
    """The ``model_index.json`` of a complete checkpoint: names the vLLM-Omni pipeline class."""
    return {"_class_name": PIPELINE_CLASS_NAME, "format": CHECKPOINT_FORMAT}


def check_model_index(ckpt_dir: str | Path, required: bool = False) -> None:
    """Checks ``model_index.json`` when present (or always, with ``required``): it must name our pipeline.

    Raises:
        CheckpointError: naming the file and the field, and how to get a checkpoint that has it.
    """
    path = Path(ckpt_dir) / MODEL_INDEX_NAME
    if not path.is_file():
        if required:
            raise CheckpointError(
                f"{path}: file is missing; vLLM-Omni finds the pipeline through it. Checkpoints written by "
                "tools/checkpoint (make_tiny_wnm_checkpoint.py, export_wnm_checkpoint.py) have it: write this "
                "checkpoint again with them"
            )
        return
    index = _read_json(path)
    if not isinstance(index, dict) or index.get("_class_name") != PIPELINE_CLASS_NAME:
        got = index.get("_class_name") if isinstance(index, dict) else index
        raise CheckpointError(f"{path}: field '_class_name' is {got!r}, must be {PIPELINE_CLASS_NAME!r}")


# ----- load ---------------------------------------------------------------------------------------------
def _load_frozen(cfg: WNMConfig, root: Path) -> dict:
    from diffusers import AutoencoderKLWan

    frozen: dict = {}
    vae_dir = root / "vae"
    vae_cfg = _read_json(vae_dir / CONFIG_NAME)
    if cfg.vae_kind == "tiny":
        expected = tiny_vae_config(cfg)
        for k in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample"):
            if vae_cfg.get(k) != expected[k]:
                raise CheckpointError(
                    f"{vae_dir / CONFIG_NAME}: field {k!r} is {vae_cfg.get(k)!r}, model_config implies {expected[k]!r}"
                )
    try:
        vae = AutoencoderKLWan.from_config(vae_cfg)
    except Exception as e:
        raise CheckpointError(f"{vae_dir / CONFIG_NAME}: cannot build AutoencoderKLWan ({e})") from e
    if vae.config.z_dim != cfg.latent_channels:
        raise CheckpointError(
            f"{vae_dir / CONFIG_NAME}: field 'z_dim' is {vae.config.z_dim}, "
            f"model_config.latent_channels is {cfg.latent_channels}"
        )
    load_state_dict_strict(vae, read_state_dict(vae_dir), str(vae_dir))
    frozen["vae"] = vae

    if cfg.text_encoder_kind == "builtin":
        tok_cfg = _read_json(root / "tokenizer" / "tokenizer_config.json")
        if tok_cfg != ByteTokenizer(cfg.text_max_length).to_dict():
            raise CheckpointError(
                f"{root / 'tokenizer' / 'tokenizer_config.json'}: {tok_cfg} disagrees with "
                f"model_config.text_max_length={cfg.text_max_length}"
            )
        tokenizer, text_encoder = build_text_encoder(cfg, None)
        load_state_dict_strict(text_encoder, read_state_dict(root / "text_encoder"), str(root / "text_encoder"))
    else:
        from transformers import AutoTokenizer, UMT5EncoderModel

        try:
            tokenizer = HFTokenizer(
                AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True), cfg.text_max_length
            )
            text_encoder = UMT5TextEncoder(
                UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), local_files_only=True)
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{root / 'text_encoder'}: cannot load UMT5 ({e})") from e
    frozen["tokenizer"], frozen["text_encoder"] = tokenizer, text_encoder

    if cfg.image_encoder_kind == "builtin":
        image_encoder = build_image_encoder(cfg, None)
        load_state_dict_strict(image_encoder, read_state_dict(root / "image_encoder"), str(root / "image_encoder"))
    else:
        from transformers import CLIPVisionModel

        try:
            image_encoder = CLIPImageEncoder(
                CLIPVisionModel.from_pretrained(str(root / "image_encoder"), local_files_only=True)
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{root / 'image_encoder'}: cannot load CLIP vision model ({e})") from e
    frozen["image_encoder"] = image_encoder

    geometry = build_geometry_encoder(cfg)
    if geometry is not None:
        geo_cfg = _read_json(root / "geometry_encoder" / CONFIG_NAME)
        if geo_cfg.get("kind") != cfg.geometry_encoder_kind:
            raise CheckpointError(
                f"{root / 'geometry_encoder' / CONFIG_NAME}: field 'kind' is {geo_cfg.get('kind')!r}, "
                f"model_config says {cfg.geometry_encoder_kind!r}"
            )
        load_state_dict_strict(geometry, read_state_dict(root / "geometry_encoder"), str(root / "geometry_encoder"))
    frozen["geometry_encoder"] = geometry
    return frozen


def load_wnm_checkpoint(
    ckpt_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> WNMModel:
    """Loads a complete checkpoint after verifying every file's sha256.

    Args:
        ckpt_dir: Checkpoint directory.
        device / dtype: Where and in which dtype to place the model.

    Raises:
        CheckpointError: missing/malformed file, sha256 mismatch, config vs weights disagreement (names the
            file and the field or tensor).
    """
    ckpt_dir = Path(ckpt_dir)
    contract = read_checkpoint_contract(ckpt_dir)
    verify_files(ckpt_dir, read_manifest(ckpt_dir))
    try:
        cfg = WNMConfig.from_dict(contract["model_config"], source=f"{ckpt_dir / CONFIG_NAME}: model_config")
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    expected_meta = cfg.transform_metadata()
    diffs: list[str] = []
    _diff(contract["transform_metadata"], expected_meta, "transform_metadata", diffs)
    if diffs:
        raise CheckpointError(f"{ckpt_dir / CONFIG_NAME}: transform_metadata disagrees with model_config: {diffs[0]}")
    try:
        normalization = ActionNormalization.from_dict(
            contract["action_normalization"], source=str(ckpt_dir / NORMALIZATION_NAME)
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    check_model_index(ckpt_dir)
    frozen = _load_frozen(cfg, ckpt_dir)
    model = WNMModel(cfg, normalization, frozen=frozen)
    load_state_dict_strict(model.transformer, read_state_dict(ckpt_dir / "transformer"), str(ckpt_dir / "transformer"))
    model.to(device=device, dtype=dtype)
    return model


def default_shard_bytes(model: nn.Module, shards: int) -> int:
    """A shard size giving about ``shards`` files for the model's transformer (used by tests and tools)."""
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return max(1, math.ceil(total / shards))
