"""Expert planner: geodesic descent on an inflated grid, string-pulled, turned into fixed-step poses.

1. Inflation. Planning runs on the occupancy grid with every cell closer than ``robot_radius + margin``
   to an obstacle blocked, so the path keeps a safety margin. A start inside that band (a policy that
   drifted close to a wall) first follows the field of a thinner inflation (``robot_radius`` plus one
   cell) until it reaches the wide-margin free space. A start inside even that band but not in collision
   (a robot pressed against a wall: its disc clears the wall by less than one cell) first escapes over
   collision-free cells to the nearest cell with the full margin (at most ``escape_distance_m`` away), so
   the expert can label the contact states a learner drives into.
2. Descent. :meth:`OccupancyMap.geodesic_to` (8-connected Dijkstra) gives the distance-to-goal field;
   from the start cell the path repeatedly moves to the neighbour with the smallest value, which always
   decreases along the Dijkstra tree, until the goal cell.
3. Smoothing. Greedy string pulling: from each anchor, jump to the farthest later path point whose
   straight segment keeps a disc of ``robot_radius + margin`` clear (``OccupancyMap.segment_collides``;
   an anchor already closer to an obstacle uses its own clearance, never less than ``robot_radius``),
   removing the grid's zig-zag so the length approaches the true shortest path.
4. Poses. The polyline is walked in steps of ``step_length``; the robot turns at most ``max_turn_rad``
   per step, rotating in place first where the next leg needs a larger turn; each motion is straight
   ahead in the robot frame (``dy = 0``). The last move ends exactly at the goal, then STOP.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from verl_omni.data.actions import wrap_angle
from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap

_NEIGHBOURS = np.array([(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)], np.int64)


class PlanningError(ValueError):
    """No collision-free path exists from the start to the goal."""


@dataclass(frozen=True)
class PlannerConfig:
    """Expert planner parameters.

    Attributes:
        robot_radius: Disc radius of the robot (metres).
        clearance_margin: Extra clearance the planned path keeps where it can (metres).
        step_length: Distance travelled per motion step (metres).
        max_turn_rad: Largest yaw change per step.
        stop_distance: The expert stops when the remaining geodesic distance is at most this (metres).
        samples_per_metre: Collision samples along segments during smoothing.
        escape_distance_m: Longest escape (metres) from a start the thin field does not reach (a collision-free
            pose within one cell of the robot radius from an obstacle) back to the margin; 0: no escape, such
            starts cannot be planned from (the behaviour before escapes existed).
    """

    robot_radius: float = ROBOT_RADIUS_M
    clearance_margin: float = 0.15
    step_length: float = 0.25
    max_turn_rad: float = math.pi / 6
    stop_distance: float = 0.25
    samples_per_metre: float = 40.0
    escape_distance_m: float = 0.5

    def __post_init__(self) -> None:
        for name in ("robot_radius", "step_length", "max_turn_rad", "samples_per_metre"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlannerConfig.{name}: must be > 0, got {getattr(self, name)}")
        for name in ("clearance_margin", "stop_distance", "escape_distance_m"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PlannerConfig.{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_turn_rad > math.pi:
            raise ValueError(f"PlannerConfig.max_turn_rad: must be <= pi, got {self.max_turn_rad}")


def resample_polyline(points: np.ndarray, step: float) -> np.ndarray:
    """Points every ``step`` metres of arc length along a polyline, always ending at its last point.

    Args:
        points: ``[K, 2]`` polyline vertices, K >= 1.
        step: Spacing in metres (> 0).

    Returns:
        ``[M, 2]`` points; the first is ``points[0]``, the last ``points[-1]``; all gaps equal ``step`` (as
        arc length) except the final one, which is in ``(0, step]``.
    """
    points = np.asarray(points, np.float64).reshape(-1, 2)
    seg = np.linalg.norm(np.diff(points, axis=0), axis=1)
    cum = np.concatenate([[0.0], np.cumsum(seg)])
    total = cum[-1]
    if total <= 1e-12:
        return points[:1].copy()
    s = np.arange(0.0, total, step)
    if total - s[-1] < 1e-9:  # the last sample already sits at the end
        s = s[:-1]
    s = np.concatenate([s, [total]])
    x = np.interp(s, cum, points[:, 0])
    y = np.interp(s, cum, points[:, 1])
    return np.stack([x, y], axis=1)


def poses_along(points: np.ndarray, start_yaw: float, max_turn: float) -> np.ndarray:
    """Turns a sequence of positions into poses with bounded turning and straight-ahead motion.

    Each leg ``points[k] -> points[k+1]`` is driven straight ahead, so before it the robot rotates in place
    (steps of at most ``max_turn``) until it faces the leg. :func:`merge_turns` afterwards folds a single
    small rotation into the move before it.

    Args:
        points: ``[M, 2]`` positions (consecutive duplicates are not allowed).
        start_yaw: Heading at ``points[0]``.
        max_turn: Largest yaw change per pose step (radians).

    Returns:
        ``[P, 3]`` poses, P >= M; the first is ``(points[0], start_yaw)``.
    """
    points = np.asarray(points, np.float64).reshape(-1, 2)
    out = [(points[0, 0], points[0, 1], float(wrap_angle(start_yaw)))]
    yaw = out[0][2]
    for k in range(len(points) - 1):
        d = points[k + 1] - points[k]
        heading = math.atan2(d[1], d[0])
        err = float(wrap_angle(heading - yaw))
        while abs(err) > 1e-9:
            yaw = float(wrap_angle(yaw + np.clip(err, -max_turn, max_turn)))
            out.append((points[k, 0], points[k, 1], yaw))
            err = float(wrap_angle(heading - yaw))
        yaw = heading  # remove rounding left by the wrapped additions
        out.append((points[k + 1, 0], points[k + 1, 1], yaw))
    return np.asarray(out, np.float64)


def face_turns(pose: np.ndarray, face_xy: np.ndarray, max_turn: float) -> np.ndarray:
    """In-place turns from ``pose`` toward ``face_xy``: ``[T, 3]`` poses after each step (``T = 0`` when the point
    is already within ``max_turn / 2`` of straight ahead); each step turns at most ``max_turn``."""
    pose = np.asarray(pose, np.float64).reshape(3)
    target = math.atan2(float(face_xy[1] - pose[1]), float(face_xy[0] - pose[0]))
    out, yaw = [], float(pose[2])
    err = float(wrap_angle(target - yaw))
    while abs(err) > max_turn / 2:
        yaw = float(wrap_angle(yaw + np.clip(err, -max_turn, max_turn)))
        out.append((pose[0], pose[1], yaw))
        err = float(wrap_angle(target - yaw))
    return np.asarray(out, np.float64).reshape(-1, 3)


def merge_turns(poses: np.ndarray, max_turn: float) -> np.ndarray:
    """Folds an in-place rotation into the preceding straight move when it fits in one turn.

    ``poses_along`` produces "move, then rotate" pairs; a rotation of at most ``max_turn`` right after a move
    can happen during that move's step instead (the move stays straight in the previous pose's frame), which
    is how a real robot corners. Rotations that follow a rotation, or larger ones, are kept.

    Args:
        poses: ``[P, 3]`` poses.
        max_turn: Largest yaw change per step.

    Returns:
        ``[P', 3]`` poses with ``P' <= P``.
    """
    poses = np.asarray(poses, np.float64)
    keep = [poses[0]]
    i = 1
    while i < len(poses):
        cur = poses[i]
        moved = np.hypot(*(cur[:2] - keep[-1][:2])) > 1e-12
        if moved and i + 1 < len(poses):
            nxt = poses[i + 1]
            rotate_only = np.hypot(*(nxt[:2] - cur[:2])) <= 1e-12
            if rotate_only and abs(float(wrap_angle(nxt[2] - keep[-1][2]))) <= max_turn + 1e-9:
                keep.append(nxt)  # move and turn in one step
                i += 2
                continue
        keep.append(cur)
        i += 1
    return np.asarray(keep)


class ExpertPlanner:
    """Plans expert paths to one goal in one scene; fields are computed once per planner.

    Args:
        occupancy: The scene.
        goal_xy: ``[2]`` goal position (metres).
        config: Planner parameters.

    Raises:
        PlanningError: the goal is not in free space reachable by the robot.
    """

    def __init__(
        self,
        occupancy: OccupancyMap,
        goal_xy,
        config: PlannerConfig | None = None,
        _inflated: tuple[OccupancyMap, OccupancyMap] | None = None,
    ) -> None:
        self.occ = occupancy
        self.cfg = config or PlannerConfig()
        self.goal = np.asarray(goal_xy, np.float64).reshape(2)
        r = self.cfg.robot_radius
        wide_r = r + self.cfg.clearance_margin
        if _inflated is None:
            clear = occupancy.clearance_m
            thin_r = r + occupancy.resolution
            _inflated = (
                OccupancyMap.from_grid(clear < wide_r, occupancy.resolution, occupancy.origin, occupancy.scene_id),
                OccupancyMap.from_grid(clear < thin_r, occupancy.resolution, occupancy.origin, occupancy.scene_id),
            )
        self._wide, self._thin = _inflated
        if not bool(occupancy.in_bounds(self.goal)) or float(occupancy.clearance_at(self.goal)) < wide_r:
            raise PlanningError(
                f"scene {occupancy.scene_id!r}: goal {self.goal.tolist()} needs a clearance of at least {wide_r:.2f} m"
            )
        self._field_wide = self._wide.geodesic_to(self.goal)
        self._field_thin = self._thin.geodesic_to(self.goal)

    def retarget(self, goal_xy) -> ExpertPlanner:
        """A planner for another goal in the same scene, sharing the inflated maps (and their graphs)."""
        return ExpertPlanner(self.occ, goal_xy, self.cfg, _inflated=(self._wide, self._thin))

    def distance(self, xy: np.ndarray) -> np.ndarray:
        """Geodesic distance (metres) to the goal on the un-inflated map at points ``[..., 2]``."""
        return self.occ.geodesic_at(self.goal, xy)

    def reachable(self, xy: np.ndarray) -> np.ndarray:
        """``bool [...]``: the thin field reaches these points (start sampling uses this, without escapes)."""
        rows, cols = self.occ.world_to_grid(xy)
        h, w = self.occ.shape
        inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
        rr, cc = np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)
        return inside & np.isfinite(self._field_thin[rr, cc])

    def labelable(self, xy: np.ndarray) -> np.ndarray:
        """``bool [N]``: the expert can plan from these points ``[N, 2]``, escapes included.

        A point the thin field reaches is labelable; so is a collision-free point within one cell of the
        robot radius from an obstacle whose escape (:meth:`escape_cells`) exists.
        """
        xy = np.asarray(xy, np.float64).reshape(-1, 2)
        ok = self.reachable(xy)
        for i in np.nonzero(~ok)[0]:
            r, c = (int(v) for v in self.occ.world_to_grid(xy[i]))
            ok[i] = self.escape_cells(r, c) is not None
        return ok

    def escape_cells(self, row: int, col: int) -> list[tuple[int, int]] | None:
        """Shortest walk from a cell the thin field does not reach back to the margin the expert keeps.

        Dijkstra over 8-connected collision-free cells (clearance at least ``robot_radius``, the evaluator's
        collision rule; a diagonal move needs both cells beside it free too, so the swept disc never cuts a
        corner) to the nearest cell of the wide field (``robot_radius + clearance_margin`` clear), or, when
        none lies within ``escape_distance_m``, to the nearest cell of the thin field. Backing off to the wide
        margin first is what keeps the expert's way out of a contact off the wall: descending the thin field
        from the wall would follow it at one cell of clearance. Written here rather than with
        ``OccupancyMap.geodesic_to`` because the target is a set of cells and the search stays within a few
        cells of the start.

        Args:
            row / col: Start cell.

        Returns:
            Cells from the start (first) to the escape's end (last); ``[(row, col)]`` when the thin field
            reaches the start; ``None`` when the start is out of the map, in collision, or no thin-field cell
            lies within ``escape_distance_m``.
        """
        h, w = self.occ.shape
        if not (0 <= row < h and 0 <= col < w):
            return None
        if np.isfinite(self._field_thin[row, col]):
            return [(row, col)]
        free = self.occ.clearance_m >= self.cfg.robot_radius
        if not free[row, col] or self.cfg.escape_distance_m <= 0:
            return None
        res = self.occ.resolution
        best = {(row, col): 0.0}
        parent: dict[tuple[int, int], tuple[int, int]] = {}
        heap = [(0.0, row, col)]
        fallback = None

        def walk(end: tuple[int, int]) -> list[tuple[int, int]]:
            cells = [end]
            while cells[-1] != (row, col):
                cells.append(parent[cells[-1]])
            return cells[::-1]

        while heap:
            d, r, c = heapq.heappop(heap)
            if d > best[(r, c)]:
                continue
            if np.isfinite(self._field_wide[r, c]):
                return walk((r, c))
            if fallback is None and np.isfinite(self._field_thin[r, c]):
                fallback = (r, c)
            for dr, dc in _NEIGHBOURS:
                nr, nc = r + int(dr), c + int(dc)
                if not (0 <= nr < h and 0 <= nc < w) or not free[nr, nc]:
                    continue
                if dr and dc and not (free[r + dr, c] and free[r, c + dc]):
                    continue
                nd = d + res * math.hypot(dr, dc)
                if nd <= self.cfg.escape_distance_m + 1e-9 and nd < best.get((nr, nc), math.inf):
                    best[(nr, nc)] = nd
                    parent[(nr, nc)] = (r, c)
                    heapq.heappush(heap, (nd, nr, nc))
        return None if fallback is None else walk(fallback)

    def grid_path(self, start_xy: np.ndarray, max_length_m: float = math.inf) -> np.ndarray:
        """Descends the geodesic field from the start cell; returns cell centres ``[K, 2]`` (metres).

        A start the thin field does not reach first takes its escape (:meth:`escape_cells`). Stops at the goal
        cell or after ``max_length_m`` of path (enough for a bounded-horizon continuation).

        Raises:
            PlanningError: the start cell cannot reach the goal.
        """
        r, c = (int(v) for v in self.occ.world_to_grid(np.asarray(start_xy, np.float64)))
        escape = self.escape_cells(r, c)
        if escape is None:
            raise PlanningError(
                f"scene {self.occ.scene_id!r}: no collision-free path from {list(start_xy)} to the goal"
            )
        h, w = self.occ.shape
        res = self.occ.resolution
        cells = list(escape)
        length = sum(res * math.hypot(a[0] - b[0], a[1] - b[1]) for a, b in zip(cells, cells[1:]))
        r, c = cells[-1]
        while True:
            fields = self._field_wide if np.isfinite(self._field_wide[r, c]) else self._field_thin
            here = fields[r, c]
            if here == 0.0 or length >= max_length_m:
                break
            nr, nc = r + _NEIGHBOURS[:, 0], c + _NEIGHBOURS[:, 1]
            ok = (nr >= 0) & (nr < h) & (nc >= 0) & (nc < w)
            vals = np.full(8, np.inf)
            vals[ok] = fields[nr[ok], nc[ok]]
            k = int(np.argmin(vals))
            if not vals[k] < here:
                raise PlanningError(f"scene {self.occ.scene_id!r}: geodesic descent stalled at cell {(r, c)}")
            length += res * math.hypot(*_NEIGHBOURS[k])
            r, c = int(nr[k]), int(nc[k])
            cells.append((r, c))
        arr = np.asarray(cells)
        return self.occ.grid_to_world(arr[:, 0], arr[:, 1])

    def path(self, start_xy: np.ndarray, max_length_m: float = math.inf) -> np.ndarray:
        """Smoothed collision-free polyline ``[K, 2]`` from the start point to the goal (or ``max_length_m``).

        The first vertex is the exact start point; when the whole path was planned the last vertex is the
        exact goal point.
        """
        start_xy = np.asarray(start_xy, np.float64).reshape(2)
        cells = self.grid_path(start_xy, max_length_m)
        reached = bool(np.all(self.occ.world_to_grid(cells[-1]) == self.occ.world_to_grid(self.goal)))
        pts = np.concatenate([start_xy[None], cells[1:]], axis=0) if len(cells) > 1 else start_xy[None]
        if reached:
            pts = np.concatenate([pts, self.goal[None]], axis=0)
        # Drop consecutive duplicates (start may coincide with its cell centre, goal with the last centre).
        keep = np.concatenate([[True], np.linalg.norm(np.diff(pts, axis=0), axis=1) > 1e-9])
        return self._string_pull(pts[keep])

    def _string_pull(self, pts: np.ndarray) -> np.ndarray:
        wide = self.cfg.robot_radius + self.cfg.clearance_margin
        # An anchor closer to obstacles than the wide margin (a drifted start) may shortcut at its own
        # clearance level: the path never gets closer to obstacles than the robot already is.
        anchor_r = np.clip(self.occ.clearance_at(pts) - self.occ.resolution, self.cfg.robot_radius, wide)
        out = [0]
        i = 0
        n = len(pts)
        while i < n - 1:
            cand = np.arange(i + 1, n)
            hit, _ = self.occ.segment_collides(
                np.repeat(pts[i : i + 1], len(cand), 0), pts[cand], float(anchor_r[i]), self.cfg.samples_per_metre
            )
            clear = cand[~hit]
            # The next grid neighbour is always acceptable (it was on the descent path).
            j = max(int(clear.max()) if clear.size else i + 1, i + 1)
            out.append(j)
            i = j
        return pts[out]

    def continuation(
        self, start_pose: np.ndarray, horizon: int = 32, face_xy: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Expert reference from a pose: ``horizon`` steps of poses and stop flags.

        Args:
            start_pose: ``[3]`` current pose.
            horizon: Number of action steps.
            face_xy: Optional ``[2]`` point to face before the STOP: at the goal the expert turns in place (steps
                of at most ``max_turn_rad``) until the point is within half a turn step of straight ahead.

        Returns:
            ``poses [horizon + 1, 3]`` (entry 0 is ``start_pose``) and ``stop int64 [horizon]``. After the
            expert stops, poses repeat the final pose and stop flags stay 1 (``docs/contracts.md``).
        """
        poses = self.trajectory(start_pose, max_steps=horizon)
        if face_xy is not None and float(self.distance(poses[-1, :2])) <= self.cfg.stop_distance + 1e-9:
            poses = np.concatenate([poses, face_turns(poses[-1], face_xy, self.cfg.max_turn_rad)])[: horizon + 1]
        moves = len(poses) - 1
        out = np.repeat(poses[-1:], horizon + 1, axis=0)
        out[: moves + 1] = poses
        stop = np.zeros(horizon, np.int64)
        at_goal = moves < horizon and float(self.distance(poses[-1, :2])) <= self.cfg.stop_distance + 1e-9
        if at_goal:
            stop[moves:] = 1
        return out, stop

    def trajectory(self, start_pose: np.ndarray, max_steps: int | None = None) -> np.ndarray:
        """Expert poses from a pose until the goal (or ``max_steps`` steps), ``[P, 3]``, without the STOP."""
        start_pose = np.asarray(start_pose, np.float64).reshape(3)
        if float(self.distance(start_pose[:2])) <= self.cfg.stop_distance:
            return start_pose[None].copy()
        budget = math.inf if max_steps is None else (max_steps + 2) * self.cfg.step_length + 1.0
        pts = resample_polyline(self.path(start_pose[:2], max_length_m=budget), self.cfg.step_length)
        poses = merge_turns(poses_along(pts, start_pose[2], self.cfg.max_turn_rad), self.cfg.max_turn_rad)
        poses[0] = start_pose
        if max_steps is not None:
            poses = poses[: max_steps + 1]
        return poses
