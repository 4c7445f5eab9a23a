"""Model cards: the bullets a card quotes from another, and the Stage-III export's card (hand-written cards)."""

from pathlib import Path

from verl_omni.models.wnm.model_card import card_bullets, lineage_section, stage3_card

CARD = """# stage2_r1

Intro line, not quoted.

## Data
- round 0: 400 scenes.
  - nested detail

## Training
- lr 0.0005.

## Lineage: `stage2_r0`, as its own README gives it
  - round 0: 800 scenes.

## Evaluation
- SR 0.3 (not quoted: it describes that checkpoint, not this one's history).
"""


def test_card_bullets_keep_data_training_and_lineage_in_order():
    assert card_bullets(CARD) == [
        "- round 0: 400 scenes.",
        "  - nested detail",
        "- lr 0.0005.",
        "  - round 0: 800 scenes.",
    ]
    assert card_bullets(CARD, ("Evaluation",)) == [
        "- SR 0.3 (not quoted: it describes that checkpoint, not this one's history)."
    ]


def test_lineage_section_and_stage3_card(tmp_path: Path):
    base = tmp_path / "stage2_r1"
    assert lineage_section(base) == [] and lineage_section(None) == []  # no folder, no card: nothing to quote
    base.mkdir()
    (base / "README.md").write_text(CARD)
    section = lineage_section(base)
    assert section[:2] == ["", "## Lineage: `stage2_r1`, as its own README gives it"]
    assert section[2:] == [
        "  - round 0: 400 scenes.",
        "    - nested detail",
        "  - lr 0.0005.",
        "    - round 0: 800 scenes.",
    ]
    config = {"trainer": {"total_steps": 120, "seed": 2}, "actor": {"lr": 1e-4}, "algorithm": {"baseline": "prompt"}}
    card = stage3_card("export_s2", base, "ab" * 32, 120, "/runs/main_s2/out", 7, 90, config)
    assert card.startswith("# export_s2\n") and "run `out`, step 120; 7 of 90 DiT tensors changed" in card
    assert "- steps planned 120, seed 2, AdamW lr 0.0001, baseline prompt." in card
    assert "(manifest sha256 abababababab)" in card and "\n".join(section[1:]) in card
    assert "settings" not in stage3_card("x", tmp_path / "none", "0" * 64, 1, "r", 0, 1, None)
