"""Environment checks of the contract check: the variables of ``paths.env`` and the per-run knobs.

Every failure names the variable and what to do; :class:`Report` collects them for all checks of
:mod:`verl_omni.trainer.contract_check`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class Settings:
    """Values read from the environment by :func:`check_environment`."""

    paths: dict[str, Path] = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)
    output_dir: Path | None = None
    backend: str = "native"


def check_attention_backend(env: Mapping[str, str], s: Settings, report: Report) -> None:
    """``WAM_ATTENTION_BACKEND``: a known kernel family, and for ``fa4`` on GPUs an importable FlashAttention-4 (a
    missing package would otherwise fail in every actor worker after Ray has started).

    GPUs are assumed unless ``WAM_GPUS_PER_NODE`` is 0: an empty value means "detect at launch", and the node the
    job runs on usually has GPUs where the login node checking the contract has none.
    """
    from verl_omni.trainer.config import ATTENTION_BACKEND_NAMES

    name = "WAM_ATTENTION_BACKEND"
    value = env.get(name, "").strip() or "default"
    if value not in ATTENTION_BACKEND_NAMES:
        report.fail(name, f"{name}={value!r} must be one of {', '.join(ATTENTION_BACKEND_NAMES)} (or empty: default)")
    elif value == "fa4" and s.ints.get("WAM_GPUS_PER_NODE") == 0:
        report.note(f"{name}=fa4 has no effect without GPUs: the DiT keeps PyTorch's default attention on CPU")
    elif value == "fa4":
        from verl_omni.models.wnm.flash_attention4 import fa4_import_problem

        problem = fa4_import_problem()
        if problem is not None:
            report.fail(name, f"{name}=fa4 but FlashAttention-4 does not import here: {problem}")
    # WAM_FA4_FORWARD_TILE chose FlashAttention-4's forward tile in earlier versions; measured, no tile beat the
    # library's at every batch and the setting was removed. A paths.env that still sets it is told so, not ignored.
    if env.get("WAM_FA4_FORWARD_TILE", "").strip():
        report.note(
            "WAM_FA4_FORWARD_TILE is no longer read (FlashAttention-4 keeps its own tile): remove it from paths.env"
        )


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
    check_attention_backend(env, s, report)
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
