"""Expert examples of a GN0 collection: the query states SFT learns from, and the held-out split of episodes.

Per query state t of an episode: history = ``rgb.mp4`` frames ``t-32 .. t`` (clamped at 0), target = the 33
frames of ``ref_<t>.mp4``, expert actions = ``poses_to_actions(reference_poses, reference_stop)``, and the goal's
bearing and distance from the query pose, and where the goal object is drawn in the current frame (auxiliary SFT
targets, :mod:`.goal_probe`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from verl_omni.data.actions import poses_to_actions

from .goal_probe import goal_polar, object_view_target


@dataclass
class ExpertExample:
    """One query state of the expert data.

    Attributes:
        episode_id: Source episode.
        history: uint8 ``[33, H, W, 3]``.
        target: uint8 ``[33, H, W, 3]``.
        actions: float64 ``[32, 4]`` raw expert actions.
        instructions: Instruction variants of the episode.
        goal_polar: float32 ``[3]`` goal bearing and distance in the robot frame (:func:`goal_probe.goal_polar`).
        goal_view: float32 ``[4]`` the goal object in the current frame (:func:`goal_probe.object_view_target`);
            None when the record does not say (collections synthesized before the field existed).
    """

    episode_id: str
    history: np.ndarray
    target: np.ndarray
    actions: np.ndarray
    instructions: tuple[str, ...]
    goal_polar: np.ndarray | None = None
    goal_view: np.ndarray | None = None


def history_indices(t: int, frames: int) -> list[int]:
    """Frame indices ``t - frames + 1 .. t`` clamped at 0 (as the converted rows, :mod:`verl_omni.data.schema`)."""
    return [max(0, t - frames + 1 + i) for i in range(frames)]


def _episode_examples(job: tuple[str, str, int]) -> list[ExpertExample]:
    """The query states of one episode (a module-level function so process pools can pickle it)."""
    from verl_omni.data.gn0 import RecordRejected, parse_episode
    from verl_omni.data.video import read_frames

    root, episode_id, history_frames = job
    root = Path(root)
    try:
        ep = parse_episode(root, episode_id)
    except RecordRejected:
        return []  # the converter reports rejected records; SFT simply learns from the valid ones
    out = []
    # One forward decode of the episode video serves every query (a seek per query costs far more).
    last = max((q.t for q in ep.queries), default=-1)
    frames = read_frames(root / ep.video, list(range(last + 1))) if last >= 0 else None
    for q in ep.queries:
        history = frames[history_indices(q.t, history_frames)]
        target = read_frames(root / q.reference_video, list(range(len(q.reference_poses))))
        actions = poses_to_actions(q.reference_poses, q.reference_stop)
        polar = goal_polar(ep.poses[q.t], ep.goal)
        view = None
        if q.goal_object_bearing is not None and q.goal_object_distance is not None:
            view = object_view_target(q.goal_object_bearing, q.goal_object_distance)
        out.append(ExpertExample(episode_id, history, target, actions, tuple(ep.instructions), polar, view))
    return out


def iter_expert_examples(
    collection: str | Path,
    history_frames: int,
    image_size: tuple[int, int],
    progress: bool = True,
    workers: int = 1,
    episode_ids: list[str] | None = None,
) -> Iterator[ExpertExample]:
    """Yields every valid query of a GN0 collection (skipping rejected records), in episode order.

    Args:
        collection: Collection root.
        history_frames / image_size: What the model needs.
        progress: Show a progress bar.
        workers: Processes decoding episodes (video decoding dominates; results keep episode order).
        episode_ids: Only these episodes (default: all of the collection).

    Raises:
        ValueError: the collection's image size differs from the model's (names both), or an episode id is unknown.
    """
    from concurrent.futures import ProcessPoolExecutor

    from verl_omni.data.gn0 import list_episode_ids, read_collection_info

    info = read_collection_info(collection)
    if tuple(info.image_size) != tuple(image_size):
        raise ValueError(
            f"{info.root / 'collection.json'}: field 'image_size' is {list(info.image_size)}, the model needs "
            f"{list(image_size)}; pick a matching --size or re-synthesize the collection"
        )
    known = list_episode_ids(info.root)
    if episode_ids is None:
        episode_ids = known
    else:
        missing = sorted(set(episode_ids) - set(known))
        if missing:
            raise ValueError(f"{info.root}: unknown episode ids {missing[:5]} ({len(missing)} in all)")
    jobs = [(str(info.root), eid, history_frames) for eid in episode_ids]
    bar = tqdm(total=len(jobs), desc="read episodes", disable=not progress)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield from _episode_examples(job)
            bar.update()
    else:
        # Processes, not threads: converting decoded frames to arrays holds the GIL (measured: 16 threads
        # decoded no faster than 4.5 episodes/s). Pickling the arrays back costs a memcpy per frame.
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            for part in pool.map(_episode_examples, jobs, chunksize=1):  # map keeps episode order
                yield from part
                bar.update()
    bar.close()


def load_expert_examples(
    collection: str | Path,
    history_frames: int,
    image_size: tuple[int, int],
    progress: bool = True,
    workers: int = 1,
    episode_ids: list[str] | None = None,
) -> list[ExpertExample]:
    """:func:`iter_expert_examples` as a list.

    Raises:
        ValueError: as :func:`iter_expert_examples`, or the collection has no valid query record.
    """
    examples = list(iter_expert_examples(collection, history_frames, image_size, progress, workers, episode_ids))
    if not examples:
        raise ValueError(f"{collection}: no valid query records")
    return examples


def subsample(examples: list[ExpertExample], max_examples: int) -> list[ExpertExample]:
    """At most ``max_examples`` examples, evenly spaced over the (episode-ordered) list."""
    if len(examples) <= max_examples:
        return examples
    keep = np.linspace(0, len(examples) - 1, max_examples).round().astype(int)
    return [examples[i] for i in keep]


_GOAL_VARIANT_SUFFIX = re.compile(r"_g\d+$")


def episode_group(episode_id: str) -> str:
    """The driven episode an id belongs to: goal variants ``<id>_g<k>`` (same states, other goal) go with ``<id>``."""
    return _GOAL_VARIANT_SUFFIX.sub("", episode_id)


def split_episode_ids(episode_ids: list[str], heldout_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Holds out whole driven episodes with all their goal variants (at least one, at most all but one).

    Returns:
        ``(train_ids, heldout_ids)``, sorted.
    """
    groups = sorted({episode_group(e) for e in episode_ids})
    if len(groups) < 2:
        raise ValueError(f"need >= 2 episodes to hold one out, the collection has {len(groups)}")
    order = np.random.default_rng(seed).permutation(len(groups))
    n_held = min(len(groups) - 1, max(1, round(heldout_fraction * len(groups))))
    held = {groups[i] for i in order[:n_held]}
    episodes = sorted(set(episode_ids))
    return [e for e in episodes if episode_group(e) not in held], [e for e in episodes if episode_group(e) in held]


def split_by_episode(examples: list[ExpertExample], heldout_fraction: float, seed: int):
    """Examples split as :func:`split_episode_ids` splits their episodes. Returns ``(train, heldout)``."""
    _, held_ids = split_episode_ids([e.episode_id for e in examples], heldout_fraction, seed)
    held = set(held_ids)
    return [e for e in examples if e.episode_id not in held], [e for e in examples if e.episode_id in held]
