"""Closed-loop episodes over a pool of processes, each with its own copy of the policy.

:func:`~verl_omni.sim.closed_loop.run_closed_loop` renders, plans and steps every episode in one process,
which made rendering (about 2 ms a frame) and the expert's A* the bottleneck of evaluation and DAgger
collection. Here the episodes are cut into chunks; every worker process builds the policy once (from a
picklable factory, e.g. ``functools.partial(WNMPolicy.from_checkpoint, path, device="cuda")``: each worker
then holds its own small model on the GPU) and runs the ordinary loop over the chunks it is given. The
results are exactly those of the single-process loop up to the float rounding of how episodes share a
batch: every episode's noise is keyed by its own seed, episode id and call index.

Policies that keep per-episode bookkeeping expose ``episode_info(episode_id) -> dict``; it is collected
from the workers with the results.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping, Sequence

from verl_omni.sim.closed_loop import ClosedLoopConfig, EpisodeResult, EpisodeSpec, run_closed_loop
from verl_omni.sim.floorplan import FloorPlan

_WORKER: dict = {}


def _init_worker(policy_factory: Callable[[], object], plans: Mapping[str, FloorPlan], config) -> None:
    _WORKER["policy"] = policy_factory()
    _WORKER["plans"] = plans
    _WORKER["config"] = config


def _run_chunk(job: tuple[int, list[EpisodeSpec]]) -> tuple[int, list[EpisodeResult], dict]:
    index, specs = job
    policy = _WORKER["policy"]
    results = run_closed_loop(policy, _WORKER["plans"], specs, _WORKER["config"], progress=False)
    info = getattr(policy, "episode_info", None)
    extras = {s.episode_id: info(s.episode_id) for s in specs} if info else {}
    return index, results, extras


def reuse_when_in_process(factory: Callable[[], object], built: object, workers: int) -> Callable[[], object]:
    """The factory to hand to :func:`run_closed_loop_pool` when the caller already built one policy.

    With one worker the episodes run in this process, so the built policy is reused instead of loading the
    checkpoint a second time; with more, every worker needs its own copy and the (picklable) factory is kept.
    """
    return (lambda: built) if workers <= 1 else factory


def chunk_specs(specs: Sequence[EpisodeSpec], workers: int, per_worker: int = 2) -> list[list[EpisodeSpec]]:
    """Contiguous chunks, about ``per_worker`` per worker (more chunks: a finer progress bar and balance)."""
    n = max(1, min(len(specs), workers * per_worker))
    size = -(-len(specs) // n)
    return [list(specs[i : i + size]) for i in range(0, len(specs), size)]


def run_closed_loop_pool(
    policy_factory: Callable[[], object],
    plans: Mapping[str, FloorPlan],
    specs: Sequence[EpisodeSpec],
    config: ClosedLoopConfig | None = None,
    workers: int = 1,
    progress: bool = True,
    desc: str = "episodes",
) -> tuple[list[EpisodeResult], dict[str, dict]]:
    """Runs every episode to its end in ``workers`` spawned processes.

    Args:
        policy_factory: Picklable zero-argument callable that builds the policy (called once per worker).
        plans: Scene id -> floor plan of every scene the specs use.
        specs: Episodes (unique ids).
        config: Execution settings.
        workers: Processes; 1 runs in this process.
        progress: Show a bar (one tick per finished chunk's episodes).
        desc: Bar label.

    Returns:
        ``(results in spec order, {episode_id: policy.episode_info(episode_id)})`` (empty when the policy has
        no ``episode_info``).
    """
    from tqdm import tqdm

    if not specs:
        raise ValueError("run_closed_loop_pool: no episodes")
    if workers <= 1:
        policy = policy_factory()
        results = run_closed_loop(policy, plans, specs, config, progress=progress, desc=desc)
        info = getattr(policy, "episode_info", None)
        return results, ({s.episode_id: info(s.episode_id) for s in specs} if info else {})
    used = {s.scene_id for s in specs}
    plans = {k: v for k, v in plans.items() if k in used}  # only what the episodes need travels to the workers
    chunks = chunk_specs(specs, workers)
    by_chunk: dict[int, list[EpisodeResult]] = {}
    extras: dict[str, dict] = {}
    # spawn: workers start clean (no inherited CUDA context, threads or open files of this process).
    ctx = multiprocessing.get_context("spawn")
    with tqdm(total=len(specs), desc=desc, unit="ep", disable=not progress) as bar:
        with ctx.Pool(min(workers, len(chunks)), _init_worker, (policy_factory, plans, config)) as pool:
            for index, results, info in pool.imap_unordered(_run_chunk, list(enumerate(chunks))):
                by_chunk[index] = results
                extras.update(info)
                bar.update(len(results))
    return [r for i in range(len(chunks)) for r in by_chunk[i]], extras
