"""Ray start-up of the Stage-III driver and its two verl worker groups (actor ranks, CPU reward workers)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from verl_omni.trainer.config import Stage3Config


def object_store_bytes(value: str) -> int | None:
    """Parses ``WAM_RAY_OBJECT_STORE_GB`` (GiB, e.g. ``"4"`` or ``"0.5"``) into bytes; empty means Ray's default.

    Ray reserves 30% of the host's memory for each runtime's object store by default. Several trainings on one
    machine (the study runs its arms side by side, each with its own runtime) would each claim that much, while
    a step's batch is a few MB; a cap keeps them from crowding the host.

    Raises:
        ValueError: naming the variable, when the value is not a positive number.
    """
    value = value.strip()
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"WAM_RAY_OBJECT_STORE_GB={value!r}: expected a size in GiB, e.g. 4") from None
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"WAM_RAY_OBJECT_STORE_GB={value!r}: must be a positive, finite size in GiB")
    return int(gib * 2**30)


def init_ray(cfg: Stage3Config, log: Callable[[str], None] = print) -> tuple[str, bool]:
    """Joins ``RAY_ADDRESS`` (multi-node launch) or starts a private local runtime.

    Args:
        cfg: The run's config (world size and reward workers size the local runtime).
        log: Where notes go.

    Returns:
        ``(namespace, started_here)``: the run's Ray namespace (``WAM_RAY_NAMESPACE``) and whether this call
        started the runtime (then the driver shuts it down at the end).
    """
    import ray

    from verl_omni.trainer.control import DEFAULT_NAMESPACE

    namespace = os.environ.get("WAM_RAY_NAMESPACE", DEFAULT_NAMESPACE)
    if ray.is_initialized():
        return namespace, False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=True)
        return namespace, False
    # Our own temp dir: never touches a Ray runtime someone else runs on this machine. Short path because Ray's
    # socket paths must fit in 107 bytes.
    ray_tmp = os.environ.get("WAM_RAY_TMPDIR") or tempfile.mkdtemp(prefix="wnm_ray_", dir="/tmp")
    cpus = max(os.cpu_count() or 2, cfg.topology.world_size + cfg.reward.num_workers)
    runtime_env: dict = {"env_vars": {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}}
    hook = os.environ.get("WAM_RAY_WORKER_SETUP_HOOK", "").strip()
    if hook:
        # "module.function" run by Ray in every worker process before it runs anything (profilers, fault
        # injection in tests); logged because it changes what the workers do.
        runtime_env["worker_process_setup_hook"] = hook
        log(f"WAM_RAY_WORKER_SETUP_HOOK={hook}: Ray runs it in every worker process")
    store_bytes = object_store_bytes(os.environ.get("WAM_RAY_OBJECT_STORE_GB", ""))
    if store_bytes is not None:
        log(f"WAM_RAY_OBJECT_STORE_GB: Ray object store capped at {store_bytes / 2**30:.1f} GiB")
    ray.init(
        num_cpus=cpus,
        _temp_dir=ray_tmp,
        include_dashboard=False,
        runtime_env=runtime_env,
        object_store_memory=store_bytes,
    )
    return namespace, True


def build_worker_groups(cfg: Stage3Config, reward_set: dict):
    """The actor worker group (one process per GPU or CPU worker) and the reward worker group.

    Args:
        cfg: The run's config (topology, reward workers; handed to every actor rank).
        reward_set: The reward set config each reward worker builds.

    Returns:
        ``(actor_wg, reward_wg)``, not yet initialized (``actor_wg.init_model()`` loads the model).
    """
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool

    from verl_omni.workers.actor_rollout import ActorRolloutWorker
    from verl_omni.workers.reward_worker import RewardWorker

    topo = cfg.topology
    per_node = topo.gpus_per_node if topo.use_gpu else topo.cpu_workers_per_node
    group_class = worker_group_class()
    # max_colocate_count=1: one actor process per bundle; verl's default asks for more CPUs per bundle
    # and, without use_gpu=False, for GPUs that a CPU machine does not have (it would hang).
    actor_pool = RayResourcePool(
        process_on_nodes=[per_node] * topo.nnodes,
        use_gpu=topo.use_gpu,
        max_colocate_count=1,
        name_prefix="wnm_actor",
    )
    actor_wg = group_class(
        actor_pool,
        RayClassWithInitArgs(cls=ray.remote(ActorRolloutWorker), config=cfg.to_dict()),
        device_name="cuda" if topo.use_gpu else "cpu",
        **rendezvous_on_this_node(),
    )
    reward_pool = RayResourcePool(
        process_on_nodes=[cfg.reward.num_workers],
        use_gpu=False,
        max_colocate_count=1,
        name_prefix="wnm_reward",
    )
    reward_wg = group_class(
        reward_pool,
        RayClassWithInitArgs(cls=ray.remote(RewardWorker), reward_set=reward_set),
        device_name="cpu",
        **rendezvous_on_this_node(),
    )
    return actor_wg, reward_wg


def rendezvous_on_this_node() -> dict:
    """``master_addr``/``master_port`` of a worker group, chosen here when the cluster is this one node.

    Without them verl runs a throwaway Ray task (``get_master_addr_port``) per worker group to pick them.
    Ray later reaps that idle task worker, and Ray's C++ core worker sometimes aborts while it exits
    (abseil "Mutex corrupt"); the faulthandler Ray installs in every worker then prints "Fatal Python error:
    Aborted" into the driver's log although nothing failed. On one node the driver's address is rank 0's,
    so no task is needed. On several nodes rank 0 may live elsewhere: verl's task picks them there.
    """
    import socket

    import ray

    if len([n for n in ray.nodes() if n.get("Alive")]) != 1:
        return {}
    with socket.socket() as s:  # the same way verl's task picks a port (free now, bound by rank 0 later)
        s.bind(("", 0))
        port = s.getsockname()[1]
    return {"master_addr": ray.util.get_node_ip_address().strip("[]"), "master_port": str(port)}


def worker_group_class():
    """verl's ``RayWorkerGroup`` that honours the ``master_addr``/``master_port`` it is given.

    verl 0.9.1 pops both keyword arguments and then its base ``WorkerGroup.__init__`` resets them to None, so it
    always runs its ``get_master_addr_port`` task (see :func:`rendezvous_on_this_node`).
    """
    from verl.single_controller.ray import RayWorkerGroup

    class _WorkerGroup(RayWorkerGroup):
        def __init__(self, *args, master_addr: str | None = None, master_port: str | None = None, **kwargs):
            self._given_rendezvous = (master_addr, master_port)
            super().__init__(*args, **kwargs)

        def _get_master_addr_port(self, pg, bundle_index=0, master_port_range=None):
            if self._given_rendezvous[0] is not None:
                self._master_addr, self._master_port = self._given_rendezvous
                return
            super()._get_master_addr_port(pg, bundle_index=bundle_index, master_port_range=master_port_range)

    return _WorkerGroup
