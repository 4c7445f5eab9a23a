"""Floor-plan generator: reproducibility, connectivity through doors, furniture placement, scene files."""

import numpy as np
import pytest
from scipy.ndimage import label

from verl_omni.data.occupancy import OccupancyMap
from verl_omni.sim.floorplan import (
    FREE,
    FURNITURE_BASE,
    HALLWAY,
    WALL,
    FloorPlan,
    FloorPlanConfig,
    FloorPlanError,
    generate_floor_plan,
)


def _plan(seed: int, **kw) -> FloorPlan:
    return generate_floor_plan(FloorPlanConfig(**kw), np.random.default_rng(seed), scene_id=f"p{seed}")


def test_same_seed_same_plan_and_seeds_differ():
    a, b, c = _plan(11), _plan(11), _plan(12)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_array_equal(a.room_id, b.room_id)
    assert [f.name for f in a.furniture] == [f.name for f in b.furniture]
    assert not np.array_equal(a.material, c.material)


@pytest.mark.parametrize("seed", range(6))
def test_structure_and_connectivity(seed):
    cfg = FloorPlanConfig()
    plan = _plan(seed)
    h, w = plan.material.shape
    assert (h, w) == (120, 160)  # 6 m x 8 m at 0.05 m
    # Outer walls are closed.
    for edge in (plan.material[:2], plan.material[-2:], plan.material[:, :2], plan.material[:, -2:]):
        assert (edge == WALL).all()
    assert 1 <= len(plan.rooms) <= cfg.max_rooms
    assert len(plan.doors) == len(plan.rooms) - 1  # a tree of rooms: one door per partition wall
    assert sum(r.kind == HALLWAY for r in plan.rooms) <= 1
    # Every furniture piece lies inside its room and has its own label.
    for f in plan.furniture:
        r0, r1, c0, c1 = f.rect
        room = plan.rooms[f.room]
        assert room.rect[0] <= r0 < r1 <= room.rect[1] and room.rect[2] <= c0 < c1 <= room.rect[3]
        assert (plan.material[r0:r1, c0:c1] == FURNITURE_BASE + f.index).all()
    # Independent connectivity check: cells where a 0.2 m disc (+ one cell) fits form one component touching
    # every door, using a float64 distance transform recomputed here.
    from scipy.ndimage import distance_transform_edt

    free = plan.material == FREE
    edt = distance_transform_edt(np.pad(free, 1))[1:-1, 1:-1] * cfg.resolution - cfg.resolution / 2
    labels, _ = label(edt >= cfg.robot_radius + cfg.resolution, structure=np.ones((3, 3)))
    door_comps = set()
    for d in plan.doors:
        vals = labels[d.rect[0] : d.rect[1], d.rect[2] : d.rect[3]]
        door_comps |= set(np.unique(vals[vals > 0]).tolist())
    assert len(door_comps) <= 1


def test_save_load_round_trip(tmp_path):
    plan = _plan(3)
    plan.save(tmp_path / "p3")
    occ = OccupancyMap.load(tmp_path / "p3")
    np.testing.assert_array_equal(~occ.free, plan.material != FREE)
    back = FloorPlan.load(tmp_path / "p3")
    np.testing.assert_array_equal(back.material, plan.material)
    np.testing.assert_array_equal(back.room_id, plan.room_id)
    assert back.rooms == plan.rooms and back.furniture == plan.furniture and back.doors == plan.doors
    (tmp_path / "p3" / "semantics.json").unlink()
    with pytest.raises(FloorPlanError, match="semantics.json"):
        FloorPlan.load(tmp_path / "p3")


def test_impossible_parameters_name_the_field():
    with pytest.raises(FloorPlanError, match="size_m"):
        FloorPlanConfig(size_m=(0.5, 0.5))
    with pytest.raises(FloorPlanError, match="door_width_m"):
        FloorPlanConfig(door_width_m=0.3)
    with pytest.raises(FloorPlanError, match="resolution"):
        FloorPlanConfig(resolution=0.0)
    with pytest.raises(FloorPlanError, match="furniture_per_room"):
        FloorPlanConfig(furniture_per_room=(3, 1))
    # Valid numbers that give episodes no goal object.
    with pytest.raises(FloorPlanError, match="no furniture"):
        generate_floor_plan(FloorPlanConfig(furniture_per_room=(0, 0)), np.random.default_rng(0))
