"""Per-worker cache of occupancy maps and geodesic distance-to-goal fields.

A reward worker scores many batches over a few hundred scenes. Loading a scene (PNG decode, clearance
EDT) and a geodesic field (Dijkstra over the free-cell graph) are the expensive parts of reward scoring,
so each scene is loaded once and each (scene, goal) field computed once; later batches only do table
lookups. Failures (unknown scene, unreadable files, goal in a wall) are cached too, as messages, so a bad
scene costs one attempt per worker rather than one per rollout.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from verl_omni.data.occupancy import OccupancyError, OccupancyMap


class SceneCache:
    """Occupancy maps by scene id and geodesic fields by (scene id, goal), both memoized.

    Args:
        occupancy_root: Directory holding ``<scene_id>/occupancy.{png,json}``; None to use only maps added
            with ``add``.
        max_geodesic_fields: LRU bound on cached geodesic fields over all scenes (each is ``float32 [H, W]``).
    """

    def __init__(self, occupancy_root: str | Path | None = None, max_geodesic_fields: int = 512) -> None:
        if max_geodesic_fields < 1:
            raise ValueError(f"SceneCache: max_geodesic_fields must be >= 1, got {max_geodesic_fields}")
        self.occupancy_root = Path(occupancy_root) if occupancy_root is not None else None
        self.max_geodesic_fields = int(max_geodesic_fields)
        self._maps: dict[str, OccupancyMap | str] = {}
        self._geodesic: OrderedDict[tuple[str, float, float], np.ndarray | str] = OrderedDict()

    def add(self, scene_id: str, occupancy: OccupancyMap) -> None:
        """Registers an in-memory map (synthetic scenes, tests); replaces any cached entry for the id."""
        self._maps[scene_id] = occupancy
        for key in [k for k in self._geodesic if k[0] == scene_id]:
            del self._geodesic[key]

    def get(self, scene_id: str) -> tuple[OccupancyMap | None, str | None]:
        """Returns ``(map, None)`` or ``(None, reason)``; never raises for a bad scene."""
        entry = self._maps.get(scene_id)
        if entry is None:
            entry = self._load(scene_id)
            self._maps[scene_id] = entry
        if isinstance(entry, str):
            return None, entry
        return entry, None

    def _load(self, scene_id: str) -> OccupancyMap | str:
        if self.occupancy_root is None:
            return f"unknown scene id {scene_id!r} (no occupancy_root configured and no map added)"
        # A scene id is a directory name; anything that could escape the root is unknown by definition.
        if not scene_id or Path(scene_id).name != scene_id or scene_id in (".", ".."):
            return f"unknown scene id {scene_id!r} (not a plain directory name)"
        scene_dir = self.occupancy_root / scene_id
        if not scene_dir.is_dir():
            return f"unknown scene id {scene_id!r} (no directory {scene_dir})"
        try:
            occupancy = OccupancyMap.load(scene_dir)
            occupancy.clearance_m  # noqa: B018 - computed now so that every later lookup is a table read
        except OccupancyError as e:
            return f"scene {scene_id!r} unusable: {e}"
        return occupancy

    def geodesic(self, scene_id: str, goal_xy: np.ndarray) -> tuple[np.ndarray | None, str | None]:
        """``float32 [H, W]`` geodesic metres to ``goal_xy`` (inf where unreachable), or ``(None, reason)``."""
        occupancy, reason = self.get(scene_id)
        if occupancy is None:
            return None, reason
        gx, gy = (float(v) for v in np.asarray(goal_xy, dtype=np.float64).reshape(2))
        if not (np.isfinite(gx) and np.isfinite(gy)):
            return None, f"goal {[gx, gy]} is not finite"
        # Rounded to a micrometre so that float noise in recorded goals does not defeat the cache.
        key = (scene_id, round(gx, 6), round(gy, 6))
        entry = self._geodesic.get(key)
        if entry is None:
            try:
                entry = occupancy.geodesic_to((gx, gy))
            except OccupancyError as e:
                entry = f"no geodesic field: {e}"
            self._geodesic[key] = entry
            while len(self._geodesic) > self.max_geodesic_fields:
                self._geodesic.popitem(last=False)
        else:
            self._geodesic.move_to_end(key)
        if isinstance(entry, str):
            return None, entry
        return entry, None

    def num_geodesic_fields(self) -> int:
        return sum(1 for v in self._geodesic.values() if not isinstance(v, str))
