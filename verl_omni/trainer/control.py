"""A small named Ray actor through which tools talk to a live training run.

The driver creates it in the run's Ray namespace as ``wnm_stage3_control`` and, between optimizer steps,
drains its queue of snapshot requests (``tools/checkpoint/hot_save_verl_fsdp.py``). Snapshots are
therefore always taken at a step boundary: the model, optimizer and data position belong to one step.

Nothing here touches the model: the actor only stores requests, run facts and results.
"""

from __future__ import annotations

import time
import uuid

CONTROL_NAME = "wnm_stage3_control"
DEFAULT_NAMESPACE = "wnm_stage3"


class RunControl:
    """State shared between the driver and external tools (run inside a Ray actor)."""

    def __init__(self, info: dict) -> None:
        self._info = dict(info)
        self._queue: list[dict] = []
        self._results: dict[str, dict] = {}

    def info(self) -> dict:
        """Run facts: driver pid and host, output dir, world size, current step, expected snapshot bytes."""
        return dict(self._info)

    def update_info(self, **kw) -> None:
        self._info.update(kw)

    def request_snapshot(self, destination: str) -> str:
        """Queues a snapshot into ``destination``; returns its request id."""
        rid = uuid.uuid4().hex[:12]
        self._queue.append({"id": rid, "destination": destination, "requested_at": time.time()})
        self._results[rid] = {"state": "pending", "destination": destination}
        return rid

    def pop_requests(self) -> list[dict]:
        out, self._queue = self._queue, []
        for r in out:
            self._results[r["id"]]["state"] = "running"
        return out

    def complete(self, request_id: str, result: dict) -> None:
        self._results[request_id] = {**self._results.get(request_id, {}), **result}

    def status(self, request_id: str) -> dict:
        return dict(self._results.get(request_id, {"state": "unknown"}))
