"""Stage-III row schema: Parquet round trip, shape/name validation, schema diffing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_omni.data.schema import (
    COLUMN_NAMES,
    EVENT_NAMES,
    STAGE3_SCHEMA,
    Stage3Row,
    make_sample_id,
    rows_to_table,
    schema_problems,
    table_to_rows,
)


def _row(i: int, **overrides) -> Stage3Row:
    rng = np.random.default_rng(i)
    fields = dict(
        sample_id=make_sample_id(f"ep{i}", 3 * i, i % 2),
        episode_id=f"ep{i}",
        scene_id="s0",
        instruction=f"instruction {i}",
        instruction_index=i % 2,
        query_t=3 * i,
        history_video=f"episodes/ep{i}/rgb.mp4",
        history_frames=np.arange(33) + i,
        target_video=f"episodes/ep{i}/ref_{3 * i}.mp4",
        target_frames=np.arange(33),
        start_pose=rng.normal(size=3),
        reference_poses=rng.normal(size=(33, 3)),
        reference_stop=(np.arange(32) >= 20 + i).astype(np.uint8),
        goal=rng.normal(size=2),
        success_radius=0.5 + i,
        events=EVENT_NAMES[: i % 5],
        expert_actions=rng.normal(size=(32, 4)).astype(np.float32),
        occupancy="s0",
        split="train" if i % 2 else "val",
    )
    fields.update(overrides)
    return Stage3Row(**fields)


def test_every_design_column_is_in_the_schema():
    design_columns = {
        "sample_id",
        "episode_id",
        "scene_id",
        "instruction",
        "history_video",
        "history_frames",
        "target_video",
        "target_frames",
        "start_pose",
        "reference_poses",
        "goal",
        "success_radius",
        "events",
        "expert_actions",
        "occupancy",
        "split",
    }
    assert design_columns <= set(COLUMN_NAMES)
    assert STAGE3_SCHEMA.field("reference_poses").type == pa.list_(pa.list_(pa.float64(), 3), 33)
    assert STAGE3_SCHEMA.field("expert_actions").type == pa.list_(pa.list_(pa.float32(), 4), 32)


def test_parquet_round_trip_keeps_every_value(tmp_path):
    rows = [_row(i) for i in range(5)]
    pq.write_table(rows_to_table(rows), tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet")
    assert schema_problems(table.schema) == []
    back = table_to_rows(table)
    for a, b in zip(rows, back):
        for name in COLUMN_NAMES:
            va, vb = getattr(a, name), getattr(b, name)
            if isinstance(va, np.ndarray):
                np.testing.assert_array_equal(np.asarray(va, vb.dtype), vb)
            else:
                assert va == vb, name
    assert back[4].events == EVENT_NAMES[:4]
    assert back[0].expert_actions.dtype == np.float32 and back[0].reference_poses.shape == (33, 3)


def test_sample_ids_sort_in_episode_query_variant_order():
    ids = [make_sample_id("e", t, k) for t in (2, 10, 100) for k in (0, 1, 12)]
    assert sorted(ids) == ids
    assert make_sample_id("s0003_e002", 12, 1) == "s0003_e002/t000012/i001"


@pytest.mark.parametrize(
    "override, field",
    [
        ({"history_frames": np.arange(32)}, "history_frames"),
        ({"reference_poses": np.zeros((33, 2))}, "reference_poses"),
        ({"expert_actions": np.zeros((32, 3))}, "expert_actions"),
        ({"split": "test"}, "split"),
        ({"events": ("collision",)}, "events"),
    ],
)
def test_row_rejects_bad_fields_naming_them(override, field):
    with pytest.raises(ValueError, match=field):
        _row(1, **override)


def test_schema_problems_names_missing_and_retyped_columns():
    table = rows_to_table([_row(1)])
    broken = table.drop_columns(["goal"]).set_column(0, "sample_id", pa.array([1], pa.int64()))
    problems = schema_problems(broken.schema)
    assert any("'goal'" in p and "missing" in p for p in problems)
    assert any("'sample_id'" in p and "int64" in p for p in problems)


def test_event_names_match_the_simulator_labels():
    events = pytest.importorskip("verl_omni.sim.events")
    assert tuple(events.EVENT_NAMES) == EVENT_NAMES
