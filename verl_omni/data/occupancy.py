"""Occupancy scenes in the InteriorGS layout: I/O, world <-> grid transforms, clearance, geodesic fields.

Layout of a scene directory (``docs/contracts.md``)::

    <scene_dir>/occupancy.png    8-bit grey: 255 free, 0 occupied, 128 unknown
    <scene_dir>/occupancy.json   {"format": "interiorgs-occupancy/1", "resolution": m/px,
                                  "origin": [x, y] of the outer corner of pixel (0, 0),
                                  "axes": {"col": "+x", "row": "+y"}}

Unknown cells count as occupied for planning, clearance and collision. Pixel ``(row, col)`` covers
``x in [ox + col r, ox + (col + 1) r)`` and ``y in [oy + row r, oy + (row + 1) r)``.

Clearance is the Euclidean distance transform (scipy) from free cell centres to the nearest blocked
cell centre, minus half a cell so that it approximates the distance to the blocked cell's boundary.
Geodesic distance-to-goal is Dijkstra (scipy.sparse.csgraph) over the 8-connected free-cell graph with
edge lengths ``r`` and ``r sqrt(2)``; a diagonal move is only allowed when both side cells are free, so
paths never cut wall corners.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "interiorgs-occupancy/1"
FREE_VALUE, OCCUPIED_VALUE, UNKNOWN_VALUE = 255, 0, 128
AXES = {"col": "+x", "row": "+y"}
# The robot's disc footprint (metres), one value for everything that asks whether the robot fits: the expert
# planner, the event labeller, the closed-loop evaluator and the Stage-III reward. A reward footprint smaller than
# the evaluator's would let rollouts graze walls the evaluation counts as collisions.
ROBOT_RADIUS_M = 0.2


class OccupancyError(ValueError):
    """A scene file is missing, malformed or inconsistent."""


@dataclass
class OccupancyMap:
    """A 2D occupancy grid with cached clearance and geodesic fields.

    Attributes:
        state: ``uint8 [H, W]`` cell states (255 free, 0 occupied, 128 unknown).
        resolution: Metres per cell.
        origin: World ``(x, y)`` of the outer corner of cell ``(0, 0)``.
        scene_id: Optional name, used in messages.
    """

    state: np.ndarray
    resolution: float
    origin: tuple[float, float]
    scene_id: str = ""
    max_cached_goals: int = 64
    _clearance: np.ndarray | None = field(default=None, init=False, repr=False)
    _geodesic: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _graph: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        st = np.asarray(self.state)
        if st.ndim != 2 or st.shape[0] < 2 or st.shape[1] < 2:
            raise OccupancyError(
                f"scene {self.scene_id!r}: occupancy grid must be 2D with at least 2x2 cells, got {st.shape}"
            )
        bad = ~np.isin(st, (FREE_VALUE, OCCUPIED_VALUE, UNKNOWN_VALUE))
        if bad.any():
            raise OccupancyError(
                f"scene {self.scene_id!r}: occupancy grid has {int(bad.sum())} cells that are not "
                f"255 (free), 0 (occupied) or 128 (unknown)"
            )
        self.state = st.astype(np.uint8)
        if not (isinstance(self.resolution, (int, float)) and math.isfinite(self.resolution) and self.resolution > 0):
            raise OccupancyError(
                f"scene {self.scene_id!r}: resolution must be a positive number, got {self.resolution!r}"
            )
        self.resolution = float(self.resolution)
        if len(self.origin) != 2 or not all(math.isfinite(float(v)) for v in self.origin):
            raise OccupancyError(f"scene {self.scene_id!r}: origin must be two finite numbers, got {self.origin!r}")
        self.origin = (float(self.origin[0]), float(self.origin[1]))

    # ------------------------------------------------------------------ construction and I/O
    @classmethod
    def from_grid(
        cls,
        occupied: np.ndarray,
        resolution: float,
        origin=(0.0, 0.0),
        scene_id: str = "",
        unknown: np.ndarray | None = None,
    ) -> OccupancyMap:
        """Builds a map from a boolean ``[H, W]`` occupied mask (and optional unknown mask)."""
        occupied = np.asarray(occupied, dtype=bool)
        state = np.where(occupied, OCCUPIED_VALUE, FREE_VALUE).astype(np.uint8)
        if unknown is not None:
            state[np.asarray(unknown, dtype=bool)] = UNKNOWN_VALUE
        return cls(state=state, resolution=resolution, origin=tuple(origin), scene_id=scene_id)

    @classmethod
    def load(cls, scene_dir: str | Path) -> OccupancyMap:
        """Loads ``occupancy.png`` + ``occupancy.json`` from a scene directory.

        Raises:
            OccupancyError: naming the file and field when anything is missing or malformed.
        """
        from PIL import Image  # pillow is a base dependency; imported here to keep module import light

        scene_dir = Path(scene_dir)
        png, meta_path = scene_dir / "occupancy.png", scene_dir / "occupancy.json"
        for p in (png, meta_path):
            if not p.is_file():
                raise OccupancyError(
                    f"{p}: missing occupancy file (expected InteriorGS layout occupancy.png + occupancy.json)"
                )
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OccupancyError(f"{meta_path}: not valid JSON ({e})") from e
        for key in ("resolution", "origin"):
            if key not in meta:
                raise OccupancyError(f"{meta_path}: missing field {key!r}")
        axes = meta.get("axes", AXES)
        if axes != AXES:
            raise OccupancyError(f"{meta_path}: field 'axes' is {axes}, only {AXES} is supported")
        try:
            with Image.open(png) as im:
                state = np.array(im.convert("L"))
        except OSError as e:
            raise OccupancyError(f"{png}: cannot read image ({e})") from e
        try:
            return cls(
                state=state, resolution=meta["resolution"], origin=tuple(meta["origin"]), scene_id=scene_dir.name
            )
        except OccupancyError as e:
            raise OccupancyError(f"{scene_dir}: {e}") from e

    def save(self, scene_dir: str | Path) -> None:
        """Writes the scene files (each to a temporary name, then renamed)."""
        from PIL import Image

        scene_dir = Path(scene_dir)
        scene_dir.mkdir(parents=True, exist_ok=True)
        tmp_png = scene_dir / "occupancy.png.tmp"
        Image.fromarray(self.state, mode="L").save(tmp_png, format="PNG")
        tmp_png.replace(scene_dir / "occupancy.png")
        meta = {
            "format": FORMAT,
            "resolution": self.resolution,
            "origin": list(self.origin),
            "axes": AXES,
            "shape": list(self.state.shape),
        }
        tmp_json = scene_dir / "occupancy.json.tmp"
        tmp_json.write_text(json.dumps(meta, indent=2) + "\n")
        tmp_json.replace(scene_dir / "occupancy.json")

    # ------------------------------------------------------------------ basic properties
    @property
    def shape(self) -> tuple[int, int]:
        return self.state.shape  # type: ignore[return-value]

    @property
    def free(self) -> np.ndarray:
        """``bool [H, W]``: cells the robot may occupy (unknown counts as blocked)."""
        return self.state == FREE_VALUE

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """World bounds ``(x_min, x_max, y_min, y_max)``."""
        h, w = self.shape
        ox, oy = self.origin
        return ox, ox + w * self.resolution, oy, oy + h * self.resolution

    # ------------------------------------------------------------------ transforms
    def world_to_grid(self, xy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """World ``[..., 2]`` -> integer ``(row, col)`` arrays of the containing cell (may be out of bounds)."""
        xy = np.asarray(xy, dtype=np.float64)
        col = np.floor((xy[..., 0] - self.origin[0]) / self.resolution)
        row = np.floor((xy[..., 1] - self.origin[1]) / self.resolution)
        # Non-finite inputs map to an out-of-bounds index instead of an invalid cast.
        col = np.where(np.isfinite(col), col, -1).astype(np.int64)
        row = np.where(np.isfinite(row), row, -1).astype(np.int64)
        return row, col

    def grid_to_world(self, rows, cols) -> np.ndarray:
        """Cell indices -> world ``[..., 2]`` of the cell centres."""
        rows = np.asarray(rows, dtype=np.float64)
        cols = np.asarray(cols, dtype=np.float64)
        x = self.origin[0] + (cols + 0.5) * self.resolution
        y = self.origin[1] + (rows + 0.5) * self.resolution
        return np.stack([x, y], axis=-1)

    def in_bounds(self, xy: np.ndarray) -> np.ndarray:
        """``bool [...]``: the point lies inside the grid."""
        row, col = self.world_to_grid(xy)
        h, w = self.shape
        return (row >= 0) & (row < h) & (col >= 0) & (col < w)

    def lookup(self, field_: np.ndarray, xy: np.ndarray, outside: float) -> np.ndarray:
        """Nearest-cell value of a ``[H, W]`` field at world points ``xy [..., 2]`` (``outside`` off the map).

        The one lookup rule of every distance read from this map (clearance, geodesic distance), so that the
        reward and the closed-loop evaluator read a field at a pose identically.

        Returns:
            ``[...]`` values in the field's dtype.
        """
        row, col = self.world_to_grid(xy)
        h, w = self.shape
        inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
        vals = field_[np.clip(row, 0, h - 1), np.clip(col, 0, w - 1)]
        return np.where(inside, vals, outside)

    # ------------------------------------------------------------------ clearance
    @property
    def clearance_m(self) -> np.ndarray:
        """``float32 [H, W]`` metres from each cell to the nearest blocked cell (0 on blocked cells).

        Cells beyond the map border count as blocked, so the robot cannot leave the map.
        """
        if self._clearance is None:
            from scipy.ndimage import distance_transform_edt

            padded = np.pad(self.free, 1, constant_values=False)
            edt = distance_transform_edt(padded)[1:-1, 1:-1] * self.resolution
            self._clearance = np.where(self.free, np.maximum(edt - 0.5 * self.resolution, 0.0), 0.0).astype(np.float32)
        return self._clearance

    def clearance_at(self, xy: np.ndarray) -> np.ndarray:
        """Clearance (metres) at world points ``[..., 2]``; 0 outside the map."""
        return self.lookup(self.clearance_m, xy, 0.0).astype(np.float64)

    def disc_collides(self, xy: np.ndarray, radius: float) -> np.ndarray:
        """``bool [...]``: a disc robot of ``radius`` metres centred at ``xy`` overlaps blocked space."""
        return self.clearance_at(xy) < radius

    def segment_collides(
        self, start_xy: np.ndarray, end_xy: np.ndarray, radius: float, samples_per_metre: float = 20.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sweeps a disc along straight segments and finds the first contact.

        Args:
            start_xy: ``[N, 2]`` segment starts.
            end_xy: ``[N, 2]`` segment ends.
            radius: Disc radius in metres.
            samples_per_metre: Sampling density along the segment (use >= 2 / resolution).

        Returns:
            ``hit bool [N]`` and ``first_hit_fraction float [N]`` in ``[0, 1]`` (1.0 where no hit).
        """
        start_xy = np.asarray(start_xy, dtype=np.float64).reshape(-1, 2)
        end_xy = np.asarray(end_xy, dtype=np.float64).reshape(-1, 2)
        length = np.linalg.norm(end_xy - start_xy, axis=-1)
        finite_len = np.where(np.isfinite(length), length, 0.0)
        m = int(np.ceil(max(float(finite_len.max(initial=0.0)), 1e-9) * samples_per_metre)) + 1
        frac = np.linspace(0.0, 1.0, max(m, 2))
        pts = start_xy[:, None, :] + frac[None, :, None] * (end_xy - start_xy)[:, None, :]  # [N, M, 2]
        coll = self.disc_collides(pts, radius)
        coll |= ~np.isfinite(pts).all(axis=-1)
        hit = coll.any(axis=1)
        first = np.where(hit, frac[np.argmax(coll, axis=1)], 1.0)
        return hit, first

    # ------------------------------------------------------------------ geodesic distance
    def _free_graph(self):
        if self._graph is None:
            from scipy.sparse import coo_matrix

            h, w = self.shape
            free = self.free
            idx = np.arange(h * w).reshape(h, w)
            rows, cols, wts = [], [], []
            r = self.resolution
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                # Cell pairs (a, b) with b = a + (dr, dc), both inside the grid and free.
                r0, r1 = 0, h - dr
                c0, c1 = max(0, -dc), w - max(0, dc)
                a = free[r0:r1, c0:c1] & free[r0 + dr : r1 + dr, c0 + dc : c1 + dc]
                if dr and dc:  # diagonal: both side cells must be free (no corner cutting)
                    a &= free[r0 + dr : r1 + dr, c0:c1] & free[r0:r1, c0 + dc : c1 + dc]
                ia = idx[r0:r1, c0:c1][a]
                ib = idx[r0 + dr : r1 + dr, c0 + dc : c1 + dc][a]
                wt = r * (math.sqrt(2.0) if (dr and dc) else 1.0)
                rows += [ia, ib]
                cols += [ib, ia]
                wts += [np.full(ia.shape, wt), np.full(ib.shape, wt)]
            rows_a, cols_a, wts_a = np.concatenate(rows), np.concatenate(cols), np.concatenate(wts)
            self._graph = coo_matrix((wts_a, (rows_a, cols_a)), shape=(h * w, h * w)).tocsr()
        return self._graph

    def nearest_free_cell(self, xy: np.ndarray, max_distance_m: float = 0.5) -> tuple[int, int] | None:
        """The free cell closest to a world point within ``max_distance_m``, or None."""
        row, col = self.world_to_grid(np.asarray(xy, dtype=np.float64))
        row, col = int(row), int(col)
        h, w = self.shape
        if 0 <= row < h and 0 <= col < w and self.free[row, col]:
            return row, col
        k = int(math.ceil(max_distance_m / self.resolution))
        r0, r1 = max(0, row - k), min(h, row + k + 1)
        c0, c1 = max(0, col - k), min(w, col + k + 1)
        if r0 >= r1 or c0 >= c1:
            return None
        rr, cc = np.mgrid[r0:r1, c0:c1]
        ok = self.free[r0:r1, c0:c1]
        if not ok.any():
            return None
        d2 = (rr - row) ** 2 + (cc - col) ** 2
        d2 = np.where(ok, d2, np.iinfo(np.int64).max)
        i = int(np.argmin(d2))
        return int(rr.flat[i]), int(cc.flat[i])

    def geodesic_to(self, goal_xy) -> np.ndarray:
        """``float32 [H, W]`` shortest free-space path length (metres) from each cell to the goal.

        Blocked and unreachable cells are ``inf``. The goal snaps to the nearest free cell within 0.5 m.
        Fields are cached per goal cell (LRU, ``max_cached_goals``).

        Raises:
            OccupancyError: the goal is outside the map or not near any free cell.
        """
        goal_xy = np.asarray(goal_xy, dtype=np.float64).reshape(2)
        cell = self.nearest_free_cell(goal_xy)
        if cell is None:
            raise OccupancyError(f"scene {self.scene_id!r}: goal {goal_xy.tolist()} is not within 0.5 m of a free cell")
        if cell in self._geodesic:
            self._geodesic.move_to_end(cell)
            return self._geodesic[cell]
        from scipy.sparse.csgraph import dijkstra

        h, w = self.shape
        dist = dijkstra(self._free_graph(), directed=False, indices=cell[0] * w + cell[1])
        field_ = dist.reshape(h, w).astype(np.float32)
        field_[~self.free] = np.inf
        self._geodesic[cell] = field_
        while len(self._geodesic) > self.max_cached_goals:
            self._geodesic.popitem(last=False)
        return field_

    def geodesic_to_nearest(self, points_xy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shortest free-space path length from each cell to the nearest of several points, and which one it is.

        One multi-source Dijkstra (scipy's ``min_only``), so the cost is that of a single :meth:`geodesic_to`.

        Args:
            points_xy: ``[K, 2]`` world points, each in a free cell.

        Returns:
            ``(float32 [H, W] metres, int64 [H, W] index into points_xy)``; blocked and unreachable cells are
            ``inf`` and ``-1``.

        Raises:
            OccupancyError: a point is off the map or in a blocked cell.
        """
        from scipy.sparse.csgraph import dijkstra

        pts = np.asarray(points_xy, np.float64).reshape(-1, 2)
        rows, cols = self.world_to_grid(pts)
        h, w = self.shape
        inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
        if not inside.all() or not self.free[rows, cols].all():
            bad = pts[~(inside & self.free[np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)])][0]
            raise OccupancyError(f"scene {self.scene_id!r}: point {bad.tolist()} is off the map or not free")
        nodes = rows * w + cols
        dist, _, sources = dijkstra(
            self._free_graph(), directed=False, indices=nodes, min_only=True, return_predecessors=True
        )
        field_ = dist.reshape(h, w).astype(np.float32)
        field_[~self.free] = np.inf
        index_of_node = np.full(h * w, -1, np.int64)
        index_of_node[nodes[::-1]] = np.arange(len(nodes) - 1, -1, -1)  # a node given twice keeps its lowest index
        which = np.where(sources >= 0, index_of_node[np.maximum(sources, 0)], -1).reshape(h, w)
        which[~np.isfinite(field_)] = -1
        return field_, which

    def geodesic_at(self, goal_xy, xy: np.ndarray) -> np.ndarray:
        """Geodesic distance (metres) to the goal at world points ``[..., 2]``; inf outside or blocked."""
        return self.lookup(self.geodesic_to(goal_xy), xy, np.inf).astype(np.float64)

    def num_cached_goals(self) -> int:
        return len(self._geodesic)
