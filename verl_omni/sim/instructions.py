"""Language instructions for synthetic episodes: template variants naming the goal object and its room."""

from __future__ import annotations

import numpy as np

TEMPLATES: tuple[str, ...] = (
    "Go to the {room} and stop next to the {obj}.",
    "Find the {obj} in the {room} and stop beside it.",
    "Walk over to the {obj} in the {room}.",
    "Head for the {room}; stop when you reach the {obj}.",
    "Navigate to the {obj} that is in the {room} and stop there.",
    "Your target is the {obj} in the {room}. Move to it and stop.",
)


def make_instructions(room: str, obj: str, count: int, rng: np.random.Generator) -> list[str]:
    """Distinct instruction variants for one goal.

    Args:
        room: Room type of the goal, e.g. ``"kitchen"``.
        obj: Object description, e.g. ``"blue table"``.
        count: Number of variants (1 .. ``len(TEMPLATES)``).
        rng: Chooses which templates are used and their order.

    Returns:
        ``count`` different sentences.
    """
    if not 1 <= count <= len(TEMPLATES):
        raise ValueError(f"make_instructions: count must be in [1, {len(TEMPLATES)}], got {count}")
    if not room or not obj:
        raise ValueError(f"make_instructions: room and obj must be non-empty, got {room!r}, {obj!r}")
    picks = rng.choice(len(TEMPLATES), size=count, replace=False)
    return [TEMPLATES[int(i)].format(room=room, obj=obj) for i in picks]
