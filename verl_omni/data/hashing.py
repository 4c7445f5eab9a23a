"""Stable hashes used for deterministic splits, subsets and file fingerprints.

Python's ``hash()`` is salted per process, so anything that must agree across runs, machines and worker
processes goes through sha256 here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 1 << 20


def stable_unit(seed: int, key: str) -> float:
    """Maps ``(seed, key)`` to a float in ``[0, 1)``, identical on every machine and Python version.

    Args:
        seed: Integer seed (e.g. ``--split-seed``).
        key: Any string (an episode id, a sample id).

    Returns:
        The first 64 bits of ``sha256(f"{seed}\\x1f{key}")`` divided by ``2**64``.
    """
    digest = hashlib.sha256(f"{int(seed)}\x1f{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj) -> str:
    """JSON with sorted keys and no insignificant whitespace: equal content gives equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_json_sha256(obj) -> str:
    """Hex sha256 of :func:`canonical_json` of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()
