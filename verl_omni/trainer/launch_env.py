"""Process and network helpers of ``recipes/wnm_3d/stage3/launch.sh`` (one sub-command per job).

    python -m verl_omni.trainer.launch_env gpus
    python -m verl_omni.trainer.launch_env node-ip --interface bond0
    python -m verl_omni.trainer.launch_env ray-check [--replace] [--ignore-dir DIR]
    python -m verl_omni.trainer.launch_env stop-ray --temp-dir DIR
    python -m verl_omni.trainer.launch_env wait-port --address HOST:PORT --timeout S
    python -m verl_omni.trainer.launch_env wait-nodes --address HOST:PORT --expected N --timeout S
    python -m verl_omni.trainer.launch_env follow-head --address HOST:PORT --temp-dir DIR

A *Ray runtime* on this machine is a ``gcs_server`` or ``raylet`` process of the current user. The launcher
refuses to start while one runs and stops one only when ``WAM_REPLACE_EXISTING_RAY=true``; processes are
found and ended by id (psutil), never by name, so nothing outside the listed runtimes is touched.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

RAY_CORE = ("gcs_server", "raylet")


@dataclass(frozen=True)
class RayProcess:
    """A Ray core process: id, component name and the session directory named on its command line."""

    pid: int
    component: str
    session_dir: str
    cmdline: str


def detect_gpus() -> int:
    """Local GPUs visible to this process (respects ``CUDA_VISIBLE_DEVICES``); 0 without an NVIDIA driver."""
    import shutil
    from pathlib import Path

    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists():
        return 0
    import torch

    return torch.cuda.device_count()


def network_interfaces() -> list[str]:
    """Names of this machine's network interfaces."""
    import psutil

    return sorted(psutil.net_if_addrs())


def interface_ipv4(name: str) -> str | None:
    """First IPv4 address of interface ``name`` (None if it has none or does not exist)."""
    import psutil

    for addr in psutil.net_if_addrs().get(name, []):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


def _session_dir(args: list[str]) -> str:
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        if "/session_" in value:
            head, _, tail = value.partition("/session_")
            return f"{head}/session_{tail.split('/', 1)[0]}"
    return ""


def ray_core_processes(ignore_dirs: tuple[str, ...] = ()) -> list[RayProcess]:
    """Ray ``gcs_server``/``raylet`` processes of this user, except those whose command line names a path
    under one of ``ignore_dirs`` (e.g. the head of the cluster a worker rank is about to join)."""
    import psutil

    uid = os.getuid()
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            info = proc.info
            if info["uids"] is None or info["uids"].real != uid or not info["cmdline"]:
                continue
            exe = info["cmdline"][0]
            component = os.path.basename(exe)
            if component not in RAY_CORE or "/ray/core/" not in exe:
                continue
            text = " ".join(info["cmdline"])
            if any(d and d.rstrip("/") + "/" in text for d in ignore_dirs):
                continue
            found.append(RayProcess(info["pid"], component, _session_dir(info["cmdline"][1:]), text))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(found, key=lambda p: p.pid)


def processes_mentioning(fragments: list[str]) -> list[int]:
    """Ids of this user's processes whose command line contains one of ``fragments``."""
    import psutil

    uid, me = os.getuid(), os.getpid()
    pids = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            info = proc.info
            if info["pid"] == me or info["uids"] is None or info["uids"].real != uid or not info["cmdline"]:
                continue
            text = " ".join(info["cmdline"])
            if any(f and f in text for f in fragments):
                pids.append(info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def terminate(pids: list[int], grace_s: float = 15.0) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL what is left; returns the ids that had to be killed."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def stop_runtime(processes: list[RayProcess]) -> int:
    """Stops the given Ray runtimes: their core processes and every process naming their session dirs."""
    fragments = sorted({p.session_dir for p in processes if p.session_dir})
    pids = sorted(set([p.pid for p in processes] + processes_mentioning(fragments)))
    terminate(pids)
    return len(pids)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host, int(port)


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _cmd_ray_check(args: argparse.Namespace) -> int:
    found = ray_core_processes(tuple(args.ignore_dir))
    if not found:
        return 0
    listing = "\n".join(f"  pid {p.pid} {p.component} {p.session_dir or '(session unknown)'}" for p in found)
    if not args.replace:
        print(
            f"error: a Ray runtime is already running on this machine:\n{listing}\nlaunch.sh never stops a "
            "running Ray runtime on its own. Stop it yourself (e.g. `ray stop` if it is yours and idle), or set "
            "WAM_REPLACE_EXISTING_RAY=true in paths.env to let launch.sh stop exactly these processes.",
            file=sys.stderr,
        )
        return 1
    n = stop_runtime(found)
    print(f"WAM_REPLACE_EXISTING_RAY=true: stopped {n} process(es) of the running Ray runtime:\n{listing}")
    return 0


def _cmd_stop_ray(args: argparse.Namespace) -> int:
    pids = processes_mentioning([args.temp_dir.rstrip("/") + "/"])
    killed = terminate(pids)
    print(f"stopped {len(pids)} Ray process(es) under {args.temp_dir}" + (f" ({len(killed)} killed)" if killed else ""))
    return 0


def _cmd_wait_port(args: argparse.Namespace) -> int:
    host, port = split_address(args.address)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return 0
        time.sleep(1.0)
    print(
        f"error: the Ray head at {args.address} did not answer within {args.timeout:.0f} s: start launch.sh with "
        "NODE_RANK=0 on the head node, check MASTER_ADDR and RAY_PORT and that the port is reachable from this "
        "node (firewall), or raise WAM_NODE_WAIT_TIMEOUT",
        file=sys.stderr,
    )
    return 1


def _alive_nodes() -> list[str]:
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]


def _cmd_wait_nodes(args: argparse.Namespace) -> int:
    import logging

    import ray

    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        deadline = time.monotonic() + args.timeout
        nodes: list[str] = []
        while time.monotonic() < deadline:
            nodes = _alive_nodes()
            if len(nodes) >= args.expected:
                print(f"ray cluster ready: {len(nodes)} node(s): {', '.join(sorted(nodes))}")
                return 0
            time.sleep(2.0)
        print(
            f"error: only {len(nodes)} of NNODES={args.expected} node(s) joined the Ray head at {args.address} "
            f"within {args.timeout:.0f} s (joined: {', '.join(sorted(nodes)) or 'none'}). Run launch.sh on every "
            "other node with the same NNODES and MASTER_ADDR and NODE_RANK 1 .. NNODES-1, check the network "
            "interface settings in paths.env, or raise WAM_NODE_WAIT_TIMEOUT",
            file=sys.stderr,
        )
        return 1
    finally:
        ray.shutdown()


def _cmd_follow_head(args: argparse.Namespace) -> int:
    host, port = split_address(args.address)
    misses = 0
    marker = args.temp_dir.rstrip("/") + "/"
    while True:
        time.sleep(args.interval)
        if not processes_mentioning([marker]):
            print(f"error: the local raylet under {args.temp_dir} exited while the head was up", file=sys.stderr)
            return 1
        misses = 0 if port_open(host, port) else misses + 1
        if misses >= 3:
            print(f"Ray head {args.address} is gone: the run on node 0 ended; leaving the cluster")
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("gpus", help="print the number of local GPUs visible to this process")
    p = sub.add_parser("node-ip", help="print the IPv4 address of a network interface")
    p.add_argument("--interface", required=True)
    p = sub.add_parser("ray-check", help="refuse (exit 1) or, with --replace, stop a running Ray runtime")
    p.add_argument("--replace", action="store_true")
    p.add_argument("--ignore-dir", action="append", default=[], help="ignore runtimes under this Ray temp dir")
    p = sub.add_parser("stop-ray", help="stop the Ray processes started with this --temp-dir")
    p.add_argument("--temp-dir", required=True)
    for name in ("wait-port", "wait-nodes", "follow-head"):
        p = sub.add_parser(name)
        p.add_argument("--address", required=True, help="HOST:PORT of the Ray head")
        if name != "follow-head":
            p.add_argument("--timeout", type=float, required=True, help="seconds")
    sub.choices["wait-nodes"].add_argument("--expected", type=int, required=True, help="number of nodes (NNODES)")
    sub.choices["follow-head"].add_argument("--temp-dir", required=True, help="this node's Ray temp dir")
    sub.choices["follow-head"].add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    args = parser.parse_args(argv)
    if args.cmd == "gpus":
        print(detect_gpus())
        return 0
    if args.cmd == "node-ip":
        ip = interface_ipv4(args.interface)
        if ip is None:
            print(f"error: interface {args.interface} has no IPv4 address (WAM_NETWORK_INTERFACE)", file=sys.stderr)
            return 1
        print(ip)
        return 0
    handlers = {
        "ray-check": _cmd_ray_check,
        "stop-ray": _cmd_stop_ray,
        "wait-port": _cmd_wait_port,
        "wait-nodes": _cmd_wait_nodes,
        "follow-head": _cmd_follow_head,
    }
    try:
        return handlers[args.cmd](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
