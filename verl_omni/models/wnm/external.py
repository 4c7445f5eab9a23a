"""Adapter to an external WNM-3D checkout (``WNM3D_SOURCE_ROOT``).

The real geometry encoder (VGGT-Omega) and, optionally, the real WNM model live in the WNM-3D source tree,
whose dependencies we never install here. We only import one adapter module from it.

Factory protocol (version 1). The checkout root must contain ``wnm3d_rl_adapter.py`` defining:

- ``ADAPTER_PROTOCOL_VERSION = 1``
- ``build_geometry_encoder(config: dict) -> torch.nn.Module``: ``config`` is ``WNMConfig.to_dict()``. The
  module has attributes ``output_dim`` (== ``config["geometry_dim"]``) and ``num_tokens``
  (== ``config["geometry_tokens"]``) and maps uint8 history frames ``[B, T, H, W, 3]`` to tokens
  ``[B, num_tokens, output_dim]``. Its ``state_dict()`` is saved in the checkpoint's ``geometry_encoder/``
  and loaded back strictly into a freshly built instance.
- optional ``build_wnm_model(config: dict) -> torch.nn.Module``: a complete model with the ``WNMModel``
  interface (``config``, ``transformer``, ``encode_context``, ``encode_video``, ``decode_video``,
  ``action_normalization``), used by :func:`verl_omni.models.wnm.model.build_wnm_model` instead of ours.

The root is put first on ``sys.path`` and prepended to ``PYTHONPATH`` (so Ray workers spawned later inherit
it). Every failure names ``WNM3D_SOURCE_ROOT``, the file and the missing piece.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ENV_VAR = "WNM3D_SOURCE_ROOT"
ADAPTER_MODULE = "wnm3d_rl_adapter"
PROTOCOL_VERSION = 1
MODEL_ATTRIBUTES = ("config", "transformer", "encode_context", "encode_video", "decode_video", "action_normalization")


def source_root() -> Path | None:
    """The external checkout root from the environment, or None when unset/empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    return Path(value) if value else None


def _add_to_path(root: Path) -> None:
    root_s = str(root)
    if root_s not in sys.path:
        sys.path.insert(0, root_s)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root_s not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root_s, *parts])


def load_adapter(root: Path | None = None) -> ModuleType:
    """Imports ``wnm3d_rl_adapter`` from the checkout and checks its protocol version.

    Args:
        root: Checkout root; defaults to ``$WNM3D_SOURCE_ROOT``.

    Raises:
        RuntimeError: unset variable, missing directory/adapter file, wrong protocol version, or import error.
    """
    root = root if root is not None else source_root()
    if root is None:
        raise RuntimeError(f"{ENV_VAR} is not set; point it at the WNM-3D checkout (see paths.env.example)")
    root = Path(root).resolve()
    if not root.is_dir():
        raise RuntimeError(f"{ENV_VAR}={root}: not a directory")
    adapter_file = root / f"{ADAPTER_MODULE}.py"
    if not adapter_file.is_file():
        raise RuntimeError(f"{ENV_VAR}={root}: missing {adapter_file.name} (the factory protocol entry point)")
    _add_to_path(root)
    module = sys.modules.get(ADAPTER_MODULE)
    if module is None or Path(getattr(module, "__file__", "")).resolve() != adapter_file:
        sys.modules.pop(ADAPTER_MODULE, None)
        try:
            module = importlib.import_module(ADAPTER_MODULE)
        except Exception as e:  # any import-time failure of foreign code is reported the same way
            raise RuntimeError(f"{adapter_file}: import failed: {type(e).__name__}: {e}") from e
    version = getattr(module, "ADAPTER_PROTOCOL_VERSION", None)
    if version != PROTOCOL_VERSION:
        raise RuntimeError(f"{adapter_file}: ADAPTER_PROTOCOL_VERSION is {version!r}, expected {PROTOCOL_VERSION}")
    return module


def build_external_geometry_encoder(config: dict):
    """Builds the geometry encoder through ``build_geometry_encoder`` and checks its declared dims."""
    adapter = load_adapter()
    factory = getattr(adapter, "build_geometry_encoder", None)
    if not callable(factory):
        raise RuntimeError(f"{adapter.__file__}: does not define build_geometry_encoder(config)")
    encoder = factory(dict(config))
    for attr, key in (("output_dim", "geometry_dim"), ("num_tokens", "geometry_tokens")):
        got = getattr(encoder, attr, None)
        if got != config[key]:
            raise RuntimeError(
                f"{adapter.__file__}: build_geometry_encoder returned {attr}={got!r}, WNMConfig.{key} is {config[key]}"
            )
    return encoder


def build_external_model(config: dict):
    """Builds a complete model through the optional ``build_wnm_model``; None when the adapter has none."""
    adapter = load_adapter()
    factory = getattr(adapter, "build_wnm_model", None)
    if factory is None:
        return None
    model = factory(dict(config))
    absent = [a for a in MODEL_ATTRIBUTES if not hasattr(model, a)]
    if absent:
        raise RuntimeError(f"{adapter.__file__}: build_wnm_model returned an object without {absent}")
    return model
