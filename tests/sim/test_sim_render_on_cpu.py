"""Ray-casting renderer against hand-computed projections (pinhole, f = 32 px for 64 px at 90 degrees)."""

import math

import numpy as np

from verl_omni.sim.floorplan import FURNITURE_BASE, WALL, FloorPlan, Furniture, Room
from verl_omni.sim.render import CEILING_RGB, WALL_RGB, CameraConfig, Renderer, cast_rays

RES = 0.05
FLOOR = (100, 120, 140)


def _box_room(furniture_rect=None) -> FloorPlan:
    """A 4 m x 5 m room (80 x 100 cells) with 0.1 m walls: free x in [0.1, 3.9), y in [0.1, 4.9)."""
    material = np.full((100, 80), WALL, np.uint8)
    material[2:98, 2:78] = 0
    room_id = np.full(material.shape, -1, np.int16)
    room_id[2:98, 2:78] = 0
    furniture = []
    if furniture_rect is not None:
        r0, r1, c0, c1 = furniture_rect
        material[r0:r1, c0:c1] = FURNITURE_BASE
        furniture.append(Furniture(0, "table", "red", (200, 40, 40), 0.75, furniture_rect, 0))
    return FloorPlan(material, room_id, [Room(0, "office", (2, 98, 2, 78), FLOOR)], furniture, [], RES)


def test_cast_rays_distances():
    plan = _box_room()
    # From (1.9, 2.5): east wall face at x = 3.9 (2.0 m), north face y = 4.9 (2.4 m), diagonal to the corner.
    xy = np.array([[1.9, 2.5]] * 3)
    ang = np.array([0.0, math.pi / 2, math.atan2(2.4, 2.0)])
    hits = cast_rays(plan.material, RES, (0.0, 0.0), xy, ang)
    np.testing.assert_allclose(hits.wall_t, [2.0, 2.4, math.hypot(2.0, 2.4)], atol=1e-9)
    assert hits.wall_side.tolist()[:2] == [0, 1]
    assert (hits.furn_id == -1).all()


def test_wall_colour_and_extent_when_facing_a_wall():
    plan = _box_room()
    cam = CameraConfig(width=64, height=64, fov_deg=90.0, camera_height_m=1.0, wall_height_m=2.5)
    img = Renderer(plan, cam).render(np.array([1.9, 2.5, 0.0]))  # facing +x, wall face 2.0 m ahead
    assert img.shape == (64, 64, 3)
    f, d = 32.0, 2.0
    top, bottom = 32 - f * (2.5 - 1.0) / d, 32 + f * 1.0 / d  # rows 8 .. 48 (pixel centres r + 0.5)
    assert (top, bottom) == (8.0, 48.0)
    for c in (31, 32):  # the two centre columns
        off = math.atan((32 - c - 0.5) / f)
        # Faces crossed on an x boundary are drawn at 0.85; distance falloff 0.12 per metre along the ray.
        expected = np.array(WALL_RGB) * 0.85 / (1 + 0.12 * d / math.cos(off))
        for r in range(8, 48):
            np.testing.assert_allclose(img[r, c], expected, atol=1.0)
        assert not np.allclose(img[7, c], expected, atol=3)  # ceiling above the top edge
        ceil_d = f * 1.5 / (32 - 7.5) / math.cos(off)
        np.testing.assert_allclose(img[7, c], np.array(CEILING_RGB) / (1 + 0.12 * ceil_d), atol=1.0)
        # Floor below the bottom edge: room tint (the checker may darken it by 0.85).
        floor_d = f * 1.0 / (48.5 - 32) / math.cos(off)
        shade = 1 / (1 + 0.12 * floor_d)
        row48 = img[48, c].astype(float)
        assert any(np.allclose(row48, np.array(FLOOR) * k * shade, atol=1.0) for k in (1.0, 0.85)), row48


def test_furniture_front_and_top_faces():
    # Red box 0.75 m high covering x in [2.9, 3.4), y in [2.0, 3.0): front face 1.0 m ahead of (1.9, 2.5).
    plan = _box_room(furniture_rect=(40, 60, 58, 68))
    img = Renderer(plan, CameraConfig()).render(np.array([1.9, 2.5, 0.0]))
    f = 32.0
    front_top = 32 - f * (0.75 - 1.0) / 1.0  # 40: front face rows 40 .. 63
    top_far = 32 - f * (0.75 - 1.0) / 1.5  # 37.33: the box top is seen up to its far edge 1.5 m away
    assert front_top == 40.0
    c = 31
    cos = math.cos(math.atan(0.5 / f))
    front = np.array((200, 40, 40)) * 0.85 / (1 + 0.12 * 1.0 / cos)
    for r in range(40, 64):
        np.testing.assert_allclose(img[r, c], front, atol=1.0)
    top = np.array((200, 40, 40)) * min(1.15 / (1 + 0.12 * 1.0 / cos), 1.0)
    for r in range(math.ceil(top_far - 0.5), 40):  # rows 37, 38, 39
        np.testing.assert_allclose(img[r, c], top, atol=1.0)
    # Above the box the wall 2.0 m away is visible again.
    wall = np.array(WALL_RGB) * 0.85 / (1 + 0.12 * 2.0 / cos)
    np.testing.assert_allclose(img[20, c], wall, atol=1.0)


def test_batch_matches_single_and_views_differ():
    plan = _box_room(furniture_rect=(40, 60, 58, 68))
    r = Renderer(plan, CameraConfig(width=32, height=24, fov_deg=70))
    poses = np.array([[1.0, 1.0, 0.3], [2.0, 4.0, -2.0], [3.5, 1.0, 2.5]])
    batch = r.render(poses)
    assert batch.shape == (3, 24, 32, 3)
    for i in range(3):
        np.testing.assert_array_equal(batch[i], r.render(poses[i]))
    assert np.abs(batch[0].astype(int) - batch[1]).mean() > 5


def test_goal_object_in_view_by_hand():
    from verl_omni.sim.search_expert import goal_object_in_view

    # A table at x in [2.8, 3.0), y in [2.4, 2.6): from (1.9, 2.5) it is 0.9-1.1 m east, spanning +-6 degrees.
    plan = _box_room((48, 52, 56, 60))
    assert goal_object_in_view(plan, np.array([1.9, 2.5, 0.0]), 0) == 0.0  # dead ahead: columns symmetric about 0
    # Turned 0.3 rad left, the table appears 0.3 rad to the right (negative), within one column (~1.8 degrees).
    assert math.isclose(goal_object_in_view(plan, np.array([1.9, 2.5, 0.3]), 0), -0.3, abs_tol=0.03)
    assert goal_object_in_view(plan, np.array([1.9, 2.5, math.pi]), 0) is None  # behind the robot
    assert goal_object_in_view(plan, np.array([1.9, 2.5, math.pi / 2]), 0) is None  # 90 degrees right, fov 90
