"""Episode strata (verl_omni/sim/episode_strata.py) on a hand-built two-room floor, expected values by geometry."""

import math

import numpy as np
import pytest

from verl_omni.sim.closed_loop import EpisodeSpec
from verl_omni.sim.episode_strata import STRATA, episode_strata, goal_furniture_index, stratified_rates
from verl_omni.sim.eval_metrics import wilson_interval
from verl_omni.sim.floorplan import FURNITURE_BASE, WALL, Door, FloorPlan, Furniture, Room

RES = 0.05


def _two_rooms() -> FloorPlan:
    """8 m x 4 m, 0.1 m walls, a wall at x in [3.9, 4.0) with a door at y in [1.5, 2.4).

    Room 0 (x < 3.9) holds a red table at x, y in [0.5, 0.7) and a blue chair at x in [2.5, 2.7), y in [1.9, 2.1);
    room 1 (x >= 4.0) holds a second red table at x in [6.5, 6.7), y in [1.9, 2.1).
    """
    material = np.full((80, 160), WALL, np.uint8)
    material[2:78, 2:78] = 0
    material[2:78, 80:158] = 0
    material[30:48, 78:80] = 0  # the door
    room_id = np.full(material.shape, -1, np.int16)
    room_id[2:78, 2:78] = 0
    room_id[2:78, 80:158] = 1
    pieces = [
        Furniture(0, "table", "red", (200, 40, 40), 0.75, (10, 14, 10, 14), 0),
        Furniture(1, "chair", "blue", (40, 40, 200), 0.9, (38, 42, 50, 54), 0),
        Furniture(2, "table", "red", (200, 40, 40), 0.75, (38, 42, 130, 134), 1),
    ]
    for p in pieces:
        r0, r1, c0, c1 = p.rect
        material[r0:r1, c0:c1] = FURNITURE_BASE + p.index
    rooms = [Room(0, "office", (2, 78, 2, 78), (90, 90, 90)), Room(1, "kitchen", (2, 78, 80, 158), (80, 80, 80))]
    return FloorPlan(material, room_id, rooms, pieces, [Door((30, 48, 78, 80), (0, 1))], RES, scene_id="t0")


def _spec(k, start, goal, obj) -> EpisodeSpec:
    return EpisodeSpec(f"t0_ev{k:03d}", "t0", start, goal, f"go to the {obj}", 0.5, 5.0, k, goal_object=obj)


# 1: the kitchen table from the office, facing it through the door, but the chair (1.5 m ahead, 0.2 m wide:
#    +-3.8 deg) hides the table (5.5 m ahead, +-1.0 deg); no other heading faces it.
# 2: the chair, from behind it (facing -x): seen only once the turn reaches heading 0.
# 3: the kitchen table from inside the kitchen, 1.5 m ahead with nothing between.
EPISODES = [
    _spec(0, (1.0, 2.0, 0.0), (6.4, 2.0), "red table"),
    _spec(1, (1.0, 2.0, math.pi), (2.4, 2.0), "blue chair"),
    _spec(2, (5.0, 2.0, 0.0), (6.4, 2.0), "red table"),
]
EXPECTED = [
    {"same_room": False, "in_view_at_start": False, "in_view_after_turn": False, "name_in_other_room": True},
    {"same_room": True, "in_view_at_start": False, "in_view_after_turn": True, "name_in_other_room": False},
    {"same_room": True, "in_view_at_start": True, "in_view_after_turn": True, "name_in_other_room": True},
]


def test_goal_object_is_the_named_piece_nearest_the_goal_point():
    plan = _two_rooms()
    assert goal_furniture_index(plan, EPISODES[0]) == 2  # the kitchen's red table, not the office's
    assert goal_furniture_index(plan, _spec(9, (1.0, 2.0, 0.0), (0.4, 0.6), "red table")) == 0
    with pytest.raises(ValueError, match="no piece named 'green sofa'"):
        goal_furniture_index(plan, _spec(9, (1.0, 2.0, 0.0), (0.4, 0.6), "green sofa"))


@pytest.mark.parametrize("k", range(len(EPISODES)))
def test_strata_by_geometry(k):
    got = episode_strata(_two_rooms(), EPISODES[k])
    assert set(got) == set(STRATA)
    assert got == EXPECTED[k]


def test_stratified_rates_count_each_side():
    strata = {s.episode_id: e for s, e in zip(EPISODES, EXPECTED, strict=True)}
    records = [{"episode_id": s.episode_id, "success": ok} for s, ok in zip(EPISODES, (True, False, True), strict=True)]
    rates = stratified_rates(records, strata)
    # same_room: episodes 2 and 3 (one success) vs episode 1 (a success).
    assert rates["same_room"]["yes"]["episodes"] == 2 and rates["same_room"]["yes"]["count"] == 1
    assert rates["same_room"]["yes"]["mean"] == 0.5
    assert rates["same_room"]["no"]["episodes"] == 1 and rates["same_room"]["no"]["mean"] == 1.0
    assert (rates["same_room"]["yes"]["low"], rates["same_room"]["yes"]["high"]) == wilson_interval(1, 2)
    # in_view_at_start: only episode 3 (a success) is yes.
    assert rates["in_view_at_start"]["yes"]["count"] == 1 and rates["in_view_at_start"]["no"]["count"] == 1
    # A side without episodes has no rate rather than 0.
    only_first = stratified_rates(records[:1], strata)
    assert only_first["same_room"]["yes"] == {"episodes": 0, "count": 0, "mean": None, "low": None, "high": None}
    with pytest.raises(KeyError, match="t0_ev009"):
        stratified_rates([{"episode_id": "t0_ev009", "success": True}], strata)
