"""Complete WNM checkpoint directories: writing and loading them (``docs/design.md``, "Checkpoints").

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

import contextlib
import datetime
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from verl_omni.contracts import (
    CHECKPOINT_FORMAT,
    CONFIG_NAME,
    CONTRACT_SECTIONS,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    NORMALIZATION_NAME,
    CheckpointError,
    ContractMismatchError,
    ContractReport,
    canonical_json,
    check_contract_compatibility,
    contract_of,
    file_sha256,
    json_hash,
    read_checkpoint_contract,
    read_manifest,
    verify_files,
)
from verl_omni.contracts import contract_sections_diff as _diff
from verl_omni.contracts import read_json as _read_json
from verl_omni.data.actions import ActionNormalization

from .config import WNMConfig
from .encoders import ByteTokenizer, CLIPImageEncoder, HFTokenizer, UMT5TextEncoder, tiny_vae_config
from .model import WNMModel, build_geometry_encoder, build_image_encoder, build_text_encoder
from .stop_gate import StopGate

# Re-exported: the contract (reading, comparing) lives in verl_omni.contracts, torch-free.
__all__ = [
    "CHECKPOINT_FORMAT",
    "CONFIG_NAME",
    "CONTRACT_SECTIONS",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MODEL_INDEX_NAME",
    "NORMALIZATION_NAME",
    "PIPELINE_CLASS_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "ContractMismatchError",
    "ContractReport",
    "canonical_json",
    "check_contract_compatibility",
    "check_model_index",
    "contract_of",
    "default_shard_bytes",
    "file_sha256",
    "json_hash",
    "load_state_dict_strict",
    "load_wnm_checkpoint",
    "model_index",
    "read_checkpoint_contract",
    "read_manifest",
    "read_state_dict",
    "save_state_dict",
    "save_wnm_checkpoint",
    "verify_files",
]

MODEL_INDEX_NAME = "model_index.json"
# The pipeline class vLLM-Omni's engine builds for a WNM checkpoint (verl_omni/pipelines/wnm_vllm_omni/pipeline.py).
PIPELINE_CLASS_NAME = "WNMDiTPipeline"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


# ----- small helpers ------------------------------------------------------------------------------------
def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


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


@contextlib.contextmanager
def _staged_checkpoint_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` to write a checkpoint into, renamed to ``out_dir`` on success.

    Readers never see a half-written checkpoint under the final name: either the rename happens after the
    body completed, or the temporary folder is removed and the error propagates.

    Args:
        out_dir: Target directory; must not exist (checkpoints are never overwritten).

    Yields:
        The empty temporary folder ``<parent>/.<name>.tmp-<pid>``.

    Raises:
        FileExistsError: ``out_dir`` exists.
    """
    if out_dir.exists():
        raise FileExistsError(
            f"{out_dir}: already exists; choose a new output directory (checkpoints are never overwritten)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():  # stale: left by a crashed earlier process that had this pid
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        yield tmp
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_wnm_checkpoint(
    model: WNMModel,
    out_dir: str | Path,
    provenance: dict,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    readme: str | None = None,
    stop_gate: StopGate | None = None,
) -> Path:
    """Writes a complete checkpoint directory; never overwrites.

    Args:
        model: The model to save.
        out_dir: Target directory; must not exist. Written under a temporary sibling name, then renamed.
        provenance: JSON-serialisable facts (base checkpoint, step, run, tool arguments).
        max_shard_bytes: Tensors of a part beyond this size are sharded with an index.
        readme: Optional model card written as ``README.md`` (data, steps, hyper-parameters, licence); it is
            listed in the manifest like every other file.
        stop_gate: Optional :class:`.stop_gate.StopGate` written as ``stop_gate/`` (read back by
            :func:`.stop_gate.load_stop_gate`; the model itself never needs it).

    Returns:
        The checkpoint directory.
    """
    if not isinstance(model, WNMModel):
        raise TypeError(f"save_wnm_checkpoint needs a WNMModel, got {type(model).__name__}")
    out_dir = Path(out_dir)
    with _staged_checkpoint_dir(out_dir) as tmp:
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
        if stop_gate is not None:
            stop_gate.save(tmp)
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
    return out_dir


def derive_checkpoint(
    src_dir: str | Path, out_dir: str | Path, replace_files: dict[str, bytes], provenance_update: dict
) -> Path:
    """A copy of a verified checkpoint with some of its small files replaced; never overwrites.

    For changes that leave the weights alone (a re-fitted STOP gate distance, a model card): every other file is
    copied byte for byte, so the derived checkpoint's weights are bit-identical to the source's whatever their
    dtype, which loading and saving again would not guarantee.

    Args:
        src_dir: A complete checkpoint; every file is verified against its manifest first.
        out_dir: Target directory; must not exist. Written under a temporary sibling name, then renamed.
        replace_files: ``{relative name: new bytes}``; each name must already be in the source's manifest.
        provenance_update: Keys added to (or replacing those of) the source manifest's ``provenance``; the
            source's manifest sha256 is recorded as ``provenance["derived_from"]``.

    Returns:
        The derived checkpoint directory.

    Raises:
        CheckpointError: the source fails verification or a replaced name is not one of its files.
        FileExistsError: ``out_dir`` exists.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    manifest = read_manifest(src_dir)
    verify_files(src_dir, manifest)
    unknown = sorted(set(replace_files) - set(manifest["files"]))
    if unknown:
        raise CheckpointError(f"{src_dir / MANIFEST_NAME}: {unknown} are not files of this checkpoint")
    with _staged_checkpoint_dir(out_dir) as tmp:
        for name in manifest["files"]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            if name in replace_files:
                (tmp / name).write_bytes(replace_files[name])
            else:
                shutil.copy2(src_dir / name, tmp / name)
        provenance = dict(manifest.get("provenance") or {})
        provenance.update(json.loads(canonical_json(provenance_update)))
        provenance["derived_from"] = {"path": str(src_dir.resolve()),
                                      "manifest_sha256": file_sha256(src_dir / MANIFEST_NAME)}  # fmt: skip
        derived = dict(manifest)
        derived["created_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        derived["provenance"] = provenance
        derived["files"] = {
            name: {"sha256": file_sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in _list_files(tmp)
        }
        _write_json(tmp / MANIFEST_NAME, derived)
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
