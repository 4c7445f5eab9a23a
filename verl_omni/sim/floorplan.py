"""Procedural indoor floor plans: rooms, doors, an optional corridor and furniture, as labelled grids.

A plan is a rectangle of ``size_m`` metres split by a binary space partition into rooms separated by thin
walls. Every partition wall gets one door; because each split joins the two halves through its door,
the rooms form a connected tree whatever the later splits do. With ``corridor_probability`` the first
split is a corridor strip (two parallel walls, a door from each side). Furniture (tables, sofas, beds,
shelves, plants, cabinets) is then dropped into rooms; a piece is kept only when the free space a robot
of ``robot_radius`` can use stays connected through every door.

Everything is drawn from one ``numpy.random.Generator``, so a seed reproduces the plan exactly.

Grids use the occupancy conventions of ``docs/contracts.md`` (row = +y, col = +x, origin at the outer
corner of cell (0, 0)). ``FloorPlan.material`` holds ``FREE`` (0), ``WALL`` (1) or ``FURNITURE_BASE + i``
for furniture item ``i``; ``FloorPlan.room_id`` holds the room index of each cell (-1 on walls).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap

FREE, WALL, FURNITURE_BASE = 0, 1, 2
SEMANTICS_FORMAT = "wnm-sim-semantics/1"

ROOM_TYPES = ("kitchen", "bedroom", "living room", "office", "bathroom", "dining room", "study", "laundry room")
# Floor tints per room (RGB); muted so that furniture colours stand out.
FLOOR_COLOURS = (
    (150, 118, 84),
    (120, 130, 150),
    (165, 150, 120),
    (110, 125, 105),
    (175, 170, 160),
    (140, 105, 95),
    (125, 115, 135),
    (160, 140, 100),
    (135, 135, 135),
)
# Named furniture colours used in instructions.
FURNITURE_COLOURS = {
    "red": (200, 40, 40),
    "blue": (40, 70, 210),
    "green": (40, 160, 60),
    "yellow": (230, 200, 40),
    "orange": (235, 120, 30),
    "purple": (130, 50, 170),
    "black": (35, 35, 40),
    "white": (245, 245, 240),
}
# kind: (min size m, max size m, height m). Sizes are (along x, along y) before an optional 90-degree turn.
FURNITURE_KINDS = {
    "table": ((0.8, 0.6), (1.3, 0.9), 0.75),
    "sofa": ((1.4, 0.7), (2.0, 0.9), 0.8),
    "bed": ((1.4, 1.9), (1.6, 2.1), 0.6),
    "shelf": ((0.8, 0.3), (1.4, 0.4), 1.9),
    "plant": ((0.35, 0.35), (0.5, 0.5), 1.2),
    "cabinet": ((0.6, 0.5), (1.0, 0.6), 1.1),
}
HALLWAY = "hallway"


class FloorPlanError(ValueError):
    """The requested floor-plan parameters cannot produce a valid plan."""


@dataclass(frozen=True)
class FloorPlanConfig:
    """Parameters of the floor-plan generator.

    Attributes:
        size_m: Outer size ``(width along x, height along y)`` in metres.
        resolution: Metres per grid cell.
        wall_thickness_m: Thickness of outer and inner walls.
        min_room_size_m: A room is split only if both parts keep at least this interior size.
        max_rooms: Upper bound on the number of rooms (the corridor counts as one).
        door_width_m: Width of door openings.
        corridor_probability: Chance that the first split is a corridor.
        corridor_width_m: Interior width of the corridor.
        furniture_per_room: Inclusive ``(min, max)`` furniture pieces per room (the corridor gets at most one).
        robot_radius: Radius of the disc robot; doors and furniture placement keep it able to pass.
        max_attempts: Furniture placement attempts per piece before giving up on that piece.
    """

    size_m: tuple[float, float] = (8.0, 6.0)
    resolution: float = 0.05
    wall_thickness_m: float = 0.1
    min_room_size_m: float = 2.4
    max_rooms: int = 5
    door_width_m: float = 0.9
    corridor_probability: float = 0.5
    corridor_width_m: float = 1.2
    furniture_per_room: tuple[int, int] = (1, 3)
    robot_radius: float = ROBOT_RADIUS_M
    max_attempts: int = 30

    def __post_init__(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise FloorPlanError(f"FloorPlanConfig.{name}: {msg}")

        if len(self.size_m) != 2 or not all(math.isfinite(v) and v > 0 for v in self.size_m):
            fail("size_m", f"needs two positive sizes in metres, got {self.size_m}")
        if not (math.isfinite(self.resolution) and 0 < self.resolution <= 0.25):
            fail("resolution", f"must be in (0, 0.25] metres per cell, got {self.resolution}")
        if self.wall_thickness_m < self.resolution:
            fail("wall_thickness_m", f"{self.wall_thickness_m} m is thinner than one cell ({self.resolution} m)")
        if self.door_width_m < 2 * self.robot_radius + 2 * self.resolution:
            fail("door_width_m", f"{self.door_width_m} m is too narrow for a robot of radius {self.robot_radius} m")
        if self.min_room_size_m < self.door_width_m + 2 * self.wall_thickness_m:
            fail("min_room_size_m", f"{self.min_room_size_m} m cannot fit a door of {self.door_width_m} m")
        if self.max_rooms < 1:
            fail("max_rooms", f"must be >= 1, got {self.max_rooms}")
        if not 0.0 <= self.corridor_probability <= 1.0:
            fail("corridor_probability", f"must be in [0, 1], got {self.corridor_probability}")
        if self.corridor_width_m < 2 * self.robot_radius + 2 * self.resolution:
            fail("corridor_width_m", f"{self.corridor_width_m} m is too narrow for the robot")
        lo, hi = self.furniture_per_room
        if not 0 <= lo <= hi:
            fail("furniture_per_room", f"needs 0 <= min <= max, got {self.furniture_per_room}")
        if self.robot_radius <= 0:
            fail("robot_radius", f"must be > 0, got {self.robot_radius}")
        if self.max_attempts < 1:
            fail("max_attempts", f"must be >= 1, got {self.max_attempts}")
        interior = min(self.size_m) - 2 * self.wall_thickness_m
        if interior < 2 * self.robot_radius + 4 * self.resolution:
            fail("size_m", f"{self.size_m} leaves no free space inside walls of {self.wall_thickness_m} m")

    def cells(self, metres: float) -> int:
        """Metres -> whole cells (at least 1)."""
        return max(1, int(round(metres / self.resolution)))


@dataclass
class Room:
    """A rectangular room, in cell coordinates ``[row0, row1) x [col0, col1)`` of its interior."""

    index: int
    kind: str
    rect: tuple[int, int, int, int]
    floor_rgb: tuple[int, int, int]


@dataclass
class Furniture:
    """A furniture piece occupying the cell rectangle ``[row0, row1) x [col0, col1)``."""

    index: int
    kind: str
    colour: str
    rgb: tuple[int, int, int]
    height_m: float
    rect: tuple[int, int, int, int]
    room: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass
class Door:
    """A door opening: the wall cells ``[row0, row1) x [col0, col1)`` that were cleared."""

    rect: tuple[int, int, int, int]
    rooms: tuple[int, int]


@dataclass
class FloorPlan:
    """A generated plan: labelled grids plus the room and furniture lists.

    Attributes:
        material: ``uint8 [H, W]`` FREE / WALL / FURNITURE_BASE + furniture index.
        room_id: ``int16 [H, W]`` room index of each cell (-1 on walls).
        rooms: Rooms in index order.
        furniture: Furniture in index order.
        doors: Door openings.
        resolution: Metres per cell.
        origin: World ``(x, y)`` of the outer corner of cell (0, 0).
    """

    material: np.ndarray
    room_id: np.ndarray
    rooms: list[Room]
    furniture: list[Furniture]
    doors: list[Door]
    resolution: float
    origin: tuple[float, float] = (0.0, 0.0)
    scene_id: str = ""
    _occupancy: OccupancyMap | None = field(default=None, init=False, repr=False)

    @property
    def occupied(self) -> np.ndarray:
        """``bool [H, W]``: walls and furniture."""
        return self.material != FREE

    def furniture_centre(self, index: int) -> np.ndarray:
        """``[2]`` world centre of furniture piece ``index``'s cell rectangle."""
        r0, r1, c0, c1 = self.furniture[index].rect
        return self.occupancy().grid_to_world((r0 + r1 - 1) / 2, (c0 + c1 - 1) / 2)

    def occupancy(self) -> OccupancyMap:
        """The plan as an :class:`OccupancyMap` (built once; its clearance/geodesic caches are shared)."""
        if self._occupancy is None:
            self._occupancy = OccupancyMap.from_grid(
                self.occupied, self.resolution, self.origin, scene_id=self.scene_id
            )
        return self._occupancy

    def furniture_mask(self, index: int) -> np.ndarray:
        """``bool [H, W]`` cells of furniture piece ``index``."""
        return self.material == FURNITURE_BASE + index

    def room_of(self, xy: np.ndarray) -> np.ndarray:
        """Room index at world points ``[..., 2]`` (-1 on walls or outside)."""
        rows, cols = self.occupancy().world_to_grid(xy)
        h, w = self.material.shape
        inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
        return np.where(inside, self.room_id[np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)], -1)

    # ------------------------------------------------------------------ I/O
    def save(self, scene_dir: str | Path) -> None:
        """Writes ``occupancy.png/json`` (InteriorGS layout) plus ``semantics.npz`` and ``semantics.json``.

        The semantic files let the renderer and the evaluator redraw the scene from disk; consumers that
        only need occupancy ignore them.
        """
        scene_dir = Path(scene_dir)
        self.occupancy().save(scene_dir)
        tmp = scene_dir / "semantics.npz.tmp"
        with open(tmp, "wb") as f:
            np.savez_compressed(f, material=self.material, room_id=self.room_id)
        tmp.replace(scene_dir / "semantics.npz")
        meta = {
            "format": SEMANTICS_FORMAT,
            "scene_id": self.scene_id,
            "rooms": [asdict(r) for r in self.rooms],
            "furniture": [asdict(f) for f in self.furniture],
            "doors": [asdict(d) for d in self.doors],
        }
        tmp_json = scene_dir / "semantics.json.tmp"
        tmp_json.write_text(json.dumps(meta, indent=1) + "\n")
        tmp_json.replace(scene_dir / "semantics.json")

    @classmethod
    def load(cls, scene_dir: str | Path) -> FloorPlan:
        """Reads a scene written by :meth:`save`.

        Raises:
            FloorPlanError: a semantic file is missing or disagrees with the occupancy grid.
        """
        scene_dir = Path(scene_dir)
        occ = OccupancyMap.load(scene_dir)
        npz_path, meta_path = scene_dir / "semantics.npz", scene_dir / "semantics.json"
        for p in (npz_path, meta_path):
            if not p.is_file():
                raise FloorPlanError(f"{p}: missing (scene was not written by verl_omni.sim)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != SEMANTICS_FORMAT:
            raise FloorPlanError(
                f"{meta_path}: field 'format' is {meta.get('format')!r}, expected {SEMANTICS_FORMAT!r}"
            )
        with np.load(npz_path) as z:
            material, room_id = z["material"], z["room_id"]
        if material.shape != occ.shape or not np.array_equal(material != FREE, ~occ.free):
            raise FloorPlanError(f"{npz_path}: material grid disagrees with {scene_dir / 'occupancy.png'}")

        def tup(d: dict, key: str) -> dict:
            d = dict(d)
            d[key] = tuple(d[key])
            return d

        rooms = [Room(**{**tup(r, "rect"), "floor_rgb": tuple(r["floor_rgb"])}) for r in meta["rooms"]]
        furniture = [Furniture(**{**tup(f, "rect"), "rgb": tuple(f["rgb"])}) for f in meta["furniture"]]
        doors = [Door(rect=tuple(d["rect"]), rooms=tuple(d["rooms"])) for d in meta["doors"]]
        plan = cls(material, room_id, rooms, furniture, doors, occ.resolution, occ.origin, scene_id=scene_dir.name)
        plan._occupancy = occ
        return plan


# ---------------------------------------------------------------------- generation
@dataclass
class _Split:
    horizontal: bool  # True: wall spans columns at fixed rows (separates up/down)
    wall: tuple[int, int]  # [start, end) rows (horizontal) or cols (vertical) of the wall
    span: tuple[int, int]  # [start, end) cols (horizontal) or rows (vertical) along the wall


def _partition(
    rect: tuple[int, int, int, int], cfg: FloorPlanConfig, rng: np.random.Generator, budget: int
) -> tuple[list[tuple[int, int, int, int]], list[_Split]]:
    """Recursively splits an interior rectangle; returns leaf rooms and the walls between them."""
    r0, r1, c0, c1 = rect
    t, min_cells = cfg.cells(cfg.wall_thickness_m), cfg.cells(cfg.min_room_size_m)
    h, w = r1 - r0, c1 - c0
    can_h, can_v = h >= 2 * min_cells + t, w >= 2 * min_cells + t
    if budget <= 1 or not (can_h or can_v):
        return [rect], []
    # Prefer cutting across the longer side so rooms stay roughly square.
    horizontal = can_h and (not can_v or h > w or (h == w and rng.random() < 0.5))
    lo_len = h if horizontal else w
    pos = int(rng.integers(min_cells, lo_len - min_cells - t + 1))
    if horizontal:
        a, b = (r0, r0 + pos, c0, c1), (r0 + pos + t, r1, c0, c1)
        split = _Split(True, (r0 + pos, r0 + pos + t), (c0, c1))
    else:
        a, b = (r0, r1, c0, c0 + pos), (r0, r1, c0 + pos + t, c1)
        split = _Split(False, (c0 + pos, c0 + pos + t), (r0, r1))
    budget_a = max(1, int(rng.integers(1, budget)))
    rooms_a, splits_a = _partition(a, cfg, rng, budget_a)
    rooms_b, splits_b = _partition(b, cfg, rng, budget - len(rooms_a))
    return rooms_a + rooms_b, [split, *splits_a, *splits_b]


def _corridor(
    rect: tuple[int, int, int, int], cfg: FloorPlanConfig, rng: np.random.Generator
) -> tuple[list[tuple[int, int, int, int]], list[_Split], tuple[int, int, int, int]] | None:
    """Cuts a corridor strip across the longer side; None when the rectangle is too small for one."""
    r0, r1, c0, c1 = rect
    t, min_cells, cw = cfg.cells(cfg.wall_thickness_m), cfg.cells(cfg.min_room_size_m), cfg.cells(cfg.corridor_width_m)
    h, w = r1 - r0, c1 - c0
    across_rows = h >= w  # the corridor runs along x (spans columns) when the plan is taller than wide
    length = h if across_rows else w
    free_len = length - cw - 2 * t
    if free_len < 2 * min_cells:
        return None
    pos = int(rng.integers(min_cells, free_len - min_cells + 1))
    if across_rows:
        a = (r0, r0 + pos, c0, c1)
        corridor = (r0 + pos + t, r0 + pos + t + cw, c0, c1)
        b = (corridor[1] + t, r1, c0, c1)
        walls = [_Split(True, (a[1], corridor[0]), (c0, c1)), _Split(True, (corridor[1], b[0]), (c0, c1))]
    else:
        a = (r0, r1, c0, c0 + pos)
        corridor = (r0, r1, c0 + pos + t, c0 + pos + t + cw)
        b = (r0, r1, corridor[3] + t, c1)
        walls = [_Split(False, (a[3], corridor[2]), (r0, r1)), _Split(False, (corridor[3], b[2]), (r0, r1))]
    return [a, b], walls, corridor


def _door_for(split: _Split, material: np.ndarray, room_id: np.ndarray, cfg: FloorPlanConfig, rng) -> Door:
    """Clears a door in a split wall where both sides of the opening are free floor."""
    dw, t = cfg.cells(cfg.door_width_m), cfg.cells(cfg.wall_thickness_m)
    w0, w1 = split.wall
    s0, s1 = split.span
    if split.horizontal:
        side_a, side_b = material[w0 - 1, s0:s1], material[w1, s0:s1]
        ids_a, ids_b = room_id[w0 - 1, s0:s1], room_id[w1, s0:s1]
    else:
        side_a, side_b = material[s0:s1, w0 - 1], material[s0:s1, w1]
        ids_a, ids_b = room_id[s0:s1, w0 - 1], room_id[s0:s1, w1]
    ok = (side_a == FREE) & (side_b == FREE)
    # A start is valid when the whole opening plus a wall-thickness margin each side is free on both sides,
    # and each side belongs to a single room (an opening must not straddle a perpendicular wall).
    need = dw + 2 * t
    starts = [
        i + t
        for i in range(0, len(ok) - need + 1)
        if ok[i : i + need].all() and len(set(ids_a[i : i + need])) == 1 and len(set(ids_b[i : i + need])) == 1
    ]
    if not starts:
        raise FloorPlanError(
            "no place for a door in a partition wall; increase min_room_size_m or decrease door_width_m"
        )
    d = starts[int(rng.integers(len(starts)))]
    if split.horizontal:
        rect = (w0, w1, s0 + d, s0 + d + dw)
        a_id, b_id = int(room_id[w0 - 1, s0 + d]), int(room_id[w1, s0 + d])
    else:
        rect = (s0 + d, s0 + d + dw, w0, w1)
        a_id, b_id = int(room_id[s0 + d, w0 - 1]), int(room_id[s0 + d, w1])
    material[rect[0] : rect[1], rect[2] : rect[3]] = FREE
    # Door cells belong to the first room so that floor lookups stay defined.
    room_id[rect[0] : rect[1], rect[2] : rect[3]] = a_id
    return Door(rect=rect, rooms=(a_id, b_id))


def _reachable(free: np.ndarray, resolution: float, radius: float) -> np.ndarray:
    """``bool [H, W]`` cells whose centre keeps a disc of ``radius`` clear of blocked cells."""
    from scipy.ndimage import distance_transform_edt

    edt = distance_transform_edt(np.pad(free, 1, constant_values=False))[1:-1, 1:-1] * resolution
    return (edt - 0.5 * resolution) >= radius


def _doors_connected(material: np.ndarray, doors: list[Door], cfg: FloorPlanConfig) -> bool:
    """True when one robot-reachable component touches every door."""
    from scipy.ndimage import label

    reach = _reachable(material == FREE, cfg.resolution, cfg.robot_radius + cfg.resolution)
    labels, n = label(reach, structure=np.ones((3, 3), bool))
    if n == 0:
        return False
    comps = set()
    for d in doors:
        r0, r1, c0, c1 = d.rect
        vals = labels[r0:r1, c0:c1]
        vals = vals[vals > 0]
        if vals.size == 0:
            return False
        comps.add(int(np.bincount(vals).argmax()))
    return len(comps) <= 1


def _place_furniture(plan: FloorPlan, room: Room, count: int, cfg: FloorPlanConfig, rng: np.random.Generator) -> None:
    kinds = list(FURNITURE_KINDS)
    if room.kind != "bedroom":
        kinds.remove("bed")
    colours = list(FURNITURE_COLOURS)
    r0, r1, c0, c1 = room.rect
    keep_out = cfg.cells(0.8)  # keep the floor in front of doors clear so doors stay usable
    for _ in range(count):
        for _attempt in range(cfg.max_attempts):
            kind = kinds[int(rng.integers(len(kinds)))]
            (lo_x, lo_y), (hi_x, hi_y), height = FURNITURE_KINDS[kind]
            sx, sy = rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y)
            if rng.random() < 0.5:
                sx, sy = sy, sx
            nr, nc = cfg.cells(sy), cfg.cells(sx)
            if nr >= r1 - r0 or nc >= c1 - c0:
                continue
            pr = int(rng.integers(r0, r1 - nr + 1))
            pc = int(rng.integers(c0, c1 - nc + 1))
            rect = (pr, pr + nr, pc, pc + nc)
            if (plan.material[pr : pr + nr, pc : pc + nc] != FREE).any():
                continue
            near_door = any(
                pr < d.rect[1] + keep_out and d.rect[0] - keep_out < pr + nr and pc < d.rect[3] + keep_out
                and d.rect[2] - keep_out < pc + nc
                for d in plan.doors
            )  # fmt: skip
            if near_door:
                continue
            idx = len(plan.furniture)
            colour = colours[int(rng.integers(len(colours)))]
            trial = plan.material.copy()
            trial[pr : pr + nr, pc : pc + nc] = FURNITURE_BASE + idx
            if not _doors_connected(trial, plan.doors, cfg):
                continue
            plan.material = trial
            plan.furniture.append(Furniture(idx, kind, colour, FURNITURE_COLOURS[colour], height, rect, room.index))
            break


def generate_floor_plan(cfg: FloorPlanConfig, rng: np.random.Generator, scene_id: str = "") -> FloorPlan:
    """Generates a floor plan.

    Args:
        cfg: Generator parameters (validated on construction).
        rng: Source of all randomness; the same generator state gives the same plan.
        scene_id: Name stored with the plan.

    Returns:
        A plan whose free space is connected for a robot of ``cfg.robot_radius`` through every door and
        that has at least one furniture piece (so that episodes have a goal object).

    Raises:
        FloorPlanError: the parameters leave no room for doors or furniture.
    """
    res = cfg.resolution
    h, w = cfg.cells(cfg.size_m[1]), cfg.cells(cfg.size_m[0])
    t = cfg.cells(cfg.wall_thickness_m)
    interior = (t, h - t, t, w - t)
    corridor_rect = None
    if cfg.max_rooms >= 3 and rng.random() < cfg.corridor_probability:
        cut = _corridor(interior, cfg, rng)
        if cut is not None:
            (a, b), splits, corridor_rect = cut
            budget_a = max(1, (cfg.max_rooms - 1) // 2)
            rooms_a, splits_a = _partition(a, cfg, rng, budget_a)
            rooms_b, splits_b = _partition(b, cfg, rng, cfg.max_rooms - 1 - len(rooms_a))
            rects = [corridor_rect, *rooms_a, *rooms_b]
            splits = [*splits, *splits_a, *splits_b]
    if corridor_rect is None:
        rects, splits = _partition(interior, cfg, rng, cfg.max_rooms)

    material = np.full((h, w), WALL, np.uint8)
    room_id = np.full((h, w), -1, np.int16)
    kinds = list(ROOM_TYPES)
    rng.shuffle(kinds)
    rooms = []
    for i, rect in enumerate(rects):
        material[rect[0] : rect[1], rect[2] : rect[3]] = FREE
        room_id[rect[0] : rect[1], rect[2] : rect[3]] = i
        kind = HALLWAY if rect == corridor_rect else kinds[i % len(kinds)]
        rooms.append(Room(i, kind, rect, FLOOR_COLOURS[i % len(FLOOR_COLOURS)]))
    doors = [_door_for(s, material, room_id, cfg, rng) for s in splits]
    plan = FloorPlan(material, room_id, rooms, [], doors, res, (0.0, 0.0), scene_id=scene_id)
    if not _doors_connected(material, doors, cfg):
        raise FloorPlanError("rooms are not connected for the robot; widen door_width_m or shrink robot_radius")
    lo, hi = cfg.furniture_per_room
    for room in rooms:
        n = int(rng.integers(lo, hi + 1))
        _place_furniture(plan, room, min(n, 1) if room.kind == HALLWAY else n, cfg, rng)
    if not plan.furniture:
        raise FloorPlanError(
            "no furniture could be placed (episodes need a goal object); enlarge size_m or min_room_size_m, "
            "or raise furniture_per_room"
        )
    return plan
