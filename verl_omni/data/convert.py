"""GN0 episode -> Stage-III rows, and the ordered, bounded parallel map over episodes.

``convert_episode`` is the per-episode job run in worker processes: it validates the episode (JSON,
videos, occupancy scene) and turns each valid (query state, instruction variant) into a
:class:`~verl_omni.data.schema.Stage3Row`. Data problems never raise; they come back as
:class:`SkippedItem` with a reason from :data:`~verl_omni.data.gn0.SKIP_REASONS`.

``iter_episode_results`` maps it over episodes with a bounded window of in-flight jobs and yields
results in input order, so the output does not depend on the number of workers or their timing.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from verl_omni.data.actions import ActionNormalization, poses_to_actions
from verl_omni.data.gn0 import SKIP_REASONS, EpisodeRecord, QueryRecord, RecordRejected, parse_episode
from verl_omni.data.hashing import file_sha256, stable_unit
from verl_omni.data.schema import HISTORY_FRAMES, TARGET_FRAMES, Stage3Row, make_sample_id

OCCUPANCY_FILES = ("occupancy.png", "occupancy.json")


@dataclass(frozen=True)
class EpisodeTask:
    """Everything a worker needs to convert one episode (picklable).

    Attributes:
        input_root: Collection root (absolute).
        occupancy_root: Occupancy scenes root (absolute).
        episode_id: Directory name under ``episodes/``.
        normalization: The checkpoint's ``action_normalization.json`` content.
        split: ``"train"``/``"val"`` to force a split, or None to draw it from ``split_seed``/``val_fraction``.
        val_fraction: Fraction of episodes in the val split, in ``[0, 1]``.
        split_seed: Seed of the split hash.
    """

    input_root: str
    occupancy_root: str
    episode_id: str
    normalization: dict
    split: str | None = None
    val_fraction: float = 0.0
    split_seed: int = 0


@dataclass(frozen=True)
class SkippedItem:
    """A rejected episode (``t`` None) or query record, with its reason and a message naming the file."""

    episode_id: str
    t: int | None
    reason: str
    detail: str

    def to_dict(self) -> dict:
        return {"episode_id": self.episode_id, "t": self.t, "reason": self.reason, "detail": self.detail}


@dataclass
class EpisodeResult:
    """Outcome of one episode.

    Attributes:
        episode_id: The episode.
        scene_id: Its scene, or None when the episode could not be parsed.
        rows: Converted rows sorted by ``sample_id``.
        records: Number of query records converted.
        skipped: Rejected episode or query records.
    """

    episode_id: str
    scene_id: str | None
    rows: list[Stage3Row] = field(default_factory=list)
    records: int = 0
    skipped: list[SkippedItem] = field(default_factory=list)


def episode_split(episode_id: str, val_fraction: float, split_seed: int) -> str:
    """Deterministic split of a source episode: ``"val"`` iff its stable hash falls below ``val_fraction``."""
    return "val" if stable_unit(split_seed, episode_id) < val_fraction else "train"


def history_indices(t: int, count: int = HISTORY_FRAMES) -> np.ndarray:
    """Frame indices ``t - count + 1 .. t`` clamped at 0 (the query frame is the last one).

    Returns:
        ``int32 [count]``.
    """
    return np.maximum(np.arange(t - count + 1, t + 1), 0).astype(np.int32)


def target_indices(count: int = TARGET_FRAMES) -> np.ndarray:
    """Indices of the reference video: frame 0 is the query state, 1..32 the expert's future frames."""
    return np.arange(count, dtype=np.int32)


def rows_for_query(
    episode: EpisodeRecord, query: QueryRecord, normalization: ActionNormalization, split: str
) -> list[Stage3Row]:
    """All instruction variants of one query state as rows (pure: no file access)."""
    raw_actions = poses_to_actions(query.reference_poses, query.reference_stop)  # [32, 4] float64
    actions = normalization.normalize(raw_actions).astype(np.float32)
    hist = history_indices(query.t)
    target = target_indices()
    return [
        Stage3Row(
            sample_id=make_sample_id(episode.episode_id, query.t, k),
            episode_id=episode.episode_id,
            scene_id=episode.scene_id,
            instruction=instruction,
            instruction_index=k,
            query_t=query.t,
            history_video=episode.video,
            history_frames=hist,
            target_video=query.reference_video,
            target_frames=target,
            start_pose=episode.poses[query.t].copy(),
            reference_poses=query.reference_poses,
            reference_stop=query.reference_stop,
            goal=episode.goal,
            success_radius=episode.success_radius,
            events=query.events,
            expert_actions=actions,
            occupancy=episode.scene_id,
            split=split,
        )
        for k, instruction in enumerate(episode.instructions)
    ]


def _check_video(path: Path, expected_frames: int, mismatch_reason: str, what: str) -> None:
    """Raises RecordRejected unless ``path`` exists, has ``expected_frames`` frames and its last frame decodes.

    Decoding the last frame catches files whose header is intact but whose data is truncated or corrupted
    (the header frame count alone would not), at the cost of one GOP of decoding per video.
    """
    from verl_omni.data.video import VideoError, count_frames, read_frames

    if not path.is_file():
        raise RecordRejected("missing_file", f"{path}: {what} not found")
    try:
        n = count_frames(path)
    except (VideoError, OSError) as e:
        raise RecordRejected("unreadable_video", f"{path}: {what} cannot be read ({e})") from e
    if n != expected_frames:
        raise RecordRejected(mismatch_reason, f"{path}: {what} has {n} frames, expected {expected_frames}")
    try:
        read_frames(path, [n - 1])
    except (VideoError, OSError, ValueError) as e:
        raise RecordRejected("unreadable_video", f"{path}: {what} cannot be decoded ({e})") from e


# Per-process cache of scene checks: each worker loads an occupancy scene at most once.
_SCENE_CHECKS: dict[tuple[str, str], RecordRejected | None] = {}


def check_scene(occupancy_root: str, scene_id: str) -> None:
    """Raises RecordRejected (``unknown_scene`` / ``unreadable_scene``) unless the scene loads."""
    key = (occupancy_root, scene_id)
    if key not in _SCENE_CHECKS:
        _SCENE_CHECKS[key] = _load_scene_problem(Path(occupancy_root) / scene_id)
    problem = _SCENE_CHECKS[key]
    if problem is not None:
        raise problem


def _load_scene_problem(scene_dir: Path) -> RecordRejected | None:
    from verl_omni.data.occupancy import OccupancyError, OccupancyMap

    if not scene_dir.is_dir():
        return RecordRejected("unknown_scene", f"{scene_dir}: no such occupancy scene directory")
    missing = [name for name in OCCUPANCY_FILES if not (scene_dir / name).is_file()]
    if missing:
        return RecordRejected("unknown_scene", f"{scene_dir}: missing {missing}")
    try:
        OccupancyMap.load(scene_dir)
    except (OccupancyError, OSError, ValueError) as e:
        return RecordRejected("unreadable_scene", f"{scene_dir}: {e}")
    return None


def convert_episode(task: EpisodeTask) -> EpisodeResult:
    """Validates one episode and converts its valid query records (never raises for data problems)."""
    root = Path(task.input_root)
    try:
        episode = parse_episode(root, task.episode_id)
    except RecordRejected as e:
        return EpisodeResult(task.episode_id, None, skipped=[SkippedItem(task.episode_id, None, e.reason, e.detail)])
    result = EpisodeResult(task.episode_id, episode.scene_id)
    result.skipped.extend(SkippedItem(task.episode_id, t, e.reason, e.detail) for t, e in episode.rejected_queries)
    try:
        check_scene(task.occupancy_root, episode.scene_id)
        _check_video(root / episode.video, len(episode.poses), "pose_frame_mismatch", "episode video")
    except RecordRejected as e:
        result.skipped.insert(0, SkippedItem(task.episode_id, None, e.reason, e.detail))
        return result
    normalization = ActionNormalization.from_dict(task.normalization)
    split = task.split or episode_split(task.episode_id, task.val_fraction, task.split_seed)
    for query in episode.queries:
        try:
            _check_video(root / query.reference_video, TARGET_FRAMES, "reference_frame_mismatch", "reference video")
        except RecordRejected as e:
            result.skipped.append(SkippedItem(task.episode_id, query.t, e.reason, e.detail))
            continue
        result.rows.extend(rows_for_query(episode, query, normalization, split))
        result.records += 1
    result.rows.sort(key=lambda r: r.sample_id)
    result.skipped.sort(key=lambda s: (-1 if s.t is None else s.t, s.reason, s.detail))
    return result


def iter_episode_results(tasks: Iterable[EpisodeTask], workers: int, prefetch: int) -> Iterator[EpisodeResult]:
    """Runs :func:`convert_episode` over ``tasks`` and yields results in input order.

    Args:
        tasks: Episode jobs, in the order results should come back.
        workers: Worker processes; 1 runs in this process (no pickling, no start-up cost).
        prefetch: Jobs in flight per worker; at most ``workers * prefetch`` results are held at once,
            which bounds memory on large collections (``Pool.imap`` would queue every job up front).
    """
    if workers < 1 or prefetch < 1:
        raise ValueError(f"workers and prefetch must be >= 1, got {workers} and {prefetch}")
    if workers == 1:
        for task in tasks:
            yield convert_episode(task)
        return
    window = workers * prefetch
    # spawn: workers start clean even when the parent already imported torch (fork after torch's thread
    # pools have started can deadlock).
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        pending: deque[Future] = deque()
        it = iter(tasks)
        for task in it:
            pending.append(pool.submit(convert_episode, task))
            if len(pending) >= window:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(convert_episode, nxt))
            yield result


@dataclass
class ConversionTally:
    """Running counts of a conversion (the manifest's ``counts`` and ``skipped_items``)."""

    episodes: int = 0
    episodes_converted: int = 0
    records: int = 0
    rows: int = 0
    rows_by_split: Counter = field(default_factory=Counter)
    skipped_items: list[SkippedItem] = field(default_factory=list)
    scenes: set[str] = field(default_factory=set)

    def add(self, result: EpisodeResult) -> None:
        self.episodes += 1
        self.episodes_converted += bool(result.rows)
        self.records += result.records
        self.rows += len(result.rows)
        self.rows_by_split.update(r.split for r in result.rows)
        self.skipped_items.extend(result.skipped)
        self.scenes.update(r.scene_id for r in result.rows)

    def counts(self) -> dict:
        by_reason = Counter(s.reason for s in self.skipped_items)
        return {
            "episodes": self.episodes,
            "episodes_converted": self.episodes_converted,
            "records": self.records,
            "rows": self.rows,
            "rows_by_split": {split: self.rows_by_split.get(split, 0) for split in ("train", "val")},
            "skipped": len(self.skipped_items),
            "skipped_by_reason": {reason: by_reason.get(reason, 0) for reason in SKIP_REASONS},
        }


def run_conversion(
    tasks: Sequence[EpisodeTask],
    workers: int,
    prefetch: int,
    sink: Callable[[EpisodeResult], None],
    desc: str = "episodes",
) -> ConversionTally:
    """Converts ``tasks`` in order with a progress bar, passing each result to ``sink``; returns the tally."""
    from tqdm import tqdm

    tally = ConversionTally()
    with tqdm(total=len(tasks), desc=desc, unit="ep", dynamic_ncols=True) as bar:
        for result in iter_episode_results(tasks, workers, prefetch):
            tally.add(result)
            sink(result)
            bar.update(1)
            bar.set_postfix(rows=tally.rows, skipped=len(tally.skipped_items), refresh=False)
    return tally


def scene_fingerprints(occupancy_root: str | Path, scene_ids: Iterable[str]) -> dict[str, str]:
    """sha256 of ``occupancy.png`` and ``occupancy.json`` of each scene (hex digests joined by ``:``).

    Recorded in manifests so that a later change of a scene under the same name is detectable.
    """
    root = Path(occupancy_root)
    return {s: ":".join(file_sha256(root / s / name) for name in OCCUPANCY_FILES) for s in sorted(set(scene_ids))}
