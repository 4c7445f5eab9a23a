"""OccupancyMap: I/O, transforms, clearance, geodesic distance and collision, against hand-worked values."""

import json
import math

import numpy as np
import pytest

from verl_omni.data.occupancy import OccupancyError, OccupancyMap


def _room(h=10, w=10, res=0.1, origin=(0.0, 0.0)):
    occ = np.zeros((h, w), bool)
    occ[0, :] = occ[-1, :] = occ[:, 0] = occ[:, -1] = True
    return OccupancyMap.from_grid(occ, res, origin, scene_id="room")


def test_world_grid_round_trip_and_conventions():
    m = _room(origin=(-1.0, 2.0))
    # Cell (row=3, col=4) covers x in [-0.6, -0.5), y in [2.3, 2.4): its centre is (-0.55, 2.35).
    np.testing.assert_allclose(m.grid_to_world(3, 4), [-0.55, 2.35])
    rows, cols = m.world_to_grid(np.array([[-0.55, 2.35], [-1.0, 2.0], [-0.5001, 2.3999]]))
    assert rows.tolist() == [3, 0, 3] and cols.tolist() == [4, 0, 4]
    rr, cc = np.mgrid[0:10, 0:10]
    r2, c2 = m.world_to_grid(m.grid_to_world(rr, cc))
    assert (r2 == rr).all() and (c2 == cc).all()
    assert m.in_bounds(np.array([[-1.0, 2.0], [-0.01, 2.99], [0.0, 2.5], [-0.5, np.nan]])).tolist() == [
        True,
        True,
        False,
        False,
    ]


def test_clearance_of_known_grid():
    # 1 x 7 corridor of free cells between walls: column c has EDT distance min(c, 6 - c) cells from the walls
    # at columns 0 and 6 (and the border rows above/below are walls too).
    occ = np.ones((3, 7), bool)
    occ[1, 1:6] = False
    m = OccupancyMap.from_grid(occ, 0.5)
    # Free cells at row 1: distance to nearest blocked centre is 1 cell (rows 0/2) = 0.5 m, minus half a cell.
    np.testing.assert_allclose(m.clearance_m[1, 1:6], [0.25] * 5)
    assert (m.clearance_m[occ] == 0).all()
    # 11x11 room with a wall ring: the centre cell (5, 5) is 5 cells from the ring -> 5*0.1 - 0.05 = 0.45 m.
    m2 = _room(11, 11, 0.1)
    assert m2.clearance_m[5, 5] == pytest.approx(0.45, abs=1e-6)  # 5 cells from the wall ring at index 0 / 10
    assert m2.clearance_m[1, 1] == pytest.approx(0.05, abs=1e-6)
    assert m2.clearance_at(np.array([100.0, 100.0])) == 0.0


def test_geodesic_distance_around_a_wall():
    # 5 x 7 free grid (no outer walls), resolution 1 m; a wall in column 3 from row 0 to row 3 leaves a gap at row 4.
    occ = np.zeros((5, 7), bool)
    occ[0:4, 3] = True
    m = OccupancyMap.from_grid(occ, 1.0)
    goal = m.grid_to_world(0, 6)
    g = m.geodesic_to(goal)
    assert g[0, 6] == 0.0
    assert math.isinf(g[0, 3])
    # From (0, 0) to (0, 6): down the left side to (3, 2) area, through the gap at (4, 3), up to the goal.
    # No corner cutting next to the wall end (3, 3): path (0,0)->(3,0)... shortest with diagonals:
    # (0,0)->(3,2) needs 3 rows/2 cols: 2 diagonals + 1 straight = 2*sqrt2 + 1; (3,2)->(4,3) diagonal is
    # forbidden (side cell (3,3) is wall), so (3,2)->(4,2)->(4,3): 2; (4,3)->(3,4) forbidden likewise:
    # (4,3)->(4,4): 1; (4,4)->(0,6): 4 rows/2 cols: 2 diagonals + 2 straight.
    expected = (2 * math.sqrt(2) + 1) + 2 + 1 + (2 * math.sqrt(2) + 2)
    assert g[0, 0] == pytest.approx(expected, rel=1e-6)
    assert m.geodesic_at(goal, m.grid_to_world(0, 0)) == pytest.approx(expected, rel=1e-6)
    assert math.isinf(m.geodesic_at(goal, np.array([-5.0, -5.0])))
    # Cached: asking again returns the same object, no recomputation.
    assert m.geodesic_to(goal) is g and m.num_cached_goals() == 1


def test_unreachable_and_bad_goal():
    occ = np.zeros((5, 5), bool)
    occ[:, 2] = True
    m = OccupancyMap.from_grid(occ, 1.0)
    g = m.geodesic_to(m.grid_to_world(0, 0))
    assert math.isinf(g[0, 4])
    with pytest.raises(OccupancyError, match="goal"):
        m.geodesic_to(np.array([50.0, 50.0]))


def test_disc_and_segment_collision():
    m = _room(20, 20, 0.1)  # walls on the border ring; interior x, y in [0.1, 1.9]
    assert not m.disc_collides(np.array([1.0, 1.0]), 0.3)
    assert m.disc_collides(np.array([0.25, 1.0]), 0.2)  # 0.15 m from the wall face at x = 0.1
    hit, frac = m.segment_collides(np.array([[1.0, 1.0], [1.0, 1.0]]), np.array([[1.5, 1.0], [0.0, 1.0]]), 0.2, 100)
    assert hit.tolist() == [False, True]
    # Moving left from x=1.0 the disc (r=0.2) touches the wall face (x=0.1) once x < 0.3 (clearance is measured
    # from cell centres, so contact is detected within half a cell): fraction ~ 0.7 of the 1 m segment.
    assert frac[0] == 1.0 and 0.65 <= frac[1] <= 0.75


def test_save_load_round_trip_and_errors(tmp_path):
    m = _room(origin=(1.5, -2.0))
    m.state[4, 4] = 128
    m.save(tmp_path / "s1")
    m2 = OccupancyMap.load(tmp_path / "s1")
    assert (m2.state == m.state).all() and m2.resolution == m.resolution and m2.origin == m.origin
    assert not m2.free[4, 4]
    meta = json.loads((tmp_path / "s1" / "occupancy.json").read_text())
    del meta["resolution"]
    (tmp_path / "s1" / "occupancy.json").write_text(json.dumps(meta))
    with pytest.raises(OccupancyError, match="resolution"):
        OccupancyMap.load(tmp_path / "s1")
    with pytest.raises(OccupancyError, match="missing occupancy file"):
        OccupancyMap.load(tmp_path / "nope")
    with pytest.raises(OccupancyError, match="resolution"):
        OccupancyMap.from_grid(np.zeros((4, 4), bool), -1.0)


def test_geodesic_to_nearest_of_several_points_around_a_wall():
    # The grid of test_geodesic_distance_around_a_wall: 5 x 7, 1 m cells, wall in column 3 over rows 0-3.
    occ = np.zeros((5, 7), bool)
    occ[0:4, 3] = True
    m = OccupancyMap.from_grid(occ, 1.0)
    points = np.stack([m.grid_to_world(0, 6), m.grid_to_world(0, 0)])  # index 0 right of the wall, 1 left of it
    dist, which = m.geodesic_to_nearest(points)
    # By hand: (0, 1) is 1 m from point 1 and far from point 0 (around the wall); (0, 5) is 1 m from point 0.
    assert dist[0, 1] == pytest.approx(1.0) and which[0, 1] == 1
    assert dist[0, 5] == pytest.approx(1.0) and which[0, 5] == 0
    # (4, 3), the gap: to point 1 it is (3,0)->... = the left half of the hand path, 2*sqrt2 + 1 + 2 - ... computed
    # directly: (0,0)->(3,2): 2*sqrt2 + 1; (3,2)->(4,2)->(4,3): 2 = 3 + 2*sqrt2 (about 5.83); to point 0:
    # (0,6)->(4,4): 2*sqrt2 + 2, (4,4)->(4,3): 1 = 3 + 2*sqrt2 as well: a tie, which goes to the lower index.
    assert dist[4, 3] == pytest.approx(3 + 2 * math.sqrt(2), rel=1e-6)
    assert which[4, 3] in (0, 1)
    assert math.isinf(dist[0, 3]) and which[0, 3] == -1
    with pytest.raises(OccupancyError, match="not free"):
        m.geodesic_to_nearest(np.stack([m.grid_to_world(0, 3)]))
