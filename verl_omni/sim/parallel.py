"""Process-pool helpers shared by the synthesizer and the DAgger collector."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def map_jobs(fn: Callable[[Any], Any], jobs: Sequence, workers: int, desc: str, unit: str, progress: bool = True):
    """Runs ``fn`` over ``jobs`` in ``workers`` spawned processes (in this process for 1), with a progress bar.

    ``spawn`` keeps workers clean (no inherited threads or open video handles). Results come in completion
    order; callers sort them when order matters.

    Returns:
        The list of results.
    """
    from tqdm import tqdm

    results = []
    with tqdm(total=len(jobs), desc=desc, unit=unit, disable=not progress) as bar:
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                results.append(fn(job))
                bar.update()
        else:
            with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
                for r in pool.imap_unordered(fn, jobs):
                    results.append(r)
                    bar.update()
    return results


def refuse_nonempty_dir(path: Path, flag: str) -> None:
    """Exits with a message when an output folder exists and is not an empty directory (nothing is written)."""
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {flag} {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise SystemExit(f"error: {flag} {path} is not empty; choose a new or empty directory (nothing was written)")
