"""Named task levels of the synthetic world: one room, two rooms, a whole house.

A level fixes what makes episodes harder or easier: the floor size, how many rooms the partition may make,
whether a corridor appears, and the shortest start-goal distance. Training data, Stage-III collections and
closed-loop evaluation name the same level so that every result says which benchmark it is on. Each level
has its own scripted baselines (``verl_omni.sim.reference_policies``); a learned policy is judged against the
goal-bearing baseline of its own level.

Why levels: in the whole house (8 x 6 m, up to 5 rooms) the goal is in the start room in only a few percent
of episodes, so a policy that sees only its camera and the instruction must explore; in one room the goal
object is in view after a turn in place in nearly every episode.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_omni.sim.floorplan import FloorPlanConfig


@dataclass(frozen=True)
class TaskLevel:
    """One benchmark level.

    Attributes:
        name: Level name used on the command line and in reports.
        size_m: Floor size ``(x, y)`` in metres.
        max_rooms: Upper bound on rooms (the corridor counts as one).
        corridor_probability: Chance that the first split is a corridor.
        min_goal_distance_m: Shortest geodesic start-goal distance of an episode.
        description: One line for reports.
    """

    name: str
    size_m: tuple[float, float]
    max_rooms: int
    corridor_probability: float
    min_goal_distance_m: float
    description: str

    def floorplan(self, **overrides) -> FloorPlanConfig:
        """The floor-plan generator settings of this level (``overrides`` e.g. ``resolution``)."""
        kwargs = {
            "size_m": self.size_m,
            "max_rooms": self.max_rooms,
            "corridor_probability": self.corridor_probability,
            **overrides,
        }
        return FloorPlanConfig(**kwargs)


LEVELS: dict[str, TaskLevel] = {
    "one_room": TaskLevel("one_room", (6.0, 5.0), 1, 0.0, 3.0, "a single 6 x 5 m room with furniture"),
    "two_rooms": TaskLevel("two_rooms", (8.0, 5.0), 2, 0.0, 3.0, "two rooms of an 8 x 5 m floor joined by a door"),
    "house": TaskLevel("house", (8.0, 6.0), 5, 0.5, 3.0, "an 8 x 6 m house of up to 5 rooms, maybe a corridor"),
}
DEFAULT_LEVEL = "house"  # the collection default since the first release


def get_level(name: str) -> TaskLevel:
    """Looks a level up by name.

    Raises:
        ValueError: unknown name (the message lists the levels).
    """
    if name not in LEVELS:
        raise ValueError(f"unknown task level {name!r}; choose one of {sorted(LEVELS)}")
    return LEVELS[name]
