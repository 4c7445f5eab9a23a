"""The locked algorithm constants of the official Stage-III recipe and the check derived from them.

The constants have one source: ``recipes/wnm_3d/stage3/config/locked.yaml`` in this repository
(:data:`LOCKED_PATH`). A recipe directory handed to the contract check (the repository's own or a copy) must
carry the same values, in its ``locked.yaml`` and in the config it composes to, so that an edited algorithm
constant cannot slip into a run under the official recipe name.

That comparison cannot see an edit of the repository's file itself, so each published recipe also has a
fingerprint here (:data:`PUBLISHED_FINGERPRINTS`): the sha256 of its constants, not a copy of them. Publishing
a new recipe means: edit ``locked.yaml``, give it a new ``recipe`` name, and add that name with
:func:`fingerprint` of the new file to the table (``python -m verl_omni.trainer.locked_recipe`` prints it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCKED_FILE = "locked.yaml"
LOCKED_PATH = Path(__file__).resolve().parents[2] / "recipes" / "wnm_3d" / "stage3" / "config" / LOCKED_FILE
# recipe name -> fingerprint of its locked constants (sha256 of the flattened values, comments not included).
PUBLISHED_FINGERPRINTS = {
    "wnm-3d-stage3-navigation-grpo-r1": "9aded45f9139e283cce04240f1be40b62e929cafe108817af6c825f2e353f7b8",
}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{dotted.key: leaf}``, as the locked check and the run provenance compare configs.

    Lists are leaves and tuples become lists (as they read back from JSON). An empty mapping is a leaf too, so
    that a setting such as ``reward.reward_set.rewards.navigation: {}`` (a module with its defaults) is kept.
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = list(value) if isinstance(value, tuple) else value
    return out


def _same(a: Any, b: Any) -> bool:
    """Value equality where 1 == 1.0 but True != 1 and lists compare element-wise."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def read_locked_file(path: Path) -> dict[str, Any]:
    """A ``locked.yaml`` as a mapping (an empty file reads as ``{}``)."""
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


@functools.lru_cache(maxsize=1)
def _canonical() -> tuple[tuple[str, Any], ...]:
    if not LOCKED_PATH.is_file():
        raise FileNotFoundError(
            f"{LOCKED_PATH}: the recipe's locked constants are not found; run from a checkout of the repository"
        )
    return tuple(flatten(read_locked_file(LOCKED_PATH)).items())


def locked_constants() -> dict[str, Any]:
    """The locked constants as ``{dotted.key: value}`` (read once from :data:`LOCKED_PATH`)."""
    return dict(_canonical())


def recipe_name() -> str:
    """The official recipe's name (the ``recipe`` field of the locked file)."""
    return str(locked_constants()["recipe"])


def fingerprint(tree: Mapping[str, Any]) -> str:
    """sha256 of a locked tree's flattened values (key order and YAML comments do not matter)."""
    flat = flatten(tree)
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def canonical_problems() -> list[str]:
    """Problems of the repository's locked file itself: a recipe name or values that were never published."""
    tree = read_locked_file(LOCKED_PATH)
    name = tree.get("recipe")
    expected = PUBLISHED_FINGERPRINTS.get(str(name))
    if expected is None:
        return [f"{LOCKED_PATH}: recipe {name!r} is not a published recipe (known: {sorted(PUBLISHED_FINGERPRINTS)})"]
    got = fingerprint(tree)
    if got != expected:
        return [
            f"{LOCKED_PATH}: its constants differ from the published recipe {name} (fingerprint {got[:12]}, "
            f"published {expected[:12]}); `git diff {LOCKED_PATH.name}` shows the change"
        ]
    return []


def locked_constant_problems(tree: Mapping[str, Any], where: str) -> list[str]:
    """Differences between ``tree`` (a ``locked.yaml`` or a composed config) and the locked constants.

    Args:
        tree: A config mapping; keys outside the locked set are ignored unless ``where`` is a locked file.
        where: Name used in messages; a name ending in ``locked.yaml`` also refuses keys that are not locked.
    """
    canonical = locked_constants()
    name = canonical["recipe"]
    actual = flatten(tree)
    problems = []
    for key, value in canonical.items():
        if key not in actual:
            problems.append(f"{where}: locked constant {key} is missing (recipe {name} requires {value!r})")
        elif not _same(actual[key], value):
            problems.append(f"{where}: locked constant {key} is {actual[key]!r}, recipe {name} requires {value!r}")
    if where.endswith(LOCKED_FILE):
        extra = sorted(set(actual) - set(canonical))
        problems += [f"{where}: {key} is not a locked constant of recipe {name}" for key in extra]
    return problems


def is_locked_key(key: str) -> bool:
    """Whether a dotted config key is a locked constant or lies inside one (e.g. a ``reward_set`` entry)."""
    locked = locked_constants()
    return key in locked or any(key.startswith(k + ".") for k in locked)


if __name__ == "__main__":
    print(f"{read_locked_file(LOCKED_PATH).get('recipe')}: {fingerprint(read_locked_file(LOCKED_PATH))}")
    sys.exit(1 if canonical_problems() else 0)
