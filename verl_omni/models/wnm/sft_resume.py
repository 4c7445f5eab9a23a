"""Snapshots of a running SFT, so that a run cut off mid-training (a GPU call's time limit, a crash) goes on
from its last snapshot instead of from step 0.

A snapshot holds everything the next step depends on: the trained modules' weights, the optimizer state, the
state of the CPU generator that draws rows and noise, and the loss curve so far. Resuming from it gives the same
weights as an uninterrupted run (bit for bit on the CPU). Snapshots are written under a temporary name and
renamed, so a kill during a save leaves the previous snapshot readable. A snapshot records the settings it was
taken under (``fingerprint``); one taken under other settings is discarded, never continued.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch


class SFTResume:
    """The snapshot file of one SFT run.

    Args:
        path: The snapshot file (its folder is created).
        every_s: Seconds of training between snapshots (0 = after every step).
        log: Where messages about loading and discarding snapshots go.
    """

    def __init__(self, path: Path, every_s: float = 30.0, log: Callable[[str], None] = print) -> None:
        if every_s < 0:
            raise ValueError(f"SFTResume.every_s: must be >= 0, got {every_s}")
        self.path = Path(path)
        self.every_s = float(every_s)
        self.log = log
        self._last = time.monotonic()

    @staticmethod
    def _canonical(fingerprint: dict) -> dict:
        return json.loads(json.dumps(fingerprint, sort_keys=True))  # as read back (tuples become lists)

    def load(self, fingerprint: dict) -> dict | None:
        """The saved snapshot of a run with this ``fingerprint``, or None (none saved, unreadable or another run's)."""
        if not self.path.is_file():
            return None
        try:
            # Our own file (written by save() in a run folder); it holds plain containers and tensors.
            snap = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated or from another version of the code: train from the start
            self.log(f"{self.path}: unreadable SFT snapshot ({type(e).__name__}: {e}); training from step 0")
            return None
        if snap.get("fingerprint") != self._canonical(fingerprint):
            self.log(f"{self.path}: SFT snapshot of other settings; training from step 0")
            return None
        self.log(f"{self.path.name}: resuming SFT after step {snap['step']}")
        return snap

    def due(self) -> bool:
        """Whether ``every_s`` has passed since the last snapshot (or since this object was made)."""
        return time.monotonic() - self._last >= self.every_s

    def save(self, fingerprint: dict, snapshot: dict) -> None:
        """Writes ``snapshot`` (with ``fingerprint``) atomically and restarts the clock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".partial")
        torch.save({**snapshot, "fingerprint": self._canonical(fingerprint)}, tmp)
        tmp.replace(self.path)
        self._last = time.monotonic()

    def clear(self) -> None:
        """Removes the snapshot (the run it belongs to is saved elsewhere)."""
        self.path.unlink(missing_ok=True)
