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
# Modules the backend imports at run time (distribution name -> import name).
REQUIRED_MODULES = {"vllm": "vllm", "vllm-omni": "vllm_omni"}


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
        f"Install it with: {INSTALL_COMMAND}  (see docs/vllm_omni.md), or use rollout.backend=native."
    )


def require_vllm_omni(what: str = "rollout.backend=vllm_omni") -> None:
    """Raises :class:`MissingExtraError` naming the extra and the install command when it is missing."""
    if missing_modules():
        raise MissingExtraError(missing_extra_message(what))


def check_pinned_versions() -> dict[str, tuple[str | None, str]]:
    """``{distribution: (installed or None, pinned)}`` for every pinned distribution that differs."""
    out = {}
    for dist, pinned in PINNED_VERSIONS.items():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or installed.split("+")[0] != pinned:
            out[dist] = (installed, pinned)
    return out


def _python() -> str:
    import sys

    return sys.executable
