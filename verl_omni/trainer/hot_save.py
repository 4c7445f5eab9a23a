"""The driver's side of hot save: the named control actor and the snapshots it queues.

Tools (``tools/checkpoint/hot_save_verl_fsdp.py``) queue a snapshot request on the run's
:class:`~verl_omni.trainer.control.RunControl` actor; the driver serves the queue at each step boundary, so a
snapshot holds the model, optimizer and data position of one step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from verl_omni.trainer import checkpointing
from verl_omni.trainer.config import ConfigError


class HotSaveService:
    """Owns the run's control actor and writes the snapshots queued on it.

    Args:
        namespace: The run's Ray namespace (one control actor per namespace).
        facts: Run facts the tools read (driver pid, output dir, world size, expected snapshot size, ...).

    Raises:
        ConfigError: another run already owns ``namespace`` (the launch must name another one).
    """

    def __init__(self, namespace: str, facts: dict) -> None:
        import ray

        from verl_omni.trainer.control import CONTROL_NAME, RunControl

        try:
            ray.get_actor(CONTROL_NAME, namespace=namespace)
            taken = True
        except ValueError:  # no such actor: the namespace is ours
            taken = False
        if taken:
            raise ConfigError(
                f"another Stage-III run already owns Ray namespace {namespace!r}; set "
                f"WAM_RAY_NAMESPACE to a different name for this run"
            )
        facts = {"driver_pid": os.getpid(), "driver_host": socket.gethostname(), "namespace": namespace, **facts}
        self.control = ray.remote(RunControl).options(name=CONTROL_NAME, namespace=namespace, num_cpus=0).remote(facts)
        ray.get(self.control.info.remote())

    def serve(
        self,
        step: int,
        write_snapshot: Callable[[Path], dict],
        failures: tuple[type[BaseException], ...] = (OSError,),
        log: Callable[[str], None] = print,
    ) -> None:
        """Writes every queued snapshot now, at the boundary after ``step``.

        Args:
            step: The step just finished.
            write_snapshot: Writes the actor's state under ``DIR/actor`` and returns the trainer state to record.
            failures: Errors that fail one request (reported to the tool) instead of the run.
            log: Where progress lines go.
        """
        import ray

        ray.get(self.control.update_info.remote(step=step))
        for req in ray.get(self.control.pop_requests.remote()):
            dest = Path(req["destination"])
            t0 = time.perf_counter()
            try:
                if dest.exists():
                    raise FileExistsError(f"{dest} already exists; choose a new destination")
                part = dest.with_name(dest.name + ".partial")
                if part.exists():
                    shutil.rmtree(part)
                (part / "actor").mkdir(parents=True)
                state = write_snapshot(part)
                checkpointing.atomic_write_text(
                    part / checkpointing.TRAINER_STATE, json.dumps(state, indent=2, sort_keys=True) + "\n"
                )
                checkpointing.write_files_manifest(part, step)
                part.rename(dest)
                result = {"state": "done", "path": str(dest), "step": step, "seconds": time.perf_counter() - t0}
                log(f"hot-save snapshot of step {step} written to {dest}")
            except failures as e:
                result = {"state": "failed", "error": f"{type(e).__name__}: {e}", "step": step}
                log(f"hot-save snapshot to {dest} failed: {e}")
            ray.get(self.control.complete.remote(req["id"], result))
