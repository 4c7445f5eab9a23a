"""FlashAttention-4 forward tiles: parsing the ``WAM_FA4_FORWARD_TILE`` setting and the ``fit`` rule.

Kept apart from ``flash_attention4.py``, which reads the variable when it is imported and stops on a bad value: this
module reads nothing at import, so the contract check can validate the variable without importing the op. The tile
shapes are Hopper's; on other GPUs the op keeps the library's tile (``flash_attention4.tile_applies``).
"""

from __future__ import annotations

FORWARD_TILE_VARIABLE = "WAM_FA4_FORWARD_TILE"
# The tile widths that FlashAttention-4's own search of Hopper forward configs (flash_attn/cute/sm90_config_search.py,
# 4.0.0b40) finds feasible at head_dim 128 with the register-held P and the intra-warpgroup overlap that a
# requested tile gets (shared memory 160-224 KiB).
FIT_TILE_NS = (128, 144, 160, 176, 192)


def fit_tile_n(keys: int, candidates: tuple[int, ...] = FIT_TILE_NS) -> int:
    """The tile width of ``candidates`` whose whole tiles cover ``keys`` with the least padding (ties: the first).

    >>> fit_tile_n(4640), fit_tile_n(545), fit_tile_n(4608)
    (160, 144, 128)
    """
    return min(candidates, key=lambda n: -(-keys // n) * n - keys)


def parse_forward_tile(text: str) -> tuple[int, int] | str | None:
    """``"128x160"`` -> ``(128, 160)``; ``"fit"`` -> ``"fit"``; ``""`` or ``"default"`` -> None (the library's).

    Raises:
        ValueError: naming the text when it is not one of those, or ``MxN`` with M not in 64/128/192 or N not a
            positive multiple of 16 (the shapes FlashAttention-4's Hopper forward accepts for its two products).
    """
    text = text.strip().lower()
    if text in ("", "default"):
        return None
    if text == "fit":
        return "fit"
    m, _, n = text.partition("x")
    if not (m.isdigit() and n.isdigit()) or int(m) not in (64, 128, 192) or int(n) < 16 or int(n) % 16:
        raise ValueError(
            f"forward tile {text!r}: expected MxN with M one of 64, 128, 192 and N a positive multiple of 16 "
            "(e.g. 128x160), 'fit' or 'default'"
        )
    return int(m), int(n)
