"""Model cards: the ``README.md`` every WNM checkpoint carries (data, steps, hyper-parameters, licence).

Stage II writes its card in ``scripts/train_stage2.py``; the Stage-III exporter writes :func:`stage3_card`. A card
that grows from another checkpoint repeats that checkpoint's own Data and Training lines (``Lineage``), so a card
names every step that made the weights even when the earlier checkpoint is not at hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

CARD_NAME = "README.md"
LINEAGE_SECTIONS = ("Data", "Training", "Lineage")


def card_bullets(text: str, sections: tuple[str, ...] = LINEAGE_SECTIONS) -> list[str]:
    """The bullet lines (``- ...``, nested ones included) under the named ``## `` sections of a card, in order."""
    kept, keep = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            keep = any(line[3:].strip().startswith(name) for name in sections)
        elif keep and line.lstrip().startswith("- "):
            kept.append(line)
    return kept


def lineage_section(checkpoint: Path | None) -> list[str]:
    """``## Lineage`` lines quoting ``checkpoint``'s own card (empty when it has none)."""
    card = None if checkpoint is None else Path(checkpoint) / CARD_NAME
    if card is None or not card.is_file():
        return []
    kept = card_bullets(card.read_text())
    if not kept:
        return []
    return ["", f"## Lineage: `{Path(checkpoint).name}`, as its own README gives it", *("  " + x for x in kept)]


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


# What the card names of the trainer's config (dotted key, label); missing keys are left out.
_TRAINING_KEYS = (
    ("trainer.total_steps", "steps planned"),
    ("trainer.seed", "seed"),
    ("actor.lr", "AdamW lr"),
    ("topology.prompts_per_step", "prompts per step"),
    ("algorithm.layer_conditioned", "layer-conditioned advantages"),
    ("algorithm.baseline", "baseline"),
    ("rollout.shared_initial_noise", "shared initial noise"),
)


def stage3_card(
    name: str,
    base_dir: Path,
    base_manifest_sha256: str,
    step: int,
    run_output_dir: str,
    changed_tensors: int,
    tensors: int,
    train_config: Mapping[str, Any] | None,
) -> str:
    """The card of a Stage-III export: what trained it, from which base, and the base's own lineage.

    Args:
        name: The exported checkpoint's folder name.
        base_dir / base_manifest_sha256: The Stage-II (or earlier) checkpoint the DiT came from.
        step: Training step of the exported weights.
        run_output_dir: The Stage-III run's output folder.
        changed_tensors / tensors: DiT tensors the training changed, of all.
        train_config: The trainer's config tree saved with the checkpoint (None when unknown).
    """
    settings = [f"{label} {_get(train_config, key)}" for key, label in _TRAINING_KEYS if train_config is not None
                and _get(train_config, key) is not None]  # fmt: skip
    lines = [
        f"# {name}",
        "",
        f"WNM world-action model after Stage III: the DiT of `{Path(base_dir).name}` post-trained with counterfactual, "
        "layer-credited GRPO by `verl_omni` (recipe `recipes/wnm_3d/stage3`), merged back into a complete checkpoint "
        "by `tools/checkpoint/export_wnm_checkpoint.py`.",
        "",
        "## Training",
        f"- Stage-III run `{Path(run_output_dir).name}`, step {step}; {changed_tensors} of {tensors} DiT tensors "
        "changed; every other part (encoders, VAE, normalization, config, STOP gate if any) is the base's, byte for "
        "byte.",
        *([f"- {', '.join(settings)}."] if settings else []),
        f"- base: `{Path(base_dir).name}` (manifest sha256 {base_manifest_sha256[:12]}).",
        *lineage_section(base_dir),
        "",
        "## Evaluation",
        "- not evaluated by the export; evaluate it with `tools/eval/closed_loop_eval.py --checkpoint` (the Stage-III "
        "study does, beside its base).",
        "",
        "## Licence",
        "Apache-2.0, like the code that made it; the base's weights keep their own terms (see its card above).",
        "",
    ]
    return "\n".join(lines)


__all__ = ["CARD_NAME", "card_bullets", "lineage_section", "stage3_card"]
