#!/usr/bin/env python
"""Snapshot the actor of a live Stage-III run (model, optimizer, RNG, data position) without stopping it.

Without --execute the tool only runs a read-only preflight and never writes anything:

    Ray          connects to the run's Ray cluster (--ray-address) and finds the run's control actor
                 (wnm_stage3_control) in --namespace
    driver       the trainer process is alive (checked with a signal 0 when it runs on this host)
    workers      the run's actor world size equals --expected-workers (when given)
    destination  --destination does not exist (nor its .partial sibling) and its filesystem has room for
                 the expected snapshot size times --space-margin

With --execute, after a passing preflight, the snapshot is requested: the driver serves it at the next step
boundary (the workers write between optimizer steps, so model, optimizer and data position belong to one
step) into --destination/actor/ plus trainer_state.json. The tool polls until it is done, failed or
--timeout expires. The snapshot is an actor checkpoint: export it like any global_step_N.

Example:
    python tools/checkpoint/hot_save_verl_fsdp.py --destination /ckpt/hot/step_now --expected-workers 8
    python tools/checkpoint/hot_save_verl_fsdp.py --destination /ckpt/hot/step_now --expected-workers 8 --execute

Exit codes: 0 preflight passed (and, with --execute, the snapshot was written); 2 preflight failed or bad
arguments, nothing requested or written; 3 snapshot requested but failed, timed out or the run ended first.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXIT_OK, EXIT_PREFLIGHT, EXIT_SNAPSHOT = 0, 2, 3
INFO_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Check:
    """One preflight line. ``ok`` is None for facts that cannot be checked from here (not a failure)."""

    name: str
    ok: bool | None
    detail: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from verl_omni.trainer.control import DEFAULT_NAMESPACE

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--destination", required=True, type=Path, help="snapshot directory to create (must not exist)")
    p.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or "auto",
        help="Ray cluster of the run (default: $RAY_ADDRESS, else 'auto' = the cluster started on this machine)",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("WAM_RAY_NAMESPACE") or DEFAULT_NAMESPACE,
        help=f"Ray namespace of the run (default: $WAM_RAY_NAMESPACE, else {DEFAULT_NAMESPACE})",
    )
    p.add_argument("--expected-workers", type=int, help="actor world size the run must have (checked when given)")
    p.add_argument(
        "--space-margin",
        type=float,
        default=1.1,
        help="free space needed = expected snapshot size x this factor (default 1.1)",
    )
    p.add_argument("--execute", action="store_true", help="request the snapshot after a passing preflight")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the snapshot (default 3600)")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between status polls (default 2)")
    args = p.parse_args(argv)
    if args.expected_workers is not None and args.expected_workers < 1:
        p.error(f"--expected-workers must be >= 1, got {args.expected_workers}")
    if args.space_margin < 1.0:
        p.error(f"--space-margin must be >= 1.0, got {args.space_margin}")
    if args.timeout <= 0 or args.poll_interval <= 0:
        p.error("--timeout and --poll-interval must be > 0")
    return args


# ----- checks (pure apart from the filesystem / process probes they are given) --------------------------
def check_driver_alive(info: dict, hostname: str, kill: Callable[[int, int], None] = os.kill) -> Check:
    """Signal 0 to the driver pid when it runs on this host (PermissionError still means it exists)."""
    pid, host = info.get("driver_pid"), info.get("driver_host")
    if not isinstance(pid, int):
        return Check("driver", False, f"control actor reports no driver pid (info: {info})")
    if host != hostname:
        # Ray ends a non-detached named actor with its driver, so an answering control actor implies a live driver.
        return Check(
            "driver", None, f"pid {pid} runs on {host}, not this host ({hostname}); the control actor answered"
        )
    try:
        kill(pid, 0)
    except ProcessLookupError:
        return Check("driver", False, f"pid {pid} on {host} is not running; the run is gone")
    except PermissionError:
        pass
    return Check("driver", True, f"pid {pid} on {host} is alive")


def check_workers(info: dict, expected: int | None) -> Check:
    world = info.get("world_size")
    if expected is None:
        return Check("workers", None, f"run has {world} actor worker(s) (pass --expected-workers to check)")
    if world != expected:
        return Check("workers", False, f"run has {world} actor worker(s), --expected-workers is {expected}")
    return Check("workers", True, f"{world} actor worker(s), as expected")


def check_destination(
    dest: Path, expected_bytes: int, margin: float, disk_usage: Callable[[Path], object] = shutil.disk_usage
) -> Check:
    """Destination absent (and its ``.partial`` sibling, which the driver would replace) with enough room."""
    partial = dest.with_name(dest.name + ".partial")
    if dest.exists() or dest.is_symlink():
        return Check("destination", False, f"{dest} already exists; choose a new --destination")
    if partial.exists():
        return Check(
            "destination", False, f"{partial} exists (an earlier snapshot attempt?); remove it or choose another name"
        )
    anchor = dest.parent
    while not anchor.exists():
        anchor = anchor.parent
    if not os.access(anchor, os.W_OK):
        return Check("destination", False, f"{anchor} is not writable")
    free = int(disk_usage(anchor).free)
    need = int(expected_bytes * margin)
    if free < need:
        return Check(
            "destination",
            False,
            f"{anchor} has {free / 2**30:.2f} GiB free, the snapshot needs about {need / 2**30:.2f} GiB "
            f"({expected_bytes / 2**30:.2f} GiB x margin {margin})",
        )
    return Check("destination", True, f"{dest} is free; {free / 2**30:.2f} GiB free >= {need / 2**30:.3f} GiB needed")


def print_checks(checks: list[Check]) -> None:
    marks = {True: "ok  ", False: "FAIL", None: "info"}
    for c in checks:
        print(f"  [{marks[c.ok]}] {c.name:<12} {c.detail}")


# ----- Ray side -----------------------------------------------------------------------------------------
def check_reachable(address: str, timeout: float = 5.0) -> Check | None:
    """A failing check when ``HOST:PORT`` does not accept connections (Ray itself retries for minutes)."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return Check("ray", False, f"--ray-address {address!r} must be HOST:PORT or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return Check("ray", False, f"nothing answers at {address} ({e}); is the run's Ray head there?")


def connect(address: str, namespace: str):
    """Connects this process to the run's cluster as a Ray driver (writes nothing of ours)."""
    if not os.environ.get("RAY_AUTH_MODE"):
        # Same rule as launch.sh: a cluster started where a Ray auth token exists uses token authentication.
        token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or token_file.is_file()
        os.environ["RAY_AUTH_MODE"] = "token" if has_token else "disabled"
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
    return ray


def find_control(ray, namespace: str) -> tuple[object | None, Check]:
    from verl_omni.trainer.control import CONTROL_NAME

    try:
        return ray.get_actor(CONTROL_NAME, namespace=namespace), Check(
            "ray", True, f"control actor {CONTROL_NAME} found in namespace {namespace!r}"
        )
    except ValueError:
        others = sorted(
            a["namespace"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("name") == CONTROL_NAME and a.get("namespace") != namespace
        )
        hint = f"; runs found in namespace(s) {others}, pass --namespace" if others else "; is the run started?"
        return None, Check("ray", False, f"no {CONTROL_NAME} in namespace {namespace!r}{hint}")


def preflight(ray, control, args: argparse.Namespace, dest: Path) -> tuple[dict, list[Check]]:
    info = ray.get(control.info.remote(), timeout=INFO_TIMEOUT_S)
    checks = [
        Check(
            "run",
            None,
            f"step {info.get('step')} of {info.get('output_dir')} (namespace {info.get('namespace')}); "
            f"expected snapshot {int(info.get('expected_snapshot_bytes', 0)) / 2**20:.1f} MiB",
        ),
        check_driver_alive(info, socket.gethostname()),
        check_workers(info, args.expected_workers),
        check_destination(dest, int(info.get("expected_snapshot_bytes", 0)), args.space_margin),
    ]
    return info, checks


def wait_for_snapshot(ray, control, request_id: str, timeout: float, poll: float) -> dict:
    """Polls the request until it is done or failed; returns its final status (``state`` 'timeout' on expiry)."""
    from tqdm import tqdm

    t0 = time.monotonic()
    status: dict = {"state": "pending"}
    with tqdm(total=round(timeout), unit="s", desc="snapshot", bar_format="{desc}: {n:.0f}s waited{postfix}") as bar:
        while True:
            status = ray.get(control.status.remote(request_id), timeout=INFO_TIMEOUT_S)
            step = ray.get(control.info.remote(), timeout=INFO_TIMEOUT_S).get("step")
            bar.n = time.monotonic() - t0
            bar.set_postfix_str(f"state={status.get('state')} run step={step}")
            if status.get("state") in ("done", "failed"):
                return status
            if time.monotonic() - t0 > timeout:
                return {**status, "state": "timeout", "last_state": status.get("state")}
            time.sleep(poll)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def execute(ray, control, args: argparse.Namespace, dest: Path) -> int:
    rid = ray.get(control.request_snapshot.remote(str(dest)), timeout=INFO_TIMEOUT_S)
    print(f"\nrequested snapshot {rid} into {dest}; the driver writes it at the next step boundary")
    try:
        status = wait_for_snapshot(ray, control, rid, args.timeout, args.poll_interval)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
        print(
            f"error: the run stopped answering before serving the snapshot ({type(e).__name__}); nothing was "
            f"written by this request. Use the run's last global_step_N checkpoint instead.",
            file=sys.stderr,
        )
        return EXIT_SNAPSHOT
    state = status.get("state")
    if state == "failed":
        print(f"error: snapshot failed at step {status.get('step')}: {status.get('error')}", file=sys.stderr)
        return EXIT_SNAPSHOT
    if state == "timeout":
        print(
            f"error: no snapshot after {args.timeout:.0f}s (state {status.get('last_state')}); the request "
            f"stays queued and the driver will still write {dest} at its next step boundary",
            file=sys.stderr,
        )
        return EXIT_SNAPSHOT
    path = Path(status["path"])
    print(f"\nsnapshot of step {status.get('step')} written to {path} in {status.get('seconds', 0.0):.1f}s")
    if path.is_dir():
        missing = [
            n
            for n in ("actor/.metadata", "actor/model_contract.json", "trainer_state.json")
            if not (path / n).is_file()
        ]
        if missing:
            print(f"error: {path} lacks {missing}; the snapshot is incomplete", file=sys.stderr)
            return EXIT_SNAPSHOT
        print(f"  size {_dir_bytes(path) / 2**20:.1f} MiB")
        print(
            "  export it: python tools/checkpoint/export_wnm_checkpoint.py --base-vln <initial checkpoint> "
            f"--actor-checkpoint {path} --output-dir <new dir>"
        )
    else:
        print(f"  (written on the driver's host; {path} is not visible from here)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dest = args.destination.expanduser().absolute()  # the driver has another working directory
    print(f"hot save preflight (read-only): Ray {args.ray_address}, namespace {args.namespace!r}")
    unreachable = check_reachable(args.ray_address)
    try:
        if unreachable is not None:
            raise ConnectionError(unreachable.detail)
        ray = connect(args.ray_address, args.namespace)
    except Exception as e:  # ConnectionError, RuntimeError, ValueError depending on how the address is wrong
        print_checks([Check("ray", False, f"cannot connect to {args.ray_address!r}: {e}")])
        print("preflight FAILED: set --ray-address (or RAY_ADDRESS) to the run's Ray head", file=sys.stderr)
        return EXIT_PREFLIGHT
    try:
        control, found = find_control(ray, args.namespace)
        if control is None:
            print_checks([found])
            print("preflight FAILED", file=sys.stderr)
            return EXIT_PREFLIGHT
        try:
            _, checks = preflight(ray, control, args, dest)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            print_checks([found, Check("run", False, f"control actor does not answer ({type(e).__name__})")])
            print("preflight FAILED", file=sys.stderr)
            return EXIT_PREFLIGHT
        checks = [found, *checks]
        print_checks(checks)
        if any(c.ok is False for c in checks):
            print("preflight FAILED: nothing requested, nothing written", file=sys.stderr)
            return EXIT_PREFLIGHT
        if not args.execute:
            print("preflight OK; nothing written. Add --execute to take the snapshot.")
            return EXIT_OK
        return execute(ray, control, args, dest)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
