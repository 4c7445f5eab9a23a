"""Fail-closed contract check of the official Stage-III recipe (the Python behind ``validate.sh``).

``validate.sh`` loads ``paths.env`` into the environment and runs::

    python -m verl_omni.trainer.contract_check --config-dir recipes/wnm_3d/stage3/config [--paths-env FILE]

Checks, in order (docs/design.md, "Launch"), each failure naming the variable or file and what to do:

1. environment: every required variable set, paths exist, integers and enumerations valid, multi-node and
   network-interface settings consistent;
2. checkpoints: both are readable WNM checkpoints, contract-compatible with each other (the one shared
   rule, ``check_contract_compatibility``), frozen-part sources resolvable;
3. data: training manifest (kind, provenance, ``counts.skipped == 0``, exact row count, shard hashes,
   contract vs both checkpoints), validation manifest (rows >= ``WAM_VAL_MAX_SAMPLES``, no episode shared
   with training), every referenced video present and long enough, every occupancy scene present;
4. configuration: the Hydra recipe composes, its locked constants equal :data:`LOCKED_CONSTANTS`, the
   topology resolves (:mod:`verl_omni.trainer.topology`) and the whole tree validates as ``Stage3Config``.

``STAGE3_CONFIG_CONTRACT_OK`` is printed only when everything passes (exit code 0; 1 otherwise). Nothing
is written, no Ray is started, no GPU is allocated; ``--write-plan DIR`` (used by ``launch.sh`` after a
successful check) additionally writes the resolved config snapshot and the driver overrides into a new
directory.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK_TOKEN = "STAGE3_CONFIG_CONTRACT_OK"
RECIPE_NAME = "wnm-3d-stage3-navigation-grpo-r1"
CONFIG_NAME = "stage3"
LOCKED_FILE = "locked.yaml"

# Canonical copy of config/locked.yaml. validate.sh compares the recipe files and the composed config with
# it, so an edited algorithm constant cannot slip into a run under the official recipe name. Change both
# together only when publishing a new recipe.
_LAYERS = ["visual", "nav_1", "nav_2", "nav_3", "nav_4", "stop_1", "stop_2", "stop_3", "stop_4"]
LOCKED_CONSTANTS: dict[str, Any] = {
    "recipe": RECIPE_NAME,
    "model": {"variant": "wnm_3d"},
    "rollout": {
        "strata": 4,
        "branches": 4,
        "num_steps": 10,
        "shift": 3.0,
        "eta": 0.7,
        "sde_type": "dance",
        "shared_initial_noise": True,
        "window": {"strategy": "random", "size": 2, "range": [0, 4], "start": 0, "progressive_interval": 1},
    },
    "algorithm": {
        "layers": _LAYERS,
        "layer_weights": {name: 1.0 for name in _LAYERS},
        "baseline": "stratum",
        "std": "prompt",
        "layer_conditioned": True,
        "adv_eps": 1.0e-4,
        "adv_clip": 5.0,
        "clip_eps": 1.0e-4,
        "kl_beta": 0.0,
        "ppo_epochs": 1,
    },
    "actor": {
        "lr": 1.0e-5,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "lr_warmup_steps": 0,
        "lr_schedule": "constant",
        "min_lr_ratio": 0.0,
    },
    "reward": {
        "reward_set": {
            "robot_radius": 0.2,
            "collision_samples_per_metre": 40.0,
            "max_step_m": 2.0,
            "stop_threshold": 0.5,
            "invalid_penalty": -5.0,
            "max_geodesic_fields": 512,
            "rewards": {
                "navigation": {
                    "weight": 1.0,
                    "progress_weight": 1.0,
                    "deviation_weight": 0.5,
                    "deviation_tolerance_m": 0.3,
                    "deviation_cap_m": 2.0,
                },
                "collision": {
                    "weight": 1.0,
                    "hard_penalty": 1.0,
                    "risk_weight": 0.5,
                    "safety_clearance_m": 0.4,
                    "recovery_weight": 1.0,
                    "recovery_cap_m": 0.3,
                },
                "yaw": {
                    "weight": 1.0,
                    "path_weight": 0.5,
                    "path_tolerance_rad": 0.35,
                    "min_motion_m": 0.02,
                    "rate_weight": 0.5,
                    "rate_limit_rad": 0.55,
                    "reference_weight": 0.25,
                    "reference_tolerance_rad": 0.5,
                },
                "stop": {
                    "weight": 1.0,
                    "success_reward": 1.0,
                    "premature_scale": 0.5,
                    "premature_cap": 2.0,
                    "missed_stop_penalty": 1.0,
                    "near_goal_penalty": 0.5,
                },
                "vision": {
                    "weight": 1.0,
                    "metric": "latent_mse",
                    "psnr_cap_db": 50.0,
                    "data_range": None,
                    "rollouts_per_block": 64,
                },
            },
        }
    },
}

# Variables of paths.env (recipes/wnm_3d/stage3/paths.env.example) and what each must point at; used in messages.
REQUIRED_PATHS = {
    "WNM3D_INITIAL_CHECKPOINT": "the complete Stage-II WNM-3D checkpoint directory the actor starts from",
    "WAM_DATA_CONTRACT_CHECKPOINT": "the checkpoint directory the data was converted with "
    "(--checkpoint of the converter)",
    "WAM_DATA_ROOT": "the training dataset directory written by tools/data/sample_stage3_train.py",
    "WAM_EVENT_VAL_FILE": "the event-balanced validation Parquet (event_val.parquet), its directory or its "
    "manifest.json, written by tools/data/build_vggt_stage3_event_val.py",
}
OPTIONAL_SOURCES = {
    "WNM3D_SOURCE_ROOT": "the external WNM-3D checkout (leave empty for the built-in WNM model)",
    "WNM_TOKENIZER_SOURCE": "the UMT5 tokenizer directory",
    "WNM_TEXT_ENCODER_SOURCE": "the UMT5 text-encoder directory",
    "WNM_IMAGE_ENCODER_SOURCE": "the CLIP image-encoder directory",
    "WNM_VAE_SOURCE": "the Wan2.2 VAE directory",
    "WNM_VGGT_SOURCE": "the VGGT-Omega checkpoint",
}
# (variable, minimum, default) of the integer knobs; None default = required.
INTEGER_VARS = {
    "WAM_EXPECTED_TRAIN_SIZE": (1, None),
    "WAM_VAL_MAX_SAMPLES": (0, None),
    "WAM_TOTAL_STEPS": (1, 1000),
    "WAM_SAVE_FREQ": (0, 50),
    "WAM_VAL_FREQ": (0, 50),
    "WAM_CPU_WORKERS": (1, 2),
    "WAM_REWARD_WORKERS": (1, 1),
    "WAM_GPUS_PER_NODE": (0, None),
    "NNODES": (1, 1),
    "NODE_RANK": (0, 0),
    "RAY_PORT": (1, 6379),
    "WAM_NODE_WAIT_TIMEOUT": (1, 600),
}
ROLLOUT_BACKENDS = ("native", "vllm_omni")
BOOLEAN_VARS = ("WAM_REPLACE_EXISTING_RAY", "WAM_RAY_DASHBOARD", "WAM_COMPILE")
# Frozen part -> (variable, model_config kind field, kinds built in without a source, checkpoint subfolder).
FROZEN_SOURCES = {
    "tokenizer": ("WNM_TOKENIZER_SOURCE", "text_encoder_kind", ("builtin",), "tokenizer"),
    "text encoder": ("WNM_TEXT_ENCODER_SOURCE", "text_encoder_kind", ("builtin",), "text_encoder"),
    "image encoder": ("WNM_IMAGE_ENCODER_SOURCE", "image_encoder_kind", ("builtin",), "image_encoder"),
    "VAE": ("WNM_VAE_SOURCE", "vae_kind", ("tiny",), "vae"),
    "geometry encoder": ("WNM_VGGT_SOURCE", "geometry_encoder_kind", ("builtin",), "geometry_encoder"),
}


@dataclass
class Report:
    """Collects passed checks and failures; a failure names its subject (variable or file)."""

    passed: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def ok(self, message: str) -> None:
        self.passed.append(message)

    def fail(self, subject: str, message: str) -> None:
        self.failures.append((subject, message))

    def note(self, message: str) -> None:
        self.notes.append(message)

    @property
    def success(self) -> bool:
        return not self.failures


# ----- pure helpers ---------------------------------------------------------------------------------------
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{dotted.key: leaf}`` (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Value equality where 1 == 1.0 but True != 1 and lists compare element-wise."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def locked_constant_problems(tree: Mapping[str, Any], where: str) -> list[str]:
    """Differences between ``tree`` (locked.yaml or the composed config) and :data:`LOCKED_CONSTANTS`.

    Args:
        tree: A config mapping; keys outside the locked set are ignored unless ``where`` is the locked file.
        where: Name used in messages.
    """
    canonical = flatten(LOCKED_CONSTANTS)
    actual = flatten(tree)
    problems = []
    for key, value in canonical.items():
        if key not in actual:
            problems.append(f"{where}: locked constant {key} is missing (recipe {RECIPE_NAME} requires {value!r})")
        elif not _same(actual[key], value):
            problems.append(
                f"{where}: locked constant {key} is {actual[key]!r}, recipe {RECIPE_NAME} requires {value!r}"
            )
    if where.endswith(LOCKED_FILE):
        extra = sorted(set(actual) - set(canonical))
        problems += [f"{where}: {key} is not a locked constant of recipe {RECIPE_NAME}" for key in extra]
    return problems


def parse_int(env: Mapping[str, str], name: str, minimum: int, default: int | None) -> tuple[int | None, str | None]:
    """Reads an integer variable; returns ``(value, error message)``."""
    raw = env.get(name, "").strip()
    if not raw:
        if default is None:
            return None, f"{name} is not set"
        return default, None
    try:
        value = int(raw, 10)
    except ValueError:
        return None, f"{name}={raw!r} is not an integer"
    if value < minimum:
        return None, f"{name}={value} must be >= {minimum}"
    return value, None


def parse_bool(env: Mapping[str, str], name: str) -> tuple[bool, str | None]:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "false", "0", "no"):
        return False, None
    if raw in ("true", "1", "yes"):
        return True, None
    return False, f"{name}={env[name]!r} must be true or false"


# ----- checks ---------------------------------------------------------------------------------------------
@dataclass
class Settings:
    """Values read from the environment by :func:`check_environment`."""

    paths: dict[str, Path] = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)
    output_dir: Path | None = None
    backend: str = "native"


def check_environment(env: Mapping[str, str], report: Report, paths_env: str) -> Settings:
    """Checks variables of paths.env and the per-run knobs; fills ``report``."""
    s = Settings()
    todo = f"set it in {paths_env}" if paths_env else "set it in paths.env"
    for name, what in REQUIRED_PATHS.items():
        raw = env.get(name, "").strip()
        if not raw:
            report.fail(name, f"{name} is not set: {todo} to {what}")
        elif not Path(raw).exists():
            report.fail(name, f"{name}={raw} does not exist: point it at {what}")
        else:
            s.paths[name] = Path(raw)
    for name, what in OPTIONAL_SOURCES.items():
        raw = env.get(name, "").strip()
        if raw and not Path(raw).exists():
            report.fail(name, f"{name}={raw} does not exist: point it at {what} or leave it empty")
        elif raw:
            s.paths[name] = Path(raw)
    out = env.get("WAM_OUTPUT_DIR", "").strip()
    if not out:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR is not set: {todo} to a durable run directory")
    else:
        p = Path(out)
        if p.exists() and not p.is_dir():
            report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out} exists and is not a directory: choose another path")
        else:
            parent = p
            while not parent.exists():
                parent = parent.parent
            if not os.access(parent, os.W_OK | os.X_OK):
                report.fail(
                    "WAM_OUTPUT_DIR",
                    f"WAM_OUTPUT_DIR={out}: {parent} is not writable: choose a directory you can write to",
                )
            else:
                s.output_dir = p
    for name, (minimum, default) in INTEGER_VARS.items():
        value, err = parse_int(env, name, minimum, default)
        if err and not (name == "WAM_GPUS_PER_NODE" and err.endswith("is not set")):
            report.fail(name, f"{err}: {todo} (see paths.env.example)")
        elif value is not None:
            s.ints[name] = value
    if s.ints.get("RAY_PORT", 1) > 65535:
        report.fail("RAY_PORT", f"RAY_PORT={s.ints['RAY_PORT']} must be <= 65535")
    nnodes, rank = s.ints.get("NNODES"), s.ints.get("NODE_RANK")
    if nnodes is not None and rank is not None and rank >= nnodes:
        report.fail("NODE_RANK", f"NODE_RANK={rank} must be < NNODES={nnodes} (ranks are 0 .. NNODES-1)")
    if nnodes is not None and nnodes > 1 and not env.get("MASTER_ADDR", "").strip():
        report.fail(
            "MASTER_ADDR",
            f"MASTER_ADDR is not set but NNODES={nnodes}: set it to the IPv4 address of node 0 on every node",
        )
    backend = env.get("WAM_ROLLOUT_BACKEND", "").strip() or "native"
    if backend not in ROLLOUT_BACKENDS:
        report.fail("WAM_ROLLOUT_BACKEND", f"WAM_ROLLOUT_BACKEND={backend!r} must be one of {ROLLOUT_BACKENDS}")
    elif backend == "vllm_omni":
        from verl_omni.pipelines.wnm_vllm_omni.extra import missing_extra_message, vllm_omni_available

        if not vllm_omni_available():
            report.fail("WAM_ROLLOUT_BACKEND", missing_extra_message("WAM_ROLLOUT_BACKEND=vllm_omni"))
    s.backend = backend
    for name in BOOLEAN_VARS:
        _, err = parse_bool(env, name)
        if err:
            report.fail(name, err)
    iface = env.get("WAM_NETWORK_INTERFACE", "").strip()
    if iface:
        from verl_omni.trainer.launch_env import interface_ipv4, network_interfaces

        names = network_interfaces()
        if iface not in names:
            report.fail(
                "WAM_NETWORK_INTERFACE",
                f"WAM_NETWORK_INTERFACE={iface} does not exist on this machine "
                f"(interfaces: {', '.join(names)}): set the bootstrap interface "
                "that carries the cluster's IPv4 traffic",
            )
        elif interface_ipv4(iface) is None:
            report.fail("WAM_NETWORK_INTERFACE", f"WAM_NETWORK_INTERFACE={iface} has no IPv4 address")
    if not report.failures:
        report.ok("environment: required variables set, paths exist, knobs valid")
    return s


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


def check_run_provenance(s: Settings, plan: Plan, report: Report, env: Mapping[str, str]) -> None:
    """The same checks the driver makes on relaunch into WAM_OUTPUT_DIR: provenance and checkpoint integrity."""
    from verl_omni.trainer import checkpointing
    from verl_omni.trainer.config import trainer_config_from_dict

    out = s.output_dir
    if out is None or not out.is_dir():
        return
    cfg = trainer_config_from_dict(copy.deepcopy(plan.resolved))
    try:
        result = checkpointing.check_provenance(out, checkpointing.run_provenance(cfg.to_dict()), env)
    except checkpointing.ProvenanceError as e:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {e}")
        return
    for msg in result.messages:
        report.note(msg)
    if cfg.trainer.resume == "never":
        return
    try:
        choice = checkpointing.choose_resume(out)
    except checkpointing.CheckpointIntegrityError as e:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {e}")
        return
    if choice.step is None:
        report.ok(f"run directory: {out} holds no checkpoint; a new run starts")
        return
    foreign = checkpointing.foreign_checkpoint_problem(out, choice.step, choice.path)
    if foreign:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {foreign}")
        return
    if choice.fell_back:
        report.note(
            f"WAM_OUTPUT_DIR: newer checkpoint(s) are damaged and will not be used:\n{choice.describe_damage()}\n"
            f"  the run resumes from the newest intact checkpoint {choice.path}"
        )
    report.ok(f"run directory: provenance matches; resumes from verified checkpoint {choice.path}")


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


def compose_recipe(config_dir: Path, overrides: list[str]):
    """Composes the recipe with Hydra's compose API (no working-directory change, no outputs)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=overrides)


def detect_gpus() -> int:
    """Local GPUs visible to this process (respects ``CUDA_VISIBLE_DEVICES``)."""
    import shutil

    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists():
        return 0
    import torch

    return torch.cuda.device_count()


@dataclass
class Plan:
    """What a successful check hands to launch.sh."""

    overrides: list[str]
    resolved: dict
    topology_text: str


def check_config(s: Settings, env: Mapping[str, str], config_dir: Path, report: Report) -> Plan | None:
    """Locked constants, topology and the typed schema of the composed recipe."""
    import yaml
    from omegaconf import OmegaConf

    from verl_omni.trainer.config import ConfigError, trainer_config_from_dict
    from verl_omni.trainer.topology import TopologyError, TopologyRequest, resolve_topology

    locked_path = config_dir / LOCKED_FILE
    if not (config_dir / f"{CONFIG_NAME}.yaml").is_file() or not locked_path.is_file():
        report.fail(
            str(config_dir),
            f"{config_dir}: recipe files {CONFIG_NAME}.yaml and {LOCKED_FILE} not found; "
            "restore recipes/wnm_3d/stage3/config from the repository",
        )
        return None
    locked_file = yaml.safe_load(locked_path.read_text()) or {}
    problems = locked_constant_problems(locked_file, str(locked_path))
    try:
        raw = compose_recipe(config_dir, [])
        tree = OmegaConf.to_container(raw, resolve=True)
    except Exception as e:  # Hydra/OmegaConf raise many types; all mean the recipe does not compose here
        report.fail(str(config_dir), f"the recipe does not compose: {type(e).__name__}: {e}")
        return None
    problems += locked_constant_problems(tree, f"composed recipe {config_dir / (CONFIG_NAME + '.yaml')}")
    if str((tree.get("rollout") or {}).get("backend")) == "vllm_omni" and s.backend != "vllm_omni":
        from verl_omni.pipelines.wnm_vllm_omni.extra import missing_extra_message, vllm_omni_available

        if not vllm_omni_available():
            report.fail(str(config_dir / f"{CONFIG_NAME}.yaml"), missing_extra_message("rollout.backend: vllm_omni"))
    for p in problems:
        report.fail(
            str(locked_path),
            p + ": restore the file from the repository; changing an algorithm constant makes a different recipe",
        )
    if problems:
        return None
    report.ok(f"locked constants: recipe {RECIPE_NAME} unchanged")
    topo = tree["topology"]
    train_size = s.ints.get("WAM_EXPECTED_TRAIN_SIZE")
    if train_size is None:
        return None
    gpus = int(topo["gpus_per_node"])
    try:
        plan = resolve_topology(
            TopologyRequest(
                nnodes=int(topo["nnodes"]),
                gpus_per_node=gpus,
                cpu_workers_per_node=int(topo["cpu_workers_per_node"]),
                rollouts_per_prompt=int(tree["rollout"]["strata"]) * int(tree["rollout"]["branches"]),
                target_prompts_per_step=int(topo["prompts_per_step"]),
                target_mini_batch_prompts=int(topo["ppo_mini_batch_prompts"]),
                target_micro_batch_rollouts=int(topo["micro_batch_rollouts"]),
                train_size=train_size,
            )
        )
    except TopologyError as e:
        subject = "WAM_GPUS_PER_NODE" if gpus > 0 else "WAM_CPU_WORKERS"
        report.fail(
            subject,
            f"{e} (NNODES={topo['nnodes']}, {subject}={gpus or topo['cpu_workers_per_node']}, "
            f"WAM_EXPECTED_TRAIN_SIZE={train_size})",
        )
        return None
    overrides = [
        f"topology.{k}={v}"
        for k, v in plan.topology_section().items()
        if k in ("prompts_per_step", "ppo_mini_batch_prompts", "micro_batch_rollouts")
    ]
    resolved = copy.deepcopy(tree)
    resolved["topology"].update(plan.topology_section())
    rollout_chunk = int(tree["rollout"]["micro_batch_size"])
    if gpus > 0 and plan.micro_batch_rollouts != rollout_chunk:
        # bf16 GEMMs round differently for different batch sizes: only equal shapes give ratio == 1 exactly.
        report.note(
            f"rollout.micro_batch_size={rollout_chunk} differs from the resolved topology.micro_batch_rollouts="
            f"{plan.micro_batch_rollouts}: on GPUs the update recomputes window log-probs at another batch shape "
            "than the rollout, so bf16 ratios start near 1 (about 3e-4 in log-prob at Wan-1.3B) rather than "
            "exactly 1; equal values (with actor.gradient_checkpointing) make them exact (docs/benchmarks.md)"
        )
    try:
        trainer_config_from_dict(copy.deepcopy(resolved))
    except (ConfigError, TypeError, ValueError) as e:
        report.fail(str(config_dir / f"{CONFIG_NAME}.yaml"), f"the composed recipe is invalid: {e}")
        return None
    try:
        from verl_omni.utils.reward_score import build_reward_set

        build_reward_set(resolved["reward"]["reward_set"])
    except ValueError as e:
        report.fail(str(locked_path), f"reward.reward_set is rejected by build_reward_set: {e}")
        return None
    report.ok("config: recipe composes and validates; topology resolved")
    return Plan(overrides=overrides, resolved=resolved, topology_text=plan.describe())


def run_checks(env: Mapping[str, str], config_dir: Path, paths_env: str = "") -> tuple[Report, Plan | None]:
    """Runs every check; configuration checks read ``os.environ`` through Hydra's ``oc.env`` resolver."""
    report = Report()
    s = check_environment(env, report, paths_env)
    if report.failures:
        # The deeper checks read the files these variables name; fix the environment first.
        report.note("checkpoint and data checks skipped until the environment problems above are fixed")
    else:
        contract = check_checkpoints(s, report)
        if contract is not None:
            check_data(s, contract, report)
        else:
            report.note("data checks skipped: they need both checkpoints readable and compatible")
    plan = None
    if not report.failures:
        plan = check_config(s, env, config_dir, report)
        if plan is not None:
            check_run_provenance(s, plan, report, env)
    else:
        # Locked constants are checked even when other items failed: a changed constant must always be named.
        import yaml

        locked_path = config_dir / LOCKED_FILE
        if locked_path.is_file():
            for p in locked_constant_problems(yaml.safe_load(locked_path.read_text()) or {}, str(locked_path)):
                report.fail(str(locked_path), p + ": restore the file from the repository")
        report.note("topology and schema checks skipped until the items above pass")
    return report, plan


def write_plan(directory: Path, plan: Plan, report: Report) -> None:
    """Writes resolved_config.yaml, driver_overrides.txt and topology.txt into a new directory (atomic)."""
    import yaml

    if directory.exists():
        raise FileExistsError(f"{directory}: already exists; refusing to overwrite")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir()
    (tmp / "resolved_config.yaml").write_text(yaml.safe_dump(plan.resolved, sort_keys=False))
    (tmp / "driver_overrides.txt").write_text("".join(f"{o}\n" for o in plan.overrides))
    (tmp / "topology.txt").write_text(plan.topology_text + "\n")
    (tmp / "contract_check.txt").write_text("".join(f"ok: {m}\n" for m in report.passed))
    os.replace(tmp, directory)


GENERATED_HEADER = (
    "# GENERATED by scripts/generate_trainer_config.sh from recipes/wnm_3d/stage3/config/*.yaml: do not edit.\n"
    "# The composed trainer config of recipe {recipe}, with environment interpolations unresolved.\n"
    "# Documentation of every field: the comments in config/stage3.yaml and config/locked.yaml.\n"
)


def flattened_recipe(config_dir: Path) -> str:
    """The composed recipe as one YAML document (``${oc.env:...}`` left unresolved), with a header."""
    from omegaconf import OmegaConf

    cfg = compose_recipe(config_dir, [])
    return GENERATED_HEADER.format(recipe=RECIPE_NAME) + OmegaConf.to_yaml(cfg, resolve=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", required=True, type=Path, help="recipes/wnm_3d/stage3/config")
    parser.add_argument("--paths-env", default="", help="paths.env file that was loaded (named in messages)")
    parser.add_argument(
        "--write-plan",
        type=Path,
        default=None,
        help="after a successful check, write the config snapshot and driver overrides here (new dir)",
    )
    parser.add_argument(
        "--flatten-to",
        type=Path,
        default=None,
        help="only write the composed, unresolved recipe to this file (generate_trainer_config.sh)",
    )
    args = parser.parse_args(argv)
    if args.flatten_to is not None:
        tmp = args.flatten_to.with_name(args.flatten_to.name + ".tmp")
        tmp.write_text(flattened_recipe(args.config_dir))
        os.replace(tmp, args.flatten_to)
        print(f"wrote {args.flatten_to}")
        return 0
    env = dict(os.environ)
    if not env.get("WAM_GPUS_PER_NODE", "").strip():
        # The recipe reads the GPU count from the environment; detect it once, like launch.sh does.
        os.environ["WAM_GPUS_PER_NODE"] = env["WAM_GPUS_PER_NODE"] = str(detect_gpus())
    print(f"== Stage-III contract check: recipe {RECIPE_NAME}")
    if args.paths_env:
        print(f"   paths.env: {args.paths_env}")
    overridden = [v for v in env.get("WAM_ENV_OVERRIDES", "").split() if v]
    if overridden:
        print(f"   taken from the environment instead of paths.env: {', '.join(overridden)}")
    report, plan = run_checks(env, args.config_dir, args.paths_env)
    for message in report.passed:
        print(f"[ok]   {message}")
    for subject, message in report.failures:
        print(f"[FAIL] {subject}: {message}" if not message.startswith(subject) else f"[FAIL] {message}")
    for message in report.notes:
        print(f"[skip] {message}")
    if not report.success or plan is None:
        print(f"contract check FAILED: {len(report.failures)} problem(s); nothing was started", file=sys.stderr)
        return 1
    print(plan.topology_text)
    print(f"driver overrides: {' '.join(plan.overrides)}")
    if args.write_plan is not None:
        write_plan(args.write_plan, plan, report)
    print(OK_TOKEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
