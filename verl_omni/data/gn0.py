"""Reading and validating a GN0 DAgger collection (exact fields in ``docs/contracts.md``).

Parsing is strict: every problem with a record raises :class:`RecordRejected` carrying a reason from
:data:`SKIP_REASONS` and a message naming the file and field, so callers can skip and count it instead
of crashing. Video files are not opened here (see :mod:`verl_omni.data.convert`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_omni.data.schema import ACTION_STEPS, EVENT_NAMES, REFERENCE_POSES

COLLECTION_FORMAT = "gn0-dagger/1"
COLLECTION_FILE = "collection.json"
EPISODES_DIR = "episodes"
EPISODE_FILE = "episode.json"

# reason -> what the user should do about it; the keys are the manifest's skipped-by-reason names.
SKIP_REASONS: dict[str, str] = {
    "missing_file": "a file the record names does not exist; re-collect the episode or delete its directory",
    "unreadable_json": "episode.json is truncated or not valid JSON; re-collect the episode",
    "invalid_record": "a required field is missing or has the wrong type or length; fix the collector",
    "non_finite": "a pose, goal or radius is NaN or infinite; re-collect the episode",
    "query_out_of_range": "a query index t is outside the episode's poses; fix the collector",
    "unknown_event": "an event name is not one of the four known events; fix the collector",
    "reference_mismatch": "reference_poses[0] differs from poses[t]; fix the collector",
    "unreadable_video": "a video cannot be decoded; re-encode or re-collect it",
    "pose_frame_mismatch": "the number of poses differs from the number of frames of the episode video",
    "reference_frame_mismatch": "the reference video does not have 33 frames",
    "unknown_scene": "the scene has no directory under --occupancy-root; add the scene or fix --occupancy-root",
    "unreadable_scene": "the scene's occupancy.png/occupancy.json are malformed; re-export the scene",
}

# reference_poses[0] must equal poses[t]; tolerance for float noise in the collector's JSON.
_POSE_TOLERANCE = 1e-3


class CollectionError(ValueError):
    """The collection as a whole is unusable (missing root, missing or malformed collection.json)."""


class RecordRejected(Exception):
    """An episode or query record failed validation.

    Attributes:
        reason: Key of :data:`SKIP_REASONS`.
        detail: Human-readable message naming the file and field.
    """

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class CollectionInfo:
    """Content of ``collection.json``.

    Attributes:
        root: Absolute collection root.
        fps: Frames per second of every video.
        image_size: ``(H, W)``.
        history_frames: Frames of history per sample (must be 33).
        target_frames: Frames of target per sample (must be 33).
        raw: The whole JSON object (recorded in manifests).
    """

    root: Path
    fps: int
    image_size: tuple[int, int]
    history_frames: int
    target_frames: int
    raw: dict


def read_collection_info(root: str | Path) -> CollectionInfo:
    """Reads and checks ``<root>/collection.json``.

    Raises:
        CollectionError: naming the file/field and what to do.
    """
    root = Path(root).resolve()
    path = root / COLLECTION_FILE
    if not root.is_dir():
        raise CollectionError(f"--input-root {root}: not a directory; pass the GN0 collection root")
    if not path.is_file():
        raise CollectionError(f"{path}: missing; --input-root must be a GN0 collection (collection.json + episodes/)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CollectionError(f"{path}: not valid JSON ({e}); re-write it from the collector") from e
    if not isinstance(raw, dict):
        raise CollectionError(f"{path}: expected a JSON object")
    if raw.get("format") != COLLECTION_FORMAT:
        raise CollectionError(f"{path}: field 'format' is {raw.get('format')!r}, expected {COLLECTION_FORMAT!r}")
    fps = raw.get("fps")
    if not isinstance(fps, int) or fps <= 0:
        raise CollectionError(f"{path}: field 'fps' must be a positive integer, got {fps!r}")
    size = raw.get("image_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise CollectionError(f"{path}: field 'image_size' must be [H, W] positive integers, got {size!r}")
    frames = {}
    for key in ("history_frames", "target_frames"):
        value = raw.get(key, 33)
        if value != 33:
            raise CollectionError(f"{path}: field {key!r} is {value!r}; the Stage-III contract needs 33")
        frames[key] = value
    if not (root / EPISODES_DIR).is_dir():
        raise CollectionError(f"{root / EPISODES_DIR}: missing; a GN0 collection keeps episodes under episodes/")
    return CollectionInfo(root=root, fps=fps, image_size=(size[0], size[1]), raw=raw, **frames)


def list_episode_ids(root: str | Path) -> list[str]:
    """Sorted names of the episode directories under ``<root>/episodes`` (deterministic order)."""
    base = Path(root) / EPISODES_DIR
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclass(frozen=True, eq=False)
class QueryRecord:
    """One recorded query state of an episode.

    Attributes:
        t: Index into the episode's poses and video frames.
        reference_poses: ``float64 [33, 3]`` expert poses from ``t`` on.
        reference_stop: ``uint8 [32]`` expert stop flags.
        reference_video: Path relative to the collection root.
        events: Event names.
        goal_object_bearing: Optional: bearing (radians, robot frame, left positive) at which the goal object is
            drawn in the frame at ``t``; NaN when it is not in that view; None when the record does not say
            (the field is optional: older collections lack it).
        goal_object_distance: Optional, with ``goal_object_bearing``: metres along the view's rays to the goal
            object's nearest drawn point; NaN when it is not in view, None when not recorded.
    """

    t: int
    reference_poses: np.ndarray
    reference_stop: np.ndarray
    reference_video: str
    events: tuple[str, ...]
    goal_object_bearing: float | None = None
    goal_object_distance: float | None = None


@dataclass(frozen=True, eq=False)
class EpisodeRecord:
    """A parsed, structurally valid ``episode.json``.

    Attributes:
        episode_id: Directory name (must equal the JSON field).
        scene_id: Occupancy scene id.
        instructions: Instruction variants.
        goal: ``float64 [2]``.
        success_radius: Metres.
        video: Episode video, path relative to the collection root.
        poses: ``float64 [T, 3]``, one per video frame.
        queries: Query records sorted by ``t``; malformed ones are in ``rejected_queries``.
        rejected_queries: ``(t or None, RecordRejected)`` for queries that failed validation.
    """

    episode_id: str
    scene_id: str
    instructions: tuple[str, ...]
    goal: np.ndarray
    success_radius: float
    video: str
    poses: np.ndarray
    queries: tuple[QueryRecord, ...]
    rejected_queries: tuple[tuple[int | None, RecordRejected], ...]


def _array(value, shape: tuple[int | None, ...], where: str) -> np.ndarray:
    """Converts a JSON list to float64 of the given shape (None = any length), or rejects."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise RecordRejected("invalid_record", f"{where}: not a numeric array ({e})") from e
    if arr.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
        want = "x".join("N" if s is None else str(s) for s in shape)
        raise RecordRejected("invalid_record", f"{where}: expected shape {want}, got {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise RecordRejected("non_finite", f"{where}: contains NaN or infinite values")
    return arr


def _relative_file(ep_rel: str, name, where: str) -> str:
    """Validates a file name inside the episode directory and returns it relative to the collection root."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise RecordRejected(
            "invalid_record", f"{where}: must be a file name inside the episode directory, got {name!r}"
        )
    return f"{ep_rel}/{name}"


def _parse_query(q, index: int, ep_rel: str, poses: np.ndarray, where: str) -> QueryRecord:
    qw = f"{where}: queries[{index}]"
    if not isinstance(q, dict):
        raise RecordRejected("invalid_record", f"{qw}: expected an object")
    for key in ("t", "reference_poses", "reference_stop", "reference_video", "events"):
        if key not in q:
            raise RecordRejected("invalid_record", f"{qw}: missing field {key!r}")
    t = q["t"]
    if not isinstance(t, int) or isinstance(t, bool):
        raise RecordRejected("invalid_record", f"{qw}.t: must be an integer, got {t!r}")
    if not 0 <= t < len(poses):
        raise RecordRejected("query_out_of_range", f"{qw}.t = {t} but the episode has {len(poses)} poses")
    ref = _array(q["reference_poses"], (REFERENCE_POSES, 3), f"{qw}.reference_poses")
    stop = _array(q["reference_stop"], (ACTION_STEPS,), f"{qw}.reference_stop")
    if not np.isin(stop, (0.0, 1.0)).all():
        raise RecordRejected("invalid_record", f"{qw}.reference_stop: flags must be 0 or 1")
    d_xy = float(np.hypot(*(ref[0, :2] - poses[t, :2])))
    d_yaw = abs(math.remainder(float(ref[0, 2] - poses[t, 2]), 2 * math.pi))
    if d_xy > _POSE_TOLERANCE or d_yaw > _POSE_TOLERANCE:
        raise RecordRejected(
            "reference_mismatch",
            f"{qw}.reference_poses[0] = {ref[0].tolist()} but poses[{t}] = {poses[t].tolist()}",
        )
    events = q["events"]
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        raise RecordRejected("invalid_record", f"{qw}.events: must be a list of strings")
    unknown = sorted(set(events) - set(EVENT_NAMES))
    if unknown:
        raise RecordRejected("unknown_event", f"{qw}.events: unknown names {unknown}; known: {list(EVENT_NAMES)}")
    # Canonical order (the EVENT_NAMES order, no duplicates) so equal label sets give equal rows.
    ordered = tuple(e for e in EVENT_NAMES if e in events)
    video = _relative_file(ep_rel, q["reference_video"], f"{qw}.reference_video")
    bearing = _optional_sighting(q, "goal_object_bearing", -math.pi, math.pi, "radians in [-pi, pi]", qw)
    distance = _optional_sighting(q, "goal_object_distance", 0.0, math.inf, "metres >= 0", qw)
    return QueryRecord(
        t=t, reference_poses=ref, reference_stop=stop.astype(np.uint8), reference_video=video, events=ordered,
        goal_object_bearing=bearing, goal_object_distance=distance,
    )  # fmt: skip


def _optional_sighting(q: dict, key: str, low: float, high: float, what: str, qw: str) -> float | None:
    """An optional per-query number: None when absent, NaN when null (the goal object is not in view)."""
    if key not in q:
        return None
    raw = q[key]
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if raw is not None and not (number and low <= raw <= high):
        raise RecordRejected("invalid_record", f"{qw}.{key}: must be null or {what}, got {raw!r}")
    return math.nan if raw is None else float(raw)


def parse_episode(root: str | Path, episode_id: str) -> EpisodeRecord:
    """Reads and validates ``<root>/episodes/<episode_id>/episode.json`` (no video access).

    Episode-level problems raise; a malformed query is recorded in ``rejected_queries`` and the rest of
    the episode stays usable.

    Raises:
        RecordRejected: the whole episode is unusable.
    """
    ep_rel = f"{EPISODES_DIR}/{episode_id}"
    path = Path(root) / ep_rel / EPISODE_FILE
    where = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise RecordRejected("missing_file", f"{where}: not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise RecordRejected("unreadable_json", f"{where}: cannot be read ({e})") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordRejected("unreadable_json", f"{where}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise RecordRejected("invalid_record", f"{where}: expected a JSON object")
    for key in ("scene_id", "instructions", "goal", "success_radius", "poses", "queries"):
        if key not in raw:
            raise RecordRejected("invalid_record", f"{where}: missing field {key!r}")
    if raw.get("episode_id", episode_id) != episode_id:
        raise RecordRejected(
            "invalid_record",
            f"{where}: field 'episode_id' is {raw['episode_id']!r} but the directory is {episode_id!r}",
        )
    scene_id = raw["scene_id"]
    if not isinstance(scene_id, str) or not scene_id or "/" in scene_id or scene_id in (".", ".."):
        raise RecordRejected(
            "invalid_record", f"{where}: field 'scene_id' must be a plain directory name, got {scene_id!r}"
        )
    instructions = raw["instructions"]
    if not (
        isinstance(instructions, list) and instructions and all(isinstance(s, str) and s.strip() for s in instructions)
    ):
        raise RecordRejected(
            "invalid_record", f"{where}: field 'instructions' must be a non-empty list of non-empty strings"
        )
    goal = _array(raw["goal"], (2,), f"{where}: goal")
    radius = raw["success_radius"]
    if not isinstance(radius, (int, float)) or isinstance(radius, bool):
        raise RecordRejected("invalid_record", f"{where}: field 'success_radius' must be a number, got {radius!r}")
    if not math.isfinite(radius):
        raise RecordRejected("non_finite", f"{where}: field 'success_radius' is {radius}")
    if radius <= 0:
        raise RecordRejected("invalid_record", f"{where}: field 'success_radius' must be > 0, got {radius}")
    poses = _array(raw["poses"], (None, 3), f"{where}: poses")
    if len(poses) == 0:
        raise RecordRejected("invalid_record", f"{where}: field 'poses' is empty")
    video = _relative_file(ep_rel, raw.get("video", "rgb.mp4"), f"{where}: video")
    if not isinstance(raw["queries"], list):
        raise RecordRejected("invalid_record", f"{where}: field 'queries' must be a list")
    queries: dict[int, QueryRecord] = {}
    rejected: list[tuple[int | None, RecordRejected]] = []
    for i, q in enumerate(raw["queries"]):
        t = q.get("t") if isinstance(q, dict) and isinstance(q.get("t"), int) else None
        try:
            record = _parse_query(q, i, ep_rel, poses, where)
        except RecordRejected as e:
            rejected.append((t, e))
            continue
        if record.t in queries:
            rejected.append((t, RecordRejected("invalid_record", f"{where}: queries[{i}]: duplicate query t = {t}")))
            continue
        queries[record.t] = record
    return EpisodeRecord(
        episode_id=episode_id,
        scene_id=scene_id,
        instructions=tuple(instructions),
        goal=goal,
        success_radius=float(radius),
        video=video,
        poses=poses,
        queries=tuple(queries[t] for t in sorted(queries)),
        rejected_queries=tuple(rejected),
    )
