"""The Stage-III driver loop over Ray worker groups (verl single controller).

Per training step::

    prompts  <- deterministic epoch order of the training Parquet (position saved in checkpoints)
    rollouts <- actor ranks: encode each prompt's frozen context once, 4 strata x 4 branches each (SDE)
    rewards  <- reward workers (CPU): per-layer scores over references and occupancy maps
    adv      <- layer-conditioned advantages (stratum baseline, prompt std)
    update   <- PPO epochs over mini-batches of whole prompt groups on the SDE-window transitions
    metrics, periodic validation (ODE, event-balanced), media, checkpoint

The driver holds no model; it moves CPU tensors between worker groups and owns the data order, the
metrics and the checkpoint pointer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from verl_omni.trainer import checkpointing
from verl_omni.trainer.config import LAYER_NAMES, ConfigError, Stage3Config
from verl_omni.trainer.rollout_batch import (
    cat_dataclass_tensors,
    merge_results_with_offsets,
    minibatch_prompt_groups,
    shard_requests,
    split_balanced,
    split_even,
)

PHASES = ("rollout", "reward", "old_logp", "update", "validation", "checkpoint")
VAL_STEP_KEY = 0  # validation noise is keyed on a fixed step so every validation sees the same x_0


class WorkerFailure(RuntimeError):
    """A Ray worker died or raised; carries the phase and step."""


class Stage3Trainer:
    """Runs Stage-III training for one resolved config.

    Args:
        cfg: Validated trainer config.
        config_snapshot: The resolved config tree (written next to the outputs).
    """

    def __init__(self, cfg: Stage3Config, config_snapshot: dict | None = None) -> None:
        self.cfg = cfg
        self.out = Path(cfg.trainer.output_dir)
        self.snapshot = config_snapshot or cfg.to_dict()
        self.timings: dict[str, list[float]] = defaultdict(list)
        self._ray_started_here = False

    # ------------------------------------------------------------------------------------------ setup
    def _log(self, msg: str) -> None:
        print(f"[stage3] {msg}", flush=True)

    def _open_data(self) -> None:
        from verl_omni.data.dataset import EpochSampler, Stage3Dataset

        cfg = self.cfg
        self.train = Stage3Dataset.open(cfg.data.train_root)
        n, p = len(self.train), cfg.topology.prompts_per_step
        if n != cfg.data.expected_train_size:
            raise ConfigError(
                f"data.train_root has {n} rows but data.expected_train_size (WAM_EXPECTED_TRAIN_SIZE) "
                f"is {cfg.data.expected_train_size}"
            )
        if n % p:
            raise ConfigError(
                f"training rows ({n}) must be a multiple of the prompt batch ({p}) so that no batch "
                f"straddles two epochs; resample the training subset"
            )
        if self.train.source_root is None or self.train.occupancy_root is None:
            raise ConfigError(f"{cfg.data.train_root}: manifest lacks source_root/occupancy_root")
        self.sampler = EpochSampler(self.train.sample_ids, cfg.data.seed)
        self.val = None
        if cfg.data.val_file and cfg.trainer.val_freq > 0 and cfg.data.val_max_samples > 0:
            self.val = Stage3Dataset.open(cfg.data.val_file)
            if len(self.val) < cfg.data.val_max_samples:
                raise ConfigError(
                    f"data.val_file has {len(self.val)} rows, fewer than data.val_max_samples "
                    f"{cfg.data.val_max_samples}"
                )

    def _reward_set_config(self) -> dict:
        rs = dict(self.cfg.reward.reward_set)
        if not rs.get("occupancy_root"):
            rs["occupancy_root"] = str(self.train.occupancy_root)
        return rs

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        from verl_omni.trainer.control import DEFAULT_NAMESPACE

        self.namespace = os.environ.get("WAM_RAY_NAMESPACE", DEFAULT_NAMESPACE)
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, namespace=self.namespace, include_dashboard=False, log_to_driver=True)
        else:
            # Our own temp dir: never touches a Ray runtime someone else runs on this machine. Short path
            # because Ray's socket paths must fit in 107 bytes.
            self._ray_tmp = os.environ.get("WAM_RAY_TMPDIR") or tempfile.mkdtemp(prefix="wnm_ray_", dir="/tmp")
            cpus = max(os.cpu_count() or 2, self.cfg.topology.world_size + self.cfg.reward.num_workers)
            runtime_env: dict = {
                "env_vars": {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            }
            hook = os.environ.get("WAM_RAY_WORKER_SETUP_HOOK", "").strip()
            if hook:
                # "module.function" run by Ray in every worker process before it runs anything (profilers,
                # fault injection in tests); logged because it changes what the workers do.
                runtime_env["worker_process_setup_hook"] = hook
                self._log(f"WAM_RAY_WORKER_SETUP_HOOK={hook}: Ray runs it in every worker process")
            ray.init(num_cpus=cpus, _temp_dir=self._ray_tmp, include_dashboard=False, runtime_env=runtime_env)
            self._ray_started_here = True
        # Tools that talk to the live run (hot save) find the cluster here.
        checkpointing.atomic_write_text(self.out / "ray_address.txt", ray.get_runtime_context().gcs_address + "\n")

    def _build_workers(self) -> None:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool

        from verl_omni.workers.actor_rollout import ActorRolloutWorker
        from verl_omni.workers.reward_worker import RewardWorker

        topo = self.cfg.topology
        per_node = topo.gpus_per_node if topo.use_gpu else topo.cpu_workers_per_node
        # max_colocate_count=1: one actor process per bundle; verl's default asks for more CPUs per bundle
        # and, without use_gpu=False, for GPUs that a CPU machine does not have (it would hang).
        actor_pool = RayResourcePool(
            process_on_nodes=[per_node] * topo.nnodes,
            use_gpu=topo.use_gpu,
            max_colocate_count=1,
            name_prefix="wnm_actor",
        )
        device_name = "cuda" if topo.use_gpu else "cpu"
        self.actor_wg = _worker_group_class()(
            actor_pool,
            RayClassWithInitArgs(cls=ray.remote(ActorRolloutWorker), config=self.cfg.to_dict()),
            device_name=device_name,
            **self._rendezvous_on_this_node(),
        )
        reward_pool = RayResourcePool(
            process_on_nodes=[self.cfg.reward.num_workers],
            use_gpu=False,
            max_colocate_count=1,
            name_prefix="wnm_reward",
        )
        self.reward_wg = _worker_group_class()(
            reward_pool,
            RayClassWithInitArgs(cls=ray.remote(RewardWorker), reward_set=self._reward_set_config()),
            device_name="cpu",
            **self._rendezvous_on_this_node(),
        )
        info = self.actor_wg.init_model()
        self._log(f"actor ranks: {info}")
        # Which OS process is which rank: what an operator (or a test) needs to inspect or stop one worker.
        pids = {"actor_ranks": [int(p) for p in self.actor_wg.pid()], "driver": os.getpid()}
        checkpointing.atomic_write_text(self.out / "worker_pids.json", json.dumps(pids) + "\n")
        self._start_control(int(info[0]["trainable_params"]))

    @staticmethod
    def _rendezvous_on_this_node() -> dict:
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

    def _start_control(self, trainable_params: int) -> None:
        """Creates the named control actor that hot-save tools talk to (one per namespace)."""
        import socket

        import ray

        from verl_omni.trainer.control import CONTROL_NAME, RunControl

        try:
            ray.get_actor(CONTROL_NAME, namespace=self.namespace)
            taken = True
        except ValueError:  # no such actor: the namespace is ours
            taken = False
        if taken:
            raise ConfigError(
                f"another Stage-III run already owns Ray namespace {self.namespace!r}; set "
                f"WAM_RAY_NAMESPACE to a different name for this run"
            )
        facts = {
            "driver_pid": os.getpid(),
            "driver_host": socket.gethostname(),
            "output_dir": str(self.out.resolve()),
            "world_size": self.cfg.topology.world_size,
            "step": 0,
            # fp32 parameters + two AdamW moments, plus a little for metadata and RNG states.
            "expected_snapshot_bytes": int(trainable_params * 4 * 3 * 1.05 + 1e6),
            "namespace": self.namespace,
        }
        self.control = (
            ray.remote(RunControl).options(name=CONTROL_NAME, namespace=self.namespace, num_cpus=0).remote(facts)
        )
        ray.get(self.control.info.remote())

    def _serve_snapshot_requests(self, step: int) -> None:
        """Writes every queued hot-save snapshot now, at the step boundary."""
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
                    import shutil

                    shutil.rmtree(part)
                (part / "actor").mkdir(parents=True)
                self._call("hot_save", self.actor_wg.save_checkpoint, str(part / "actor"), self._contract())
                state = {
                    "step": step,
                    "data_position": self.sampler.state_dict(),
                    "hot_save": True,
                    "config": self.snapshot,
                    "recipe": self.cfg.recipe,
                    "time": time.time(),
                }
                checkpointing.atomic_write_text(
                    part / checkpointing.TRAINER_STATE, json.dumps(state, indent=2, sort_keys=True) + "\n"
                )
                checkpointing.write_files_manifest(part, step)
                part.rename(dest)
                result = {"state": "done", "path": str(dest), "step": step, "seconds": time.perf_counter() - t0}
                self._log(f"hot-save snapshot of step {step} written to {dest}")
            except (OSError, WorkerFailure) as e:
                result = {"state": "failed", "error": f"{type(e).__name__}: {e}", "step": step}
                self._log(f"hot-save snapshot to {dest} failed: {e}")
            ray.get(self.control.complete.remote(req["id"], result))

    # ------------------------------------------------------------------------------------------ helpers
    def _contract(self) -> dict:
        from verl_omni.models.wnm import read_checkpoint_contract

        contract = read_checkpoint_contract(self.cfg.model.initial_checkpoint)
        contract = {k: v for k, v in contract.items()}
        contract["initial_checkpoint"] = str(Path(self.cfg.model.initial_checkpoint).resolve())
        return contract

    def _timed(self, phase: str, t0: float) -> float:
        dt = time.perf_counter() - t0
        self.timings[phase].append(dt)
        return dt

    def _call(self, phase: str, fn, *args, **kwargs):
        """Calls a worker-group method; a dead or failing worker becomes a :class:`WorkerFailure`."""
        import ray

        try:
            return fn(*args, **kwargs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError) as e:
            raise WorkerFailure(f"{phase} failed at step {self.step}: {type(e).__name__}: {e}") from e

    def _rows(self, dataset, indices) -> list:
        return [dataset[int(i)] for i in indices]

    def _generate(self, rows: list, step: int, mode: str, strata: int, branches: int):
        """Rollouts for ``rows`` spread over the actor ranks; returns merged results, contexts and targets."""
        from verl_omni.pipelines.wnm_shared.requests import stratified_requests

        g = self.cfg.topology.world_size
        requests = stratified_requests([r.sample_id for r in rows], self.cfg.trainer.seed, step, strata, branches)
        pad = (-len(requests)) % g
        if pad:  # only validation can need this: repeat the last request so every rank runs equal work
            requests = requests + [requests[-1]] * pad
        shards = shard_requests(requests, rows, g)
        payload = [
            {"rows": s["rows"], "requests": s["requests"], "source_root": str(self.train.source_root), "mode": mode}
            for s in shards
        ]
        outs = self._call("rollout", self.actor_wg.generate, payload)
        offsets = np.cumsum([0] + [len(s["rows"]) for s in shards[:-1]]).tolist()
        results = merge_results_with_offsets([o["results"] for o in outs], offsets)
        contexts = cat_dataclass_tensors([o["context"] for o in outs])
        targets = torch.cat([o["target_latents"] for o in outs])  # one row per (rank, local prompt)
        n = len(requests) - pad
        if pad:
            results = _slice_results(results, n)
        timing = {k: float(np.max([o["timing"][k] for o in outs])) for k in outs[0]["timing"]}
        mem = float(np.max([o["peak_memory_gb"] for o in outs]))
        return results, contexts, targets, timing, mem

    def _score(self, rows: list, results, targets: torch.Tensor) -> dict:
        """Rewards of every rollout from the reward workers (balanced shards)."""
        by_id = {r.sample_id: r for r in rows}
        reqs = results.requests
        rr = [by_id[q.sample_id] for q in reqs]
        batch = {
            "actions": results.actions.double().numpy(),
            "start_pose": np.stack([r.start_pose for r in rr]),
            "reference_poses": np.stack([r.reference_poses for r in rr]),
            "goal": np.stack([r.goal for r in rr]),
            "success_radius": np.array([r.success_radius for r in rr], dtype=np.float64),
            "events": [list(r.events) for r in rr],
            "scene_id": [r.scene_id for r in rr],
            "rollout_id": list(results.request_ids),
            "generated_latents": results.video_latents.float().numpy(),
            "target_latents": targets[results.context_rows].float().numpy(),
        }
        n = len(reqs)
        parts = []
        for sl in split_balanced(n, self.cfg.reward.num_workers):
            parts.append({k: v[sl] for k, v in batch.items()})
        outs = self._call("reward", self.reward_wg.score, parts)
        scores = np.concatenate([o["scores"] for o in outs])
        diagnostics: dict[str, np.ndarray] = {}
        for key in outs[0]["diagnostics"]:
            vals = [o["diagnostics"].get(key) for o in outs if len(o["scores"])]
            if all(v is not None for v in vals):
                diagnostics[key] = np.concatenate(vals)
        warnings = [w for o in outs for w in o["warnings"]]
        return {
            "scores": scores,
            "diagnostics": diagnostics,
            "warnings": warnings,
            "score_s": float(max(o["score_s"] for o in outs)),
        }

    def _advantages(self, scores: np.ndarray, results, valid: np.ndarray | None = None):
        from verl_omni.trainer.diffusion.advantages import compute_layer_advantages, with_loss_mask
        from verl_omni.trainer.diffusion.config import AdvantageConfig

        a = self.cfg.algorithm
        acfg = AdvantageConfig(
            baseline=a.baseline,
            std=a.std,
            eps=a.adv_eps,
            a_max=a.adv_clip,
            num_strata=self.cfg.rollout.strata,
            num_branches=self.cfg.rollout.branches,
        )
        keys = results.sample_ids
        rewards = torch.as_tensor(scores, dtype=torch.float64)
        if not a.layer_conditioned:
            # Ablation: one advantage from the weighted summed reward, shared by every layer.
            w = torch.tensor([a.layer_weights[n] for n in LAYER_NAMES], dtype=torch.float64)
            total = (rewards * w).sum(dim=1, keepdim=True) / w.sum()
            rewards = total.expand(-1, len(LAYER_NAMES)).contiguous()
            # Every rollout has a summed reward (statistics over all); dead chunks still leave the loss.
            return with_loss_mask(compute_layer_advantages(rewards, keys, results.strata, acfg), valid)
        # valid: the reward set's live layers (geometry/layer_valid); dead chunks leave the statistics and the loss.
        return compute_layer_advantages(rewards, keys, results.strata, acfg, valid=valid)

    def _micro_batches(
        self, results, contexts, adv: torch.Tensor, old_logp: torch.Tensor, idx: list[int], mask=None
    ) -> list:
        """This rank's rollouts ``idx`` of a mini-batch, cut into micro-batches with their context rows."""
        mb_size = self.cfg.topology.micro_batch_rollouts
        out = []
        for start in range(0, len(idx), mb_size):
            sel = torch.tensor(idx[start : start + mb_size], dtype=torch.long)
            ctx_rows = results.context_rows[sel]
            uniq, inverse = torch.unique(ctx_rows, return_inverse=True)
            out.append(
                {
                    "window_states": results.window_states[sel],
                    "window_steps": results.window_steps[sel],
                    "noise_coefs": results.noise_coefs[sel],
                    "sigmas": results.sigmas,
                    "old_logprobs": old_logp[sel],
                    "advantages": adv[sel].float(),
                    "loss_mask": None if mask is None else mask[sel],
                    "context": contexts.select(uniq),
                    "context_rows": inverse,
                    "request_ids": [results.request_ids[i] for i in sel.tolist()],
                    "weight": len(sel) / len(idx),
                }
            )
        return out

    def _plan_updates(
        self,
        results,
        contexts,
        adv_result,
        old_logp: torch.Tensor,
        step: int,
        epochs: int | None = None,
        skip_zero_signal: bool = True,
    ):
        """Per-rank payloads: for each PPO epoch and mini-batch of whole prompt groups, equal rank shares.

        ``epochs`` defaults to ``algorithm.ppo_epochs``; recomputing old log-probs plans one epoch without
        skipping, so that every transition is evaluated exactly once.
        """
        g = self.cfg.topology.world_size
        keys = results.sample_ids
        rows_of: dict[str, list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            rows_of[k].append(i)
        zero = {k for k, z in zip(adv_result.prompt_keys, adv_result.zero_signal_prompts.tolist(), strict=True) if z}
        per_rank: list[list] = [[] for _ in range(g)]
        skipped = 0
        for epoch in range(self.cfg.algorithm.ppo_epochs if epochs is None else epochs):
            for group in minibatch_prompt_groups(
                keys, self.cfg.topology.ppo_mini_batch_prompts, self.cfg.trainer.seed, step, epoch
            ):
                if skip_zero_signal and all(k in zero for k in group):
                    # Every prompt group of this mini-batch has constant rewards on every layer: all
                    # advantages are 0, so the update would be a no-op. Skipped on all ranks alike.
                    skipped += 1
                    continue
                idx = [i for k in group for i in rows_of[k]]
                for rank, sl in enumerate(split_even(len(idx), g)):
                    per_rank[rank].append(
                        self._micro_batches(
                            results, contexts, adv_result.advantages, old_logp, idx[sl], adv_result.loss_mask
                        )
                    )
        return per_rank, skipped

    # ------------------------------------------------------------------------------------------ loop
    def _restore(self) -> int:
        from verl_omni.data.dataset import DataPosition, EpochSampler

        if self.cfg.trainer.resume == "never":
            if checkpointing.latest_step(self.out) is not None:
                raise ConfigError(
                    f"trainer.resume=never but {self.out} already holds checkpoints; use a new "
                    f"WAM_OUTPUT_DIR or resume=auto"
                )
            return 0
        choice = self.resume_choice  # verified in fit() before Ray started
        if choice is None or choice.step is None:
            return 0
        step, ckpt = choice.step, choice.path
        if choice.fell_back:
            self._log(
                f"WARNING: the newest checkpoint(s) are damaged and are NOT used:\n{choice.describe_damage()}\n"
                f"  falling back to the newest intact checkpoint {ckpt}; steps after {step} are trained again "
                f"(TensorBoard: checkpoint/resume_fallback)"
            )
        state = checkpointing.read_trainer_state(ckpt)
        self._call("load_checkpoint", self.actor_wg.load_checkpoint, str(ckpt / "actor"))
        pos = DataPosition.from_state_dict(state["data_position"], num_rows=len(self.train))
        self.sampler = EpochSampler(self.train.sample_ids, self.cfg.data.seed, pos)
        self.nonfinite_total = int(state.get("nonfinite_updates", 0))
        self._log(f"resumed from {ckpt} (step {step})")
        return step

    def _save(self, step: int, metrics: dict) -> None:
        t0 = time.perf_counter()
        part = checkpointing.begin(self.out, step)
        self._call("checkpoint", self.actor_wg.save_checkpoint, str(part / "actor"), self._contract())
        state = {
            "step": step,
            "data_position": self.sampler.state_dict(),
            "metrics": metrics,
            "nonfinite_updates": self.nonfinite_total,
            "config": self.snapshot,
            "recipe": self.cfg.recipe,
            "time": time.time(),
        }
        final = checkpointing.commit(self.out, step, state)
        checkpointing.record_checkpoint(self.out, step, final)
        checkpointing.prune(self.out, self.cfg.trainer.max_checkpoints_to_keep)
        self._timed("checkpoint", t0)
        self._log(f"checkpoint {final}")

    def _check_provenance(self) -> None:
        """Compares the run directory's recorded provenance with this launch; records it (before Ray starts)."""
        current = checkpointing.run_provenance(self.cfg.to_dict())
        result = checkpointing.check_provenance(self.out, current)  # raises ProvenanceError on a difference
        for msg in result.messages:
            self._log(msg)
        if result.action != "same":
            checkpointing.write_provenance(self.out, result.record)

    def _metrics_file(self, resume_step: int) -> Path:
        """``metrics.jsonl`` (one line per step), truncated to the resume step so a crash leaves no fork."""
        path = self.out / "metrics.jsonl"
        if path.exists():
            keep = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        keep.append(line)
                except (ValueError, KeyError):
                    continue
            checkpointing.atomic_write_text(path, "".join(k + "\n" for k in keep))
        return path

    def fit(self) -> dict:
        """Runs training to ``trainer.total_steps``; returns the last step's metrics."""
        from verl_omni.trainer.tracking import TensorBoardLogger

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        checkpointing.atomic_write_text(
            self.out / "resolved_config.json", json.dumps(self.snapshot, indent=2, sort_keys=True, default=str) + "\n"
        )
        self._check_provenance()
        self.resume_choice = None
        if cfg.trainer.resume != "never":
            # Every file of the checkpoint is checked against its manifest before any worker starts or reads it;
            # raises CheckpointIntegrityError (with the way out) when no checkpoint is intact.
            self.resume_choice = checkpointing.choose_resume(self.out)
            if self.resume_choice.step is not None:
                foreign = checkpointing.foreign_checkpoint_problem(
                    self.out, self.resume_choice.step, self.resume_choice.path
                )
                if foreign:
                    raise checkpointing.ProvenanceError(foreign)
        self._open_data()
        self.step = 0
        self.nonfinite_total = 0
        self._init_ray()
        try:
            self._build_workers()
            start = self._restore()
            self.step = start
            logger = TensorBoardLogger(self.out / "tensorboard", purge_step=start + 1 if start else None)
            if self.resume_choice is not None and self.resume_choice.fell_back:
                # Loud in TensorBoard too: how many newer checkpoints were skipped as damaged, at the step resumed.
                logger.log_scalars({"checkpoint/resume_fallback": float(len(self.resume_choice.damaged))}, start)
                logger.flush()
            metrics_path = self._metrics_file(start)
            last: dict = {}
            for step in range(start + 1, cfg.trainer.total_steps + 1):
                self.step = step
                last = self._train_step(step, logger)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, **last}, sort_keys=True) + "\n")
                if self.nonfinite_total >= cfg.algorithm.max_nonfinite_updates:
                    good = checkpointing.latest_intact(self.out)
                    self._log(
                        f"stopping: {self.nonfinite_total} updates had a NaN/inf loss or gradient "
                        f"(algorithm.max_nonfinite_updates={cfg.algorithm.max_nonfinite_updates}); the last "
                        f"good checkpoint is {good if good is not None else 'none (no intact checkpoint yet)'}; "
                        "no checkpoint is written after this step"
                    )
                    logger.close()
                    raise FloatingPointError("too many non-finite updates")
                is_last = step == cfg.trainer.total_steps
                if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or is_last:
                    self._save(step, last)
                self._serve_snapshot_requests(step)
            logger.close()
            self._print_timing_table()
            return last
        except WorkerFailure as e:
            # Only a checkpoint that passes verification is named as the one to resume from.
            where = checkpointing.latest_intact(self.out)
            hint = (
                f"last complete checkpoint: {where}\n  run the same launch command again to resume from it"
                if where is not None
                else "last complete checkpoint: none intact\n  a relaunch starts from the initial checkpoint"
            )
            self._log(f"ERROR: a worker failed: {e}\n  {hint}")
            raise
        finally:
            self._shutdown()

    def _train_step(self, step: int, logger) -> dict:
        cfg = self.cfg
        m: dict[str, float] = {}
        t_step = time.perf_counter()
        rows = self._rows(self.train, self.sampler.next_indices(cfg.topology.prompts_per_step))

        t0 = time.perf_counter()
        results, contexts, targets, gen_timing, gen_mem = self._generate(
            rows, step, "sde", cfg.rollout.strata, cfg.rollout.branches
        )
        m["timing/rollout_s"] = self._timed("rollout", t0)
        m["timing/rollout_encode_s"] = gen_timing["encode_s"]
        m["perf/rollouts_per_s"] = len(results) / max(m["timing/rollout_s"], 1e-9)
        m["memory/rollout_peak_gb"] = gen_mem

        t0 = time.perf_counter()
        rew = self._score(rows, results, targets)
        m["timing/reward_s"] = self._timed("reward", t0)
        if rew["warnings"]:
            shown = "\n    ".join(rew["warnings"][:3])
            more = f" (+{len(rew['warnings']) - 3} more)" if len(rew["warnings"]) > 3 else ""
            self._log(f"step {step}: {len(rew['warnings'])} reward warning(s){more}:\n    {shown}")
        m["reward/warnings"] = float(len(rew["warnings"]))
        scores = rew["scores"]
        for g, name in enumerate(LAYER_NAMES):
            m[f"reward/{name}/mean"] = float(scores[:, g].mean())
            m[f"reward/{name}/std"] = float(scores[:, g].std())
        m["reward/nav_total/mean"] = float(scores[:, 1:5].sum(1).mean())
        m["reward/stop_total/mean"] = float(scores[:, 5:9].sum(1).mean())
        for key, val in rew["diagnostics"].items():
            val = np.asarray(val, dtype=np.float64)
            if val.size and np.isfinite(val).any():
                m[f"reward_terms/{key}"] = float(np.nanmean(np.where(np.isfinite(val), val, np.nan)))

        adv = self._advantages(scores, results, rew["diagnostics"].get("geometry/layer_valid"))
        m.update(adv.metrics())
        for g, name in enumerate(LAYER_NAMES):
            m[f"advantages/std/{name}"] = float(adv.advantages[:, g].std())

        old_logp = results.logprobs
        t0 = time.perf_counter()
        if cfg.algorithm.recompute_old_logp:
            # One pass over every transition (not one per PPO epoch): the pre-update weights are the same.
            payloads, _ = self._plan_updates(results, contexts, adv, old_logp, step, epochs=1, skip_zero_signal=False)
            flat = [[mb for mini in p for mb in mini] for p in payloads]
            recomputed = self._call("old_logp", self.actor_wg.compute_logprobs, flat)
            order = [i for p in payloads for mini in p for mb in mini for i in _ids_to_idx(mb, results)]
            new_old = old_logp.clone()
            new_old[torch.tensor(order)] = torch.cat([t for r in recomputed for t in r])
            m["actor/logp_abs_diff_rollout_vs_recomputed"] = float((new_old - old_logp).abs().max())
            m["actor/old_logp_recomputed_rollouts"] = float(len(order))
            old_logp = new_old
        m["timing/old_logp_s"] = self._timed("old_logp", t0)

        t0 = time.perf_counter()
        payloads, skipped = self._plan_updates(results, contexts, adv, old_logp, step)
        m["advantages/skipped_minibatches"] = float(skipped)
        if payloads[0]:
            outs = self._call("update", self.actor_wg.update, [{"mini_batches": p} for p in payloads])
            upd = outs[0]
            self.nonfinite_total = int(upd["actor/total_nonfinite_updates"])
            m.update({k: v for k, v in upd.items() if not k.startswith("timing/")})
        m["timing/update_s"] = self._timed("update", t0)

        if self.val is not None and cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0:
            t0 = time.perf_counter()
            m.update(self._validate())
            m["timing/validation_s"] = self._timed("validation", t0)
        if cfg.trainer.log_media_freq and step % cfg.trainer.log_media_freq == 0:
            self._log_media(step, rows, results, targets, logger)
        m["timing/step_s"] = time.perf_counter() - t_step
        logger.log_scalars(m, step)
        logger.flush()
        self._log(
            f"step {step}: nav {m['reward/nav_total/mean']:+.3f} stop {m['reward/stop_total/mean']:+.3f} "
            f"visual {m['reward/visual/mean']:+.3f} grad {m.get('actor/grad_norm', float('nan')):.3g} "
            f"({m['timing/step_s']:.1f}s)"
        )
        return m

    # ------------------------------------------------------------------------------------------ validation/media
    def _validate(self) -> dict:
        n = self.cfg.data.val_max_samples
        rows = self._rows(self.val, range(n))
        results, _, targets, _, _ = self._generate(rows, VAL_STEP_KEY, "ode", 1, 1)
        scores = self._score(rows, results, targets)["scores"]
        by_id = {r.sample_id: r for r in rows}
        events = [by_id[s].events for s in results.sample_ids]
        out = {}
        groups = {"all": np.ones(len(events), bool)}
        for ev in sorted({e for evs in events for e in evs}):
            groups[ev] = np.array([ev in evs for evs in events])
        for gname, mask in groups.items():
            if not mask.any():
                continue
            s = scores[mask]
            out[f"val/{gname}/nav_total"] = float(s[:, 1:5].sum(1).mean())
            out[f"val/{gname}/stop_total"] = float(s[:, 5:9].sum(1).mean())
            out[f"val/{gname}/visual"] = float(s[:, 0].mean())
            out[f"val/{gname}/count"] = float(mask.sum())
        return out

    def _log_media(self, step: int, rows, results, targets, logger) -> None:
        from verl_omni.data.actions import integrate_actions
        from verl_omni.data.occupancy import OccupancyMap
        from verl_omni.trainer.tracking import side_by_side_video, trajectory_figure

        try:
            first = results.sample_ids[0]
            idx = [i for i, s in enumerate(results.sample_ids) if s == first]
            lat = torch.stack([results.video_latents[idx[0]], targets[results.context_rows[idx[0]]]])
            frames = self._call("media", self.actor_wg.decode_video, lat)[0]
            logger.log_gif("media/generated_vs_truth", side_by_side_video(frames[0], frames[1]), step)
            row = next(r for r in rows if r.sample_id == first)
            occ = OccupancyMap.load(Path(self.train.occupancy_root) / row.occupancy)
            acts = results.actions[idx].double().numpy()
            poses = integrate_actions(np.repeat(row.start_pose[None], len(idx), 0), acts)
            fig = trajectory_figure(
                occ,
                poses,
                row.reference_poses,
                row.goal,
                results.strata[idx].numpy(),
                title=f"step {step}: {first}",
                success_radius=row.success_radius,
            )
            logger.log_figure("media/trajectories", fig, step)
        except (OSError, ValueError) as e:  # media must never stop training
            self._log(f"media logging skipped at step {step}: {e}")

    # ------------------------------------------------------------------------------------------ teardown
    def _print_timing_table(self) -> None:
        lines = ["", "step-time table (seconds)", f"{'phase':<12}{'calls':>7}{'mean':>10}{'total':>10}"]
        for phase in PHASES:
            v = self.timings.get(phase, [])
            if v:
                lines.append(f"{phase:<12}{len(v):>7}{np.mean(v):>10.2f}{np.sum(v):>10.2f}")
        print("\n".join(lines), flush=True)
        checkpointing.atomic_write_text(self.out / "timing.txt", "\n".join(lines) + "\n")

    def _shutdown(self) -> None:
        import ray

        if self._ray_started_here and ray.is_initialized():
            ray.shutdown()


def _worker_group_class():
    """verl's ``RayWorkerGroup`` that honours the ``master_addr``/``master_port`` it is given.

    verl 0.9.1 pops both keyword arguments and then its base ``WorkerGroup.__init__`` resets them to None, so it
    always runs its ``get_master_addr_port`` task (see :meth:`Stage3Trainer._rendezvous_on_this_node`).
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


def _slice_results(results, n: int):
    import dataclasses

    out = {}
    for f in dataclasses.fields(results):
        v = getattr(results, f.name)
        if f.name in ("sigmas", "timesteps", "weight_version", "layer_names"):
            out[f.name] = v
        else:
            out[f.name] = v[:n]
    return type(results)(**out)


def _ids_to_idx(mb: dict, results) -> list[int]:
    pos = {rid: i for i, rid in enumerate(results.request_ids)}
    return [pos[r] for r in mb["request_ids"]]


def install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C so that ``finally`` blocks shut Ray down cleanly."""

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


def run(cfg: Stage3Config, snapshot: dict | None = None) -> int:
    install_signal_handlers()
    trainer = Stage3Trainer(cfg, snapshot)
    try:
        trainer.fit()
    except (ConfigError, checkpointing.ProvenanceError, checkpointing.CheckpointIntegrityError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except WorkerFailure:
        return 3
    except FloatingPointError:
        return 4
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use python -m verl_omni.trainer.main_stage3")
