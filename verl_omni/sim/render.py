"""First-person RGB renderer: vectorized grid ray casting (2.5D) over a floor plan.

For every image column a ray leaves the camera in the horizontal plane and walks the grid cell by cell
(Amanatides-Woo traversal, exact cell boundaries, all rays of all poses advanced together in numpy). The
ray records the first furniture cell it enters and the cell where it leaves that piece, and stops at the
first wall (cells beyond the map count as wall). Each column is then painted back to front:

* ceiling above and floor below the horizon; floor pixels are projected back onto the floor plane and
  take the colour of the room they land in, with a 0.5 m checker so that motion is visible;
* the wall as a vertical span of ``wall_height_m``; faces hit on x-boundaries are drawn a little darker
  than those hit on y-boundaries, and thin vertical seams every metre give texture;
* the first furniture piece as a box of its own height and colour: its front face and, when it is lower
  than the camera, its top face up to where the ray leaves it.

Only the first furniture piece along a ray is drawn (a taller piece right behind a low one is hidden by
the wall colour); this is the usual limit of single-layer ray casting and keeps rendering cheap. Colours
are dimmed with distance, ``1 / (1 + distance_falloff * d)``.

The camera is a pinhole with square pixels: focal length ``f = (W / 2) / tan(fov / 2)`` in pixels, image
column ``c`` looks at yaw offset ``atan((W / 2 - c - 0.5) / f)`` (left of the image = counter-clockwise),
row ``r`` at height ``camera_height - (r + 0.5 - H / 2) d / f`` at perpendicular distance ``d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from verl_omni.sim.floorplan import FURNITURE_BASE, WALL, FloorPlan

WALL_RGB = (205, 195, 175)
CEILING_RGB = (235, 235, 232)


@dataclass(frozen=True)
class CameraConfig:
    """Pinhole camera on the robot.

    Attributes:
        width: Image width in pixels (even, for video encoding).
        height: Image height in pixels (even).
        fov_deg: Horizontal field of view in degrees.
        camera_height_m: Height of the optical centre above the floor.
        wall_height_m: Height of walls (and the ceiling).
        distance_falloff: Brightness falloff per metre of distance.
    """

    width: int = 64
    height: int = 64
    fov_deg: float = 90.0
    camera_height_m: float = 1.0
    wall_height_m: float = 2.5
    distance_falloff: float = 0.12

    def __post_init__(self) -> None:
        for name in ("width", "height"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 8 or v % 2:
                raise ValueError(f"CameraConfig.{name}: must be an even integer >= 8, got {v!r}")
        if not 10.0 <= self.fov_deg <= 170.0:
            raise ValueError(f"CameraConfig.fov_deg: must be in [10, 170], got {self.fov_deg}")
        if not 0.0 < self.camera_height_m < self.wall_height_m:
            raise ValueError(
                f"CameraConfig.camera_height_m: must be in (0, wall_height_m={self.wall_height_m}), "
                f"got {self.camera_height_m}"
            )
        if self.distance_falloff < 0:
            raise ValueError(f"CameraConfig.distance_falloff: must be >= 0, got {self.distance_falloff}")

    @property
    def focal_px(self) -> float:
        return (self.width / 2) / math.tan(math.radians(self.fov_deg) / 2)

    def column_angles(self) -> np.ndarray:
        """``float64 [W]`` yaw offset of each column's ray (positive = left)."""
        c = np.arange(self.width) + 0.5
        return np.arctan((self.width / 2 - c) / self.focal_px)


@dataclass
class RayHits:
    """Per-ray results of :func:`cast_rays`, all ``[N]`` (distances in metres along the ray).

    Attributes:
        wall_t: Distance to the wall hit.
        wall_side: 0 when the wall face is crossed on an x boundary (vertical grid line), 1 on a y boundary.
        wall_u: Coordinate (metres) along the wall face of the hit point, for texture.
        furn_t: Distance to the first furniture cell (inf when none before the wall).
        furn_exit_t: Distance at which the ray leaves that furniture piece.
        furn_id: Furniture index (-1 when none).
        furn_side: Boundary type of the furniture hit, as ``wall_side``.
    """

    wall_t: np.ndarray
    wall_side: np.ndarray
    wall_u: np.ndarray
    furn_t: np.ndarray
    furn_exit_t: np.ndarray
    furn_id: np.ndarray
    furn_side: np.ndarray


def cast_rays(material: np.ndarray, resolution: float, origin, xy: np.ndarray, angle: np.ndarray) -> RayHits:
    """Walks rays through the grid (exact cell traversal).

    Args:
        material: ``uint8 [H, W]`` FREE / WALL / FURNITURE_BASE + i grid.
        resolution: Metres per cell.
        origin: World ``(x, y)`` of the outer corner of cell (0, 0).
        xy: ``[N, 2]`` ray origins (world metres).
        angle: ``[N]`` ray directions (radians, counter-clockwise from +x).

    Returns:
        The hits; a ray starting inside a wall or outside the map hits at distance 0.
    """
    h, w = material.shape
    # A ring of wall cells around the map: every ray stops on it, so in-loop lookups need no bounds checks.
    padded = np.pad(material, 1, constant_values=WALL)
    gx = (np.asarray(xy[:, 0], np.float64) - origin[0]) / resolution
    gy = (np.asarray(xy[:, 1], np.float64) - origin[1]) / resolution
    dx, dy = np.cos(angle), np.sin(angle)
    n = gx.shape[0]
    col, row = np.floor(gx).astype(np.int64), np.floor(gy).astype(np.int64)
    outside = (row < 0) | (row >= h) | (col < 0) | (col >= w)
    col, row = np.where(outside, 0, col), np.where(outside, 0, row)
    step_c = np.where(dx >= 0, 1, -1)
    step_r = np.where(dy >= 0, 1, -1)
    with np.errstate(divide="ignore"):
        inv_dx = np.where(dx != 0, 1.0 / np.abs(dx), np.inf)
        inv_dy = np.where(dy != 0, 1.0 / np.abs(dy), np.inf)
    # Parametric distance (in cells) to the first vertical / horizontal grid line crossed.
    t_max_c = np.where(dx >= 0, col + 1 - gx, gx - col) * inv_dx
    t_max_r = np.where(dy >= 0, row + 1 - gy, gy - row) * inv_dy

    wall_t = np.full(n, np.inf)
    wall_side = np.zeros(n, np.int64)
    furn_t = np.full(n, np.inf)
    furn_exit_t = np.full(n, np.inf)
    furn_id = np.full(n, -1, np.int64)
    furn_side = np.zeros(n, np.int64)
    start = np.where(outside, WALL, padded[row + 1, col + 1])
    wall_t[start == WALL] = 0.0
    inside_furn = start >= FURNITURE_BASE
    furn_t[inside_furn] = 0.0
    furn_id[inside_furn] = start[inside_furn] - FURNITURE_BASE
    active = start != WALL
    # Every ray meets the out-of-map wall after at most H + W + 2 cell crossings.
    for _ in range(h + w + 2):
        if not active.any():
            break
        idx = np.nonzero(active)[0]
        along_c = t_max_c[idx] < t_max_r[idx]
        t = np.where(along_c, t_max_c[idx], t_max_r[idx])
        col[idx] += np.where(along_c, step_c[idx], 0)
        row[idx] += np.where(along_c, 0, step_r[idx])
        t_max_c[idx] += np.where(along_c, inv_dx[idx], 0.0)
        t_max_r[idx] += np.where(along_c, 0.0, inv_dy[idx])
        side = np.where(along_c, 0, 1)
        m = padded[row[idx] + 1, col[idx] + 1]
        fid = furn_id[idx]
        # Leaving the recorded furniture piece (into anything else) fixes its exit distance.
        leaving = (fid >= 0) & np.isinf(furn_exit_t[idx]) & (m != FURNITURE_BASE + fid)
        furn_exit_t[idx[leaving]] = t[leaving]
        entering = (fid < 0) & (m >= FURNITURE_BASE)
        e = idx[entering]
        furn_t[e], furn_id[e], furn_side[e] = t[entering], m[entering] - FURNITURE_BASE, side[entering]
        hit_wall = m == WALL
        hw = idx[hit_wall]
        wall_t[hw], wall_side[hw] = t[hit_wall], side[hit_wall]
        active[hw] = False
    # A ray that never met a wall (cannot happen in a bounded grid) is treated as hitting far away.
    wall_t = np.where(np.isinf(wall_t), float(h + w), wall_t)
    furn_exit_t = np.where(np.isinf(furn_exit_t) & (furn_id >= 0), wall_t, furn_exit_t)
    hx, hy = gx + dx * wall_t, gy + dy * wall_t
    wall_u = np.where(wall_side == 0, hy, hx) * resolution
    return RayHits(
        wall_t * resolution, wall_side, wall_u, furn_t * resolution, furn_exit_t * resolution, furn_id, furn_side
    )


class Renderer:
    """Renders first-person RGB views of a :class:`FloorPlan`.

    Pose-independent parts (ray offsets, floor/ceiling distances per pixel, the ceiling image and the
    textured floor colour of every cell) are computed once here; ``render`` only casts rays and looks up.

    Args:
        plan: The scene.
        camera: Camera parameters.
    """

    def __init__(self, plan: FloorPlan, camera: CameraConfig | None = None) -> None:
        self.plan = plan
        self.camera = cam = camera or CameraConfig()
        nf = len(plan.furniture)
        if nf and int(plan.material.max()) >= FURNITURE_BASE + nf:
            raise ValueError("floor plan material grid references furniture that is not in plan.furniture")
        self._furn_rgb = np.array([f.rgb for f in plan.furniture] or [(0, 0, 0)], np.float32).reshape(-1, 3)
        self._furn_h = np.array([f.height_m for f in plan.furniture] or [0.0], np.float64)
        # Floor texture per cell: the room tint (neutral grey where no room), darkened on a 0.5 m checker.
        tints = np.array([r.floor_rgb for r in plan.rooms] + [(128, 128, 128)], np.float32)
        floor = tints[np.where(plan.room_id >= 0, plan.room_id, len(plan.rooms))]
        hm, wm = plan.material.shape
        centres = plan.occupancy().grid_to_world(*np.mgrid[0:hm, 0:wm])
        checker = (np.floor(centres[..., 0] / 0.5) + np.floor(centres[..., 1] / 0.5)) % 2 == 1
        self._floor_tex = floor * np.where(checker, 0.85, 1.0).astype(np.float32)[..., None]
        hh = cam.height
        self._offsets = cam.column_angles()  # [W]
        self._cos_off = np.cos(self._offsets)
        y_low = np.arange(hh // 2, hh) + 0.5 - hh / 2  # [H/2] rows below the horizon (> 0)
        self._floor_ray_d = (cam.focal_px * cam.camera_height_m / y_low)[:, None] / self._cos_off[None, :]
        self._floor_shade = (1.0 / (1.0 + cam.distance_falloff * self._floor_ray_d)).astype(np.float32)
        y_up = hh / 2 - (np.arange(hh // 2) + 0.5)  # [H/2] rows above the horizon (> 0)
        ceil_d = (cam.focal_px * (cam.wall_height_m - cam.camera_height_m) / y_up)[:, None] / self._cos_off[None, :]
        ceil_shade = 1.0 / (1.0 + cam.distance_falloff * ceil_d)
        self._ceiling = (np.asarray(CEILING_RGB, np.float32) * ceil_shade[..., None]).astype(np.float32)
        self._pix = (np.arange(hh) + 0.5)[None, :, None]  # pixel-centre rows, [1, H, 1]

    def render(self, poses: np.ndarray) -> np.ndarray:
        """Renders views at poses.

        Args:
            poses: ``[N, 3]`` (or ``[3]``) world poses (x, y, yaw).

        Returns:
            ``uint8 [N, H, W, 3]`` (or ``[H, W, 3]``) RGB images.
        """
        poses = np.asarray(poses, np.float64)
        single = poses.ndim == 1
        poses = poses.reshape(-1, 3)
        cam, plan = self.camera, self.plan
        n, hh, ww = poses.shape[0], cam.height, cam.width
        f, ch, falloff = cam.focal_px, cam.camera_height_m, cam.distance_falloff
        angles = poses[:, 2:3] + self._offsets[None, :]  # [N, W]
        xy = np.repeat(poses[:, None, :2], ww, axis=1).reshape(-1, 2)
        hits = cast_rays(plan.material, plan.resolution, plan.origin, xy, angles.reshape(-1))
        img = np.empty((n, hh, ww, 3), np.float32)
        img[:, : hh // 2] = self._ceiling

        # Floor: the plane point seen by each lower-half pixel, coloured by the cell it falls in.
        px = poses[:, 0, None, None] + self._floor_ray_d[None] * np.cos(angles)[:, None, :]
        py = poses[:, 1, None, None] + self._floor_ray_d[None] * np.sin(angles)[:, None, :]
        hm, wm = plan.material.shape
        cols = np.clip(np.floor((px - plan.origin[0]) / plan.resolution), 0, wm - 1).astype(np.int64)
        rows = np.clip(np.floor((py - plan.origin[1]) / plan.resolution), 0, hm - 1).astype(np.int64)
        img[:, hh // 2 :] = self._floor_tex[rows, cols] * self._floor_shade[None, ..., None]

        # Walls: the span between the floor line and the top edge at perpendicular distance pd_w.
        cos_off = self._cos_off[None, :]
        pd_w = np.maximum(hits.wall_t.reshape(n, ww) * cos_off, 1e-6)  # [N, W]
        top_w = (hh / 2 - f * (cam.wall_height_m - ch) / pd_w)[:, None, :]
        bot_w = (hh / 2 + f * ch / pd_w)[:, None, :]
        in_wall = (self._pix >= top_w) & (self._pix < bot_w)  # [N, H, W]
        seam = np.mod(hits.wall_u.reshape(n, ww), 1.0) < 0.04
        shade = np.where(hits.wall_side.reshape(n, ww) == 0, 0.85, 1.0) * np.where(seam, 0.75, 1.0)
        shade = shade / (1.0 + falloff * pd_w / cos_off)
        wall_rgb = (np.asarray(WALL_RGB, np.float32) * shade[..., None].astype(np.float32))[:, None]  # [N,1,W,3]
        np.copyto(img, np.broadcast_to(wall_rgb, img.shape), where=in_wall[..., None])

        # Furniture: front face [0, h] at the entry distance; top face up to the exit distance when h < camera.
        fid = hits.furn_id.reshape(n, ww)
        has = fid >= 0
        if has.any():
            fidc = np.clip(fid, 0, None)
            fh = np.where(has, self._furn_h[fidc], 0.0)
            rgb = self._furn_rgb[fidc]  # [N, W, 3]
            pd_f = np.maximum(np.where(has, hits.furn_t.reshape(n, ww), np.inf) * cos_off, 1e-6)
            pd_fx = np.maximum(np.where(has, hits.furn_exit_t.reshape(n, ww), np.inf) * cos_off, 1e-6)
            top_f = hh / 2 - f * (fh - ch) / pd_f
            bot_f = hh / 2 + f * ch / pd_f
            top_far = hh / 2 - f * (fh - ch) / pd_fx
            in_front = has[:, None] & (self._pix >= top_f[:, None]) & (self._pix < bot_f[:, None])
            in_top = (has & (fh < ch))[:, None] & (self._pix >= top_far[:, None]) & (self._pix < top_f[:, None])
            dim = 1.0 / (1.0 + falloff * pd_f / cos_off)
            front = rgb * (np.where(hits.furn_side.reshape(n, ww) == 0, 0.85, 1.0) * dim)[..., None]
            top = rgb * np.minimum(1.15 * dim, 1.0)[..., None]
            np.copyto(img, np.broadcast_to(front[:, None].astype(np.float32), img.shape), where=in_front[..., None])
            np.copyto(img, np.broadcast_to(top[:, None].astype(np.float32), img.shape), where=in_top[..., None])

        out = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        return out[0] if single else out
