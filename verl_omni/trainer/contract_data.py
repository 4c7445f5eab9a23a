"""Checkpoint and dataset checks of the contract check.

Both checkpoints must be readable WNM checkpoints with the same contract (``check_contract_compatibility``)
and resolvable frozen-part sources; the training and validation manifests must match the data-contract
checkpoint, their shards, videos and scenes must be present, and no episode may be in both sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_omni.trainer.contract_env import OPTIONAL_SOURCES, Report, Settings

# Frozen part -> (variable, model_config kind field, kinds built in without a source, checkpoint subfolder).
FROZEN_SOURCES = {
    "tokenizer": ("WNM_TOKENIZER_SOURCE", "text_encoder_kind", ("builtin",), "tokenizer"),
    "text encoder": ("WNM_TEXT_ENCODER_SOURCE", "text_encoder_kind", ("builtin",), "text_encoder"),
    "image encoder": ("WNM_IMAGE_ENCODER_SOURCE", "image_encoder_kind", ("builtin",), "image_encoder"),
    "VAE": ("WNM_VAE_SOURCE", "vae_kind", ("tiny",), "vae"),
    "geometry encoder": ("WNM_VGGT_SOURCE", "geometry_encoder_kind", ("builtin",), "geometry_encoder"),
}


def _read_contract(name: str, path: Path, report: Report) -> dict | None:
    from verl_omni.contracts import read_checkpoint_contract

    try:
        return read_checkpoint_contract(path)
    except (ValueError, OSError) as e:
        report.fail(name, f"{name}={path} is not a readable WNM checkpoint: {e}")
        return None


def check_checkpoints(s: Settings, report: Report) -> dict | None:
    """Reads both checkpoint contracts and compares them; returns the data-contract checkpoint's contract."""
    from verl_omni.contracts import check_contract_compatibility

    init_path = s.paths.get("WNM3D_INITIAL_CHECKPOINT")
    data_path = s.paths.get("WAM_DATA_CONTRACT_CHECKPOINT")
    init = _read_contract("WNM3D_INITIAL_CHECKPOINT", init_path, report) if init_path else None
    data = _read_contract("WAM_DATA_CONTRACT_CHECKPOINT", data_path, report) if data_path else None
    if init is None or data is None:
        return None
    result = check_contract_compatibility(init, data)
    if not result.ok:
        diffs = "; ".join(result.differences[:8])
        report.fail(
            "WNM3D_INITIAL_CHECKPOINT",
            f"WNM3D_INITIAL_CHECKPOINT={init_path} is not contract-compatible "
            f"with WAM_DATA_CONTRACT_CHECKPOINT={data_path} (model config, "
            f"transform metadata and action normalization must be identical): "
            f"{diffs}. Start from a checkpoint trained with the same contract "
            "or convert the data again with the initial checkpoint",
        )
        return None
    report.ok("checkpoints: initial and data-contract checkpoints are contract-compatible")
    model_config = init.get("model_config", {})
    for var, kind_key, builtin, sub in FROZEN_SOURCES.values():
        kind = model_config.get(kind_key)
        if var in s.paths or kind in builtin or (init_path / sub).exists():
            continue
        report.fail(
            var,
            f"{var} is not set and {init_path / sub} does not exist, but model_config.{kind_key} is "
            f"{kind!r}: set {var} to {OPTIONAL_SOURCES[var]}",
        )
    if model_config.get("geometry_encoder_kind") == "external" and "WNM3D_SOURCE_ROOT" not in s.paths:
        report.fail(
            "WNM3D_SOURCE_ROOT",
            "the checkpoint uses the external geometry encoder "
            "(model_config.geometry_encoder_kind = 'external'): set WNM3D_SOURCE_ROOT "
            "to the WNM-3D checkout",
        )
    return data


def _dataset_problems(var: str, path: Path, kind: str, contract: dict, init_path: Path, **kwargs: Any) -> list[str]:
    from verl_omni.data.manifest import validate_manifest

    problems = validate_manifest(path, kind=kind, checkpoint=contract, check_references=True, **kwargs)
    if not problems and init_path is not None:
        problems = validate_manifest(path, kind=kind, checkpoint=init_path, check_hashes=False)
    return [f"{var}: {p}" for p in problems]


def _provenance_problems(manifest_path: Path, manifest: Mapping[str, Any]) -> list[str]:
    from verl_omni.data.hashing import file_sha256

    prov = manifest.get("provenance")
    if not isinstance(prov, Mapping) or "source_manifest_sha256" not in prov:
        return [
            f"WAM_DATA_ROOT: {manifest_path} has no provenance.source_manifest_sha256: create the training "
            "subset with tools/data/sample_stage3_train.py"
        ]
    source = Path(str(prov.get("source_manifest", "")))
    if source.is_file() and file_sha256(source) != prov["source_manifest_sha256"]:
        return [
            f"WAM_DATA_ROOT: source manifest {source} changed after sampling (sha256 differs from "
            f"provenance.source_manifest_sha256 in {manifest_path}): the data was converted again; resample "
            "with tools/data/sample_stage3_train.py"
        ]
    return []


def _hash_problems(
    var: str, manifest_path: Path, manifest: Mapping[str, Any], contract: Mapping[str, Any]
) -> list[str]:
    """The contract hashes a manifest recorded equal the data-contract checkpoint's."""
    recorded = manifest.get("checkpoint", {})
    return [
        f"{var}: {manifest_path} records checkpoint.{key} {recorded.get(key)!r} but WAM_DATA_CONTRACT_CHECKPOINT has "
        f"{contract.get(key)!r}: the manifest was edited or written for another checkpoint; convert the data again"
        for key in ("model_config_hash", "transform_metadata_hash")
        if recorded.get(key) != contract.get(key)
    ]


def _frame_format_problems(
    var: str, manifest_path: Path, manifest: Mapping[str, Any], contract: Mapping[str, Any]
) -> list[str]:
    """The collection's frame size and rate equal the checkpoint's transform metadata (the model does not resize)."""
    import av

    meta = contract.get("transform_metadata", {})
    collection = manifest.get("collection") or {}
    problems = []
    for key in ("image_size", "fps"):
        if key in collection and key in meta and list(_as_list(collection[key])) != list(_as_list(meta[key])):
            problems.append(
                f"{var}: the collection of {manifest_path} has {key} {collection[key]} but the checkpoint's "
                f"transform_metadata.{key} is {meta[key]}: collect (or synthesize) the data at the "
                "checkpoint's frame format"
            )
    first = next(iter(manifest.get("shards", [])), None)
    if first is None or "image_size" not in meta or problems:
        return problems
    from verl_omni.data.parquet_io import read_shard

    video = read_shard(manifest_path.parent / first["file"], columns=["history_video"]).column(0)[0].as_py()
    path = Path(manifest["source_root"]) / video
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            size = [stream.codec_context.height, stream.codec_context.width]
    except (av.error.FFmpegError, OSError, IndexError) as e:
        return [f"{var}: cannot read {path} ({e}); restore the collection under {manifest['source_root']}"]
    if size != list(meta["image_size"]):
        problems.append(
            f"{var}: video {path} has frames of {size[0]}x{size[1]} but the checkpoint's "
            f"transform_metadata.image_size is {meta['image_size']}: the data does not fit the model"
        )
    return problems


def _as_list(value: Any) -> list:
    """A scalar or list as a flat list (for comparing recorded sizes and rates)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _video_problems(var: str, manifest_path: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Every referenced video decodes to enough frames for the largest referenced index."""
    import numpy as np
    from tqdm import tqdm

    from verl_omni.data.manifest import shard_paths
    from verl_omni.data.parquet_io import read_shards
    from verl_omni.data.video import count_frames

    cols = ["history_video", "history_frames", "target_video", "target_frames"]
    table = read_shards(shard_paths(manifest_path, manifest), columns=cols)
    needed: dict[str, int] = {}
    for video_col, frames_col in (("history_video", "history_frames"), ("target_video", "target_frames")):
        frames = table.column(frames_col).combine_chunks().flatten().to_numpy()
        top = frames.reshape(table.num_rows, -1).max(axis=1) if table.num_rows else np.zeros(0, dtype=int)
        for video, m in zip(table.column(video_col).to_pylist(), top.tolist()):
            needed[video] = max(needed.get(video, -1), int(m))
    root = Path(manifest["source_root"])
    problems = []
    for video in tqdm(sorted(needed), desc=f"{var}: videos", unit="video", leave=False, disable=None):
        path = root / video
        try:
            n = count_frames(path)
        except (ValueError, OSError) as e:
            problems.append(f"{var}: referenced video {path} cannot be read ({e}); restore the collection under {root}")
            continue
        if n <= needed[video]:
            problems.append(
                f"{var}: referenced video {path} has {n} frames but rows use frame {needed[video]}; the "
                "collection changed after conversion: convert again"
            )
        if len(problems) >= 5:
            problems.append(f"{var}: stopping the video check after 5 problems")
            break
    return problems


def _parquet_listing_problem(var: str, path: Path) -> str | None:
    """A Parquet file given for a dataset must be a shard listed in the ``manifest.json`` beside it."""
    from verl_omni.data.manifest import MANIFEST_NAME, ManifestError, read_manifest

    manifest_path = path.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        return (
            f"{var}={path}: no {MANIFEST_NAME} beside the Parquet file; keep the file in the directory the tool "
            "wrote (with its manifest.json)"
        )
    try:
        files = [str(sh.get("file")) for sh in read_manifest(manifest_path).get("shards", [])]
    except ManifestError as e:
        return f"{var}={path}: {e}"
    if path.name not in files:
        return f"{var}={path}: not a shard listed in {manifest_path} (it lists {files}); point it at a listed file"
    return None


def check_data(s: Settings, contract: dict, report: Report) -> None:
    """Training and validation datasets against their manifests, the checkpoints and each other."""
    from verl_omni.data.manifest import read_manifest, resolve_manifest_path
    from verl_omni.data.parquet_io import read_shards

    train_var, val_var = "WAM_DATA_ROOT", "WAM_EVENT_VAL_FILE"
    init_path = s.paths.get("WNM3D_INITIAL_CHECKPOINT")
    checked = {}
    for var, kind, kwargs in (
        (train_var, "train_subset", {"expected_rows": s.ints.get("WAM_EXPECTED_TRAIN_SIZE")}),
        (val_var, "event_val", {"min_rows": s.ints.get("WAM_VAL_MAX_SAMPLES")}),
    ):
        path = s.paths.get(var)
        if path is None:
            continue
        if path.is_file() and path.suffix == ".parquet":
            # The reference names the Parquet file itself; its manifest beside it must list it.
            listed = _parquet_listing_problem(var, path)
            if listed:
                report.fail(var, listed)
                continue
        problems = _dataset_problems(var, path, kind, contract, init_path, **kwargs)
        manifest_path = resolve_manifest_path(path)
        if not problems:
            manifest = read_manifest(manifest_path)
            problems += _hash_problems(var, manifest_path, manifest, contract)
            problems += _frame_format_problems(var, manifest_path, manifest, contract)
            if kind == "train_subset":
                problems += _provenance_problems(manifest_path, manifest)
            problems += _video_problems(var, manifest_path, manifest)
        for p in problems:
            hint = ""
            if "expected exactly" in p:
                hint = "; set WAM_EXPECTED_TRAIN_SIZE to the manifest's counts.rows or resample with --train-size"
            elif "need at least" in p:
                hint = "; lower WAM_VAL_MAX_SAMPLES or build a larger validation set (--per-event)"
            report.fail(var, p + hint)
        if not problems:
            checked[var] = (manifest_path, manifest)
            report.ok(f"data: {var} manifest, shards, contract, videos and scenes verified")
    if len(checked) == 2:
        from verl_omni.data.manifest import shard_paths

        ids = []
        for manifest_path, manifest in checked.values():
            table = read_shards(shard_paths(manifest_path, manifest), columns=["episode_id"])
            ids.append(set(table.column("episode_id").to_pylist()))
        shared = sorted(ids[0] & ids[1])
        if shared:
            report.fail(
                val_var,
                f"{val_var}: {len(shared)} validation episode(s) also appear in {train_var} (e.g. "
                f"{shared[:3]}): rebuild it with --exclude-parquet-dir pointing at the training data",
            )
