"""The converted Stage-III row: Arrow/Parquet schema and typed record, defined in this one place.

One row per (query state, instruction variant) of a GN0 episode. Frames are references
into the source collection (paths relative to the collection root recorded in the manifest) plus frame
indices; poses and actions are fixed-size lists so that readers get dense arrays without per-row shape
checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

ROWS_FORMAT = "verl-omni-stage3-rows/1"
HISTORY_FRAMES = 33
TARGET_FRAMES = 33
REFERENCE_POSES = 33
ACTION_STEPS = 32
ACTION_CHANNELS = 4
EVENT_NAMES: tuple[str, ...] = (
    "collision_precursor",
    "premature_stop_risk",
    "required_stop",
    "near_goal_continuation",
)
SPLITS: tuple[str, ...] = ("train", "val")


def _fixed(value_type: pa.DataType, *dims: int) -> pa.DataType:
    """Nested fixed-size list type, outermost dimension first."""
    t = value_type
    for d in reversed(dims):
        t = pa.list_(t, d)
    return t


def stage3_schema() -> pa.Schema:
    """The Arrow schema of converted rows; every shard of every Stage-III data tool uses exactly this."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("scene_id", pa.string(), nullable=False),
        pa.field("instruction", pa.string(), nullable=False),
        pa.field("instruction_index", pa.int32(), nullable=False),
        pa.field("query_t", pa.int32(), nullable=False),
        pa.field("history_video", pa.string(), nullable=False),
        pa.field("history_frames", _fixed(pa.int32(), HISTORY_FRAMES), nullable=False),
        pa.field("target_video", pa.string(), nullable=False),
        pa.field("target_frames", _fixed(pa.int32(), TARGET_FRAMES), nullable=False),
        pa.field("start_pose", _fixed(pa.float64(), 3), nullable=False),
        pa.field("reference_poses", _fixed(pa.float64(), REFERENCE_POSES, 3), nullable=False),
        pa.field("reference_stop", _fixed(pa.uint8(), ACTION_STEPS), nullable=False),
        pa.field("goal", _fixed(pa.float64(), 2), nullable=False),
        pa.field("success_radius", pa.float64(), nullable=False),
        pa.field("events", pa.list_(pa.string()), nullable=False),
        pa.field("expert_actions", _fixed(pa.float32(), ACTION_STEPS, ACTION_CHANNELS), nullable=False),
        pa.field("occupancy", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
    ]
    return pa.schema(fields, metadata={b"verl_omni.rows_format": ROWS_FORMAT.encode()})


STAGE3_SCHEMA = stage3_schema()
COLUMN_NAMES: tuple[str, ...] = tuple(STAGE3_SCHEMA.names)


@dataclass(frozen=True, eq=False)
class Stage3Row:
    """One converted training/validation sample.

    Attributes:
        sample_id: Unique, stable id ``<episode_id>/t<query_t>/i<instruction_index>``.
        episode_id: Source GN0 episode (the unit of train/val splitting and subsetting).
        scene_id: Occupancy scene id.
        instruction: The instruction variant of this row.
        instruction_index: Index of the variant in the episode's ``instructions``.
        query_t: Query state: index into the episode's poses and ``rgb.mp4`` frames.
        history_video: Policy video, path relative to the collection root.
        history_frames: ``int32 [33]`` frame indices ``t-32 .. t`` clamped at 0.
        target_video: Expert reference video, path relative to the collection root.
        target_frames: ``int32 [33]`` frame indices (the current frame and 32 future frames).
        start_pose: ``float64 [3]`` pose at the query state (x, y, yaw; world frame).
        reference_poses: ``float64 [33, 3]`` expert poses from the query state on.
        reference_stop: ``uint8 [32]`` expert stop flags, one per action step.
        goal: ``float64 [2]`` goal position (world frame).
        success_radius: Metres.
        events: Event names (subset of :data:`EVENT_NAMES`).
        expert_actions: ``float32 [32, 4]`` expert actions, normalized with the checkpoint's statistics.
        occupancy: Scene directory relative to the occupancy root.
        split: ``"train"`` or ``"val"``.
    """

    sample_id: str
    episode_id: str
    scene_id: str
    instruction: str
    instruction_index: int
    query_t: int
    history_video: str
    history_frames: np.ndarray
    target_video: str
    target_frames: np.ndarray
    start_pose: np.ndarray
    reference_poses: np.ndarray
    reference_stop: np.ndarray
    goal: np.ndarray
    success_radius: float
    events: tuple[str, ...]
    expert_actions: np.ndarray
    occupancy: str
    split: str

    def __post_init__(self) -> None:
        shapes = {
            "history_frames": (HISTORY_FRAMES,),
            "target_frames": (TARGET_FRAMES,),
            "start_pose": (3,),
            "reference_poses": (REFERENCE_POSES, 3),
            "reference_stop": (ACTION_STEPS,),
            "goal": (2,),
            "expert_actions": (ACTION_STEPS, ACTION_CHANNELS),
        }
        for name, shape in shapes.items():
            value = np.asarray(getattr(self, name))
            if value.shape != shape:
                raise ValueError(
                    f"Stage3Row {self.sample_id!r}: field {name!r} must have shape {shape}, got {value.shape}"
                )
        if self.split not in SPLITS:
            raise ValueError(f"Stage3Row {self.sample_id!r}: field 'split' must be one of {SPLITS}, got {self.split!r}")
        unknown = [e for e in self.events if e not in EVENT_NAMES]
        if unknown:
            raise ValueError(f"Stage3Row {self.sample_id!r}: field 'events' has unknown names {unknown}")


def make_sample_id(episode_id: str, query_t: int, instruction_index: int) -> str:
    """Stable sample id; zero-padded so that string order equals (episode, t, variant) order."""
    return f"{episode_id}/t{query_t:06d}/i{instruction_index:03d}"


def _fixed_array(values: np.ndarray, value_type: pa.DataType, dims: tuple[int, ...]) -> pa.Array:
    """Builds a nested FixedSizeListArray from a dense ``[N, *dims]`` numpy array."""
    arr = pa.array(np.ascontiguousarray(values).reshape(-1), type=value_type)
    for d in reversed(dims):
        arr = pa.FixedSizeListArray.from_arrays(arr, d)
    return arr


def rows_to_table(rows: Sequence[Stage3Row]) -> pa.Table:
    """Packs rows into an Arrow table with :data:`STAGE3_SCHEMA` (row order preserved)."""
    n = len(rows)

    def stack(name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
        if n == 0:
            return np.zeros((0, *shape), dtype=dtype)
        return np.stack([np.asarray(getattr(r, name), dtype=dtype) for r in rows])

    columns = {
        "sample_id": pa.array([r.sample_id for r in rows], type=pa.string()),
        "episode_id": pa.array([r.episode_id for r in rows], type=pa.string()),
        "scene_id": pa.array([r.scene_id for r in rows], type=pa.string()),
        "instruction": pa.array([r.instruction for r in rows], type=pa.string()),
        "instruction_index": pa.array([int(r.instruction_index) for r in rows], type=pa.int32()),
        "query_t": pa.array([int(r.query_t) for r in rows], type=pa.int32()),
        "history_video": pa.array([r.history_video for r in rows], type=pa.string()),
        "history_frames": _fixed_array(
            stack("history_frames", np.int32, (HISTORY_FRAMES,)), pa.int32(), (HISTORY_FRAMES,)
        ),
        "target_video": pa.array([r.target_video for r in rows], type=pa.string()),
        "target_frames": _fixed_array(stack("target_frames", np.int32, (TARGET_FRAMES,)), pa.int32(), (TARGET_FRAMES,)),
        "start_pose": _fixed_array(stack("start_pose", np.float64, (3,)), pa.float64(), (3,)),
        "reference_poses": _fixed_array(
            stack("reference_poses", np.float64, (REFERENCE_POSES, 3)), pa.float64(), (REFERENCE_POSES, 3)
        ),
        "reference_stop": _fixed_array(stack("reference_stop", np.uint8, (ACTION_STEPS,)), pa.uint8(), (ACTION_STEPS,)),
        "goal": _fixed_array(stack("goal", np.float64, (2,)), pa.float64(), (2,)),
        "success_radius": pa.array([float(r.success_radius) for r in rows], type=pa.float64()),
        "events": pa.array([list(r.events) for r in rows], type=pa.list_(pa.string())),
        "expert_actions": _fixed_array(
            stack("expert_actions", np.float32, (ACTION_STEPS, ACTION_CHANNELS)),
            pa.float32(),
            (ACTION_STEPS, ACTION_CHANNELS),
        ),
        "occupancy": pa.array([r.occupancy for r in rows], type=pa.string()),
        "split": pa.array([r.split for r in rows], type=pa.string()),
    }
    return pa.Table.from_arrays([columns[name] for name in COLUMN_NAMES], schema=STAGE3_SCHEMA)


def _dense(column: pa.ChunkedArray, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Flattens a (nested) fixed-size list column to a dense ``[N, *shape]`` numpy array."""
    arr = column.combine_chunks()
    for _ in shape:
        arr = arr.flatten()
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype).reshape((len(column), *shape))


@dataclass(frozen=True, eq=False)
class Stage3Columns:
    """Dense numpy view of a whole table: string columns as lists, array columns as ``[N, ...]`` arrays."""

    strings: dict[str, list[str]]
    ints: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]
    success_radius: np.ndarray
    events: list[tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.success_radius)

    def row(self, i: int) -> Stage3Row:
        """The typed record at position ``i``."""
        return Stage3Row(
            **{k: v[i] for k, v in self.strings.items()},
            **{k: int(v[i]) for k, v in self.ints.items()},
            **{k: v[i] for k, v in self.arrays.items()},
            success_radius=float(self.success_radius[i]),
            events=self.events[i],
        )


_STRING_COLUMNS = (
    "sample_id",
    "episode_id",
    "scene_id",
    "instruction",
    "history_video",
    "target_video",
    "occupancy",
    "split",
)
_ARRAY_COLUMNS = {
    "history_frames": (np.int32, (HISTORY_FRAMES,)),
    "target_frames": (np.int32, (TARGET_FRAMES,)),
    "start_pose": (np.float64, (3,)),
    "reference_poses": (np.float64, (REFERENCE_POSES, 3)),
    "reference_stop": (np.uint8, (ACTION_STEPS,)),
    "goal": (np.float64, (2,)),
    "expert_actions": (np.float32, (ACTION_STEPS, ACTION_CHANNELS)),
}


def table_to_columns(table: pa.Table) -> Stage3Columns:
    """Unpacks a table with :data:`STAGE3_SCHEMA` into dense numpy columns (raises on a schema mismatch)."""
    problems = schema_problems(table.schema)
    if problems:
        raise ValueError("table does not follow the Stage-III row schema: " + "; ".join(problems))
    return Stage3Columns(
        strings={k: table.column(k).to_pylist() for k in _STRING_COLUMNS},
        ints={k: table.column(k).to_numpy().astype(np.int64) for k in ("instruction_index", "query_t")},
        arrays={k: _dense(table.column(k), dtype, shape) for k, (dtype, shape) in _ARRAY_COLUMNS.items()},
        success_radius=table.column("success_radius").to_numpy().astype(np.float64),
        events=[tuple(e) for e in table.column("events").to_pylist()],
    )


def table_to_rows(table: pa.Table) -> list[Stage3Row]:
    """All rows of a table as typed records."""
    cols = table_to_columns(table)
    return [cols.row(i) for i in range(len(cols))]


def schema_problems(schema: pa.Schema) -> list[str]:
    """Differences between ``schema`` and :data:`STAGE3_SCHEMA`, one message per column (empty if equal)."""
    problems = []
    expected = {f.name: f.type for f in STAGE3_SCHEMA}
    actual = {f.name: f.type for f in schema}
    for name, t in expected.items():
        if name not in actual:
            problems.append(f"missing column {name!r}")
        elif actual[name] != t:
            problems.append(f"column {name!r} has type {actual[name]}, expected {t}")
    for name in actual:
        if name not in expected:
            problems.append(f"unexpected column {name!r}")
    return problems
