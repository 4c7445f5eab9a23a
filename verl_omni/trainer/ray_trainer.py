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
import time
from pathlib import Path

import numpy as np
import torch

from verl_omni.trainer import checkpointing
from verl_omni.trainer.config import ConfigError, Stage3Config
from verl_omni.trainer.diffusion.metrics import PhaseTimer, advantage_metrics, reward_metrics, validation_metrics
from verl_omni.trainer.rollout_batch import (
    GenerateOutput,
    plan_updates,
    rows_of_requests,
    shard_requests,
    split_balanced,
)
from verl_omni.utils.reward_score.types import RewardScores

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
        self.timer = PhaseTimer()
        self._ray_started_here = False
        self._warned_recompile_limit = False
        self.stop_request = StopRequest()
        self.handle_sigterm = False  # run() sets it: a SIGTERM then asks for a graceful stop
        self.stopped_at: int | None = None  # the step a graceful stop ended the run after

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

        from verl_omni.trainer.ray_cluster import init_ray

        self.namespace, self._ray_started_here = init_ray(self.cfg, self._log)
        # Tools that talk to the live run (hot save) find the cluster here.
        checkpointing.atomic_write_text(self.out / "ray_address.txt", ray.get_runtime_context().gcs_address + "\n")

    def _build_workers(self) -> None:
        from verl_omni.trainer.ray_cluster import build_worker_groups

        self.actor_wg, self.reward_wg = build_worker_groups(self.cfg, self._reward_set_config())
        info = self.actor_wg.init_model()
        self._log(f"actor ranks: {info}")
        # Which OS process is which rank: what an operator (or a test) needs to inspect or stop one worker.
        pids = {"actor_ranks": [int(p) for p in self.actor_wg.pid()], "driver": os.getpid()}
        checkpointing.atomic_write_text(self.out / "worker_pids.json", json.dumps(pids) + "\n")
        self._start_control(int(info[0]["trainable_params"]))

    def _start_control(self, trainable_params: int) -> None:
        """Creates the named control actor that hot-save tools talk to (one per namespace)."""
        from verl_omni.trainer.hot_save import HotSaveService

        facts = {
            "output_dir": str(self.out.resolve()),
            "world_size": self.cfg.topology.world_size,
            "step": 0,
            # fp32 parameters + two AdamW moments, plus a little for metadata and RNG states.
            "expected_snapshot_bytes": int(trainable_params * 4 * 3 * 1.05 + 1e6),
        }
        self.hot_save = HotSaveService(self.namespace, facts)

    def _write_hot_snapshot(self, part: Path) -> dict:
        """The actor's state under ``part/actor``; returns the trainer state a hot-save snapshot records."""
        self._call("hot_save", self.actor_wg.save_checkpoint, str(part / "actor"), self._contract())
        return {
            "step": self.step,
            "data_position": self.sampler.state_dict(),
            "hot_save": True,
            "config": self.snapshot,
            "recipe": self.cfg.recipe,
            "time": time.time(),
        }

    # ------------------------------------------------------------------------------------------ helpers
    def _check_variant(self) -> None:
        """Refuses an initial checkpoint of another variant than ``model.variant`` (before anything is written)."""
        from verl_omni.contracts import CheckpointError, VariantMismatchError, check_checkpoint_variant

        try:
            check_checkpoint_variant(self.cfg.model.initial_checkpoint, self.cfg.model.variant, "model.variant")
        except VariantMismatchError as e:  # names both values, the checkpoint's config.json and the field
            raise ConfigError(str(e)) from e
        except CheckpointError as e:
            raise ConfigError(f"model.initial_checkpoint: {e}") from e

    def _contract(self) -> dict:
        from verl_omni.contracts import read_checkpoint_contract

        contract = read_checkpoint_contract(self.cfg.model.initial_checkpoint)
        contract = {k: v for k, v in contract.items()}
        contract["initial_checkpoint"] = str(Path(self.cfg.model.initial_checkpoint).resolve())
        return contract

    def _call(self, phase: str, fn, *args, **kwargs):
        """Calls a worker-group method; a dead or failing worker becomes a :class:`WorkerFailure`."""
        import ray

        try:
            return fn(*args, **kwargs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError) as e:
            raise WorkerFailure(f"{phase} failed at step {self.step}: {type(e).__name__}: {e}") from e

    def _rows(self, dataset, indices) -> list:
        return [dataset[int(i)] for i in indices]

    def _generate(self, rows: list, step: int, mode: str, strata: int, branches: int) -> GenerateOutput:
        """Rollouts for ``rows`` spread over the actor ranks, merged (results, contexts, targets, timings)."""
        from verl_omni.pipelines.wnm_shared.requests import stratified_requests

        g = self.cfg.topology.world_size
        requests = stratified_requests([r.sample_id for r in rows], self.cfg.trainer.seed, step, strata, branches)
        pad = (-len(requests)) % g
        if pad:  # only validation can need this: repeat the last request so every rank runs equal work
            requests = requests + [requests[-1]] * pad
        shards = shard_requests(requests, rows, g, str(self.train.source_root), mode)
        out = GenerateOutput.concat(self._call("rollout", self.actor_wg.generate, shards))
        if pad:
            out.results = out.results.head(len(requests) - pad)
        return out

    def _score(self, rows: list, results, targets: torch.Tensor) -> RewardScores:
        """Rewards of every rollout from the reward workers (balanced shards)."""
        from verl_omni.utils.reward_score import RewardBatch

        by_id = {r.sample_id: r for r in rows}
        rr = [by_id[q.sample_id] for q in results.requests]
        batch = RewardBatch.from_rollouts(
            rr, results.actions, results.request_ids, results.video_latents, targets[results.context_rows]
        )
        shards = [batch.select(sl) for sl in split_balanced(len(rr), self.cfg.reward.num_workers)]
        return RewardScores.concat(self._call("reward", self.reward_wg.score, shards))

    def _advantages(self, scores: np.ndarray, results, valid: np.ndarray | None = None):
        """The step's advantages (layer-conditioned, or the summed ablation) from its ``[N, 9]`` scores."""
        from verl_omni.trainer.diffusion.advantages import estimate_advantages

        a = self.cfg.algorithm
        acfg = a.advantage_config(self.cfg.rollout)
        # valid: the reward set's live layers (geometry/layer_valid); dead chunks leave the loss.
        return estimate_advantages(scores, results.sample_ids, results.strata, acfg, valid, a.layer_weights)

    def _plan_updates(self, results, contexts, adv, old_logp, step: int, epochs: int | None = None, **kw):
        """:func:`~verl_omni.trainer.rollout_batch.plan_updates` with this run's topology and seed."""
        topo = self.cfg.topology
        return plan_updates(
            results,
            contexts,
            adv,
            old_logp,
            world_size=topo.world_size,
            mini_batch_prompts=topo.ppo_mini_batch_prompts,
            micro_batch_rollouts=topo.micro_batch_rollouts,
            run_seed=self.cfg.trainer.seed,
            step=step,
            epochs=self.cfg.algorithm.ppo_epochs if epochs is None else epochs,
            **kw,
        )

    def _old_logprobs(self, results, contexts, adv, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The rollout's own log-probs, or with ``algorithm.recompute_old_logp`` one pass under these weights."""
        old_logp = results.logprobs
        if not self.cfg.algorithm.recompute_old_logp:
            return old_logp, {}
        # One pass over every transition (not one per PPO epoch): the pre-update weights are the same.
        payloads, _ = self._plan_updates(results, contexts, adv, old_logp, step, epochs=1, skip_zero_signal=False)
        flat = [[mb for mini in p for mb in mini] for p in payloads]
        recomputed = self._call("old_logp", self.actor_wg.compute_logprobs, flat)
        order = [i for p in flat for mb in p for i in rows_of_requests(results, mb.request_ids)]
        new_old = old_logp.clone()
        new_old[torch.tensor(order)] = torch.cat([t for r in recomputed for t in r])
        m = {
            "actor/logp_abs_diff_rollout_vs_recomputed": float((new_old - old_logp).abs().max()),
            "actor/old_logp_recomputed_rollouts": float(len(order)),
        }
        return new_old, m

    def _update(self, results, contexts, adv, old_logp, step: int) -> dict[str, float]:
        """The PPO update on the actor ranks; returns its metrics (and counts non-finite updates)."""
        payloads, skipped = self._plan_updates(results, contexts, adv, old_logp, step)
        m = {"advantages/skipped_minibatches": float(skipped)}
        if payloads[0]:
            upd = self._call("update", self.actor_wg.update, payloads)[0]
            self.nonfinite_total = int(upd["actor/total_nonfinite_updates"])
            m.update({k: v for k, v in upd.items() if not k.startswith("timing/")})
            self._warn_at_recompile_limit(m, step)
        return m

    def _warn_at_recompile_limit(self, m: dict[str, float], step: int) -> None:
        """Says once when dynamo holds as many DiT block graphs as it may: new shapes then run eagerly, slower."""
        graphs, limit = m.get("compile/block_graphs"), m.get("compile/block_graph_limit")
        if graphs is None or limit is None or graphs < limit or self._warned_recompile_limit:
            return
        self._warned_recompile_limit = True
        self._log(
            f"WARNING (step {step}): torch.compile holds {int(graphs)} graphs of the DiT block, dynamo's recompile "
            f"limit: any new shape now runs the block eagerly, much slower. Set torch._dynamo.config.recompile_limit "
            f"higher (TORCH_LOGS=recompiles shows why it recompiles; TensorBoard: compile/block_graphs)"
        )

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

    def _save(self, step: int, metrics: dict) -> Path:
        with self.timer.phase("checkpoint"):
            final = self._write_checkpoint(step, metrics)
        self._log(f"checkpoint {final}")
        return final

    def _write_checkpoint(self, step: int, metrics: dict) -> Path:
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
        return final

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
        self._check_variant()
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
        if self.handle_sigterm:
            # Again after ray.init: Ray's core worker installs its own SIGTERM handler, which aborts the driver.
            install_stop_handler(self.stop_request)
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
                stopping = self.stop_request.requested and not is_last
                if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or is_last or stopping:
                    saved = self._save(step, last)
                if stopping:
                    self.stopped_at = step
                    self._log(
                        f"stopped after step {step} of {cfg.trainer.total_steps} on signal {self.stop_request.signum}"
                        f"; checkpoint {saved}; the same launch resumes from it"
                    )
                    break
                self.hot_save.serve(step, self._write_hot_snapshot, (OSError, WorkerFailure), self._log)
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
        """gen -> reward -> advantages -> old log-probs -> update -> metrics (validation, media, logging)."""
        cfg, timer = self.cfg, self.timer
        t_step = time.perf_counter()
        rows = self._rows(self.train, self.sampler.next_indices(cfg.topology.prompts_per_step))
        with timer.phase("rollout") as gen:
            out = self._generate(rows, step, "sde", cfg.rollout.strata, cfg.rollout.branches)
        results, contexts, targets = out.results, out.context, out.target_latents
        with timer.phase("reward") as score:
            rew = self._score(rows, results, targets)
        self._log_reward_warnings(step, rew.warnings)
        adv = self._advantages(rew.scores, results, rew.diagnostics.get("geometry/layer_valid"))
        with timer.phase("old_logp") as old:
            old_logp, old_m = self._old_logprobs(results, contexts, adv, step)
        with timer.phase("update") as upd:
            upd_m = self._update(results, contexts, adv, old_logp, step)

        m: dict[str, float] = {
            "timing/rollout_s": gen.seconds,
            "timing/rollout_encode_s": out.encode_s,
            "perf/rollouts_per_s": len(results) / max(gen.seconds, 1e-9),
            "memory/rollout_peak_gb": out.peak_memory_gb,
            "timing/reward_s": score.seconds,
            "reward/warnings": float(len(rew.warnings)),
            **reward_metrics(rew.scores, rew.diagnostics),
            **advantage_metrics(adv),
            **old_m,
            "timing/old_logp_s": old.seconds,
            **upd_m,
            "timing/update_s": upd.seconds,
        }
        if self.val is not None and cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0:
            with timer.phase("validation") as val:
                m.update(self._validate())
            m["timing/validation_s"] = val.seconds
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

    def _log_reward_warnings(self, step: int, warnings: list[str]) -> None:
        if warnings:
            shown = "\n    ".join(warnings[:3])
            more = f" (+{len(warnings) - 3} more)" if len(warnings) > 3 else ""
            self._log(f"step {step}: {len(warnings)} reward warning(s){more}:\n    {shown}")

    # ------------------------------------------------------------------------------------------ validation/media
    def _validate(self) -> dict:
        n = self.cfg.data.val_max_samples
        rows = self._rows(self.val, range(n))
        out = self._generate(rows, VAL_STEP_KEY, "ode", 1, 1)
        results = out.results
        scores = self._score(rows, results, out.target_latents).scores
        by_id = {r.sample_id: r for r in rows}
        return validation_metrics(scores, [by_id[s].events for s in results.sample_ids])

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
        table = self.timer.table(PHASES)
        print(table, flush=True)
        checkpointing.atomic_write_text(self.out / "timing.txt", table + "\n")

    def _shutdown(self) -> None:
        import ray

        if self._ray_started_here and ray.is_initialized():
            ray.shutdown()


EXIT_STOPPED = 143  # 128 + SIGTERM: stopped on request, with a checkpoint of the last finished step


class StopRequest:
    """Set by the first SIGTERM; the driver loop checks it at each step boundary (see :func:`install_stop_handler`).

    Attributes:
        signum: The signal that asked for the stop, or None while none has.
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None


def install_stop_handler(stop: StopRequest) -> None:
    """The first SIGTERM asks for a graceful stop; a second one interrupts at once, like Ctrl-C.

    A graceful stop lets the step in progress finish, writes a checkpoint of it and exits with
    :data:`EXIT_STOPPED`, so a scheduler's preemption (or a study's time guard) loses no finished step and the
    same launch resumes from it. The interrupt path still runs the ``finally`` blocks that shut Ray down.
    """

    def _on_sigterm(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt(f"signal {signum} (second)")
        stop.signum = signum
        print(
            f"[stage3] signal {signum}: stopping after the current step with a checkpoint (send it again to stop "
            "at once, without one)",
            flush=True,
        )

    signal.signal(signal.SIGTERM, _on_sigterm)


def run(cfg: Stage3Config, snapshot: dict | None = None) -> int:
    trainer = Stage3Trainer(cfg, snapshot)
    trainer.handle_sigterm = True
    install_stop_handler(trainer.stop_request)
    try:
        trainer.fit()
    except (ConfigError, checkpointing.ProvenanceError, checkpointing.CheckpointIntegrityError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except WorkerFailure:
        return 3
    except FloatingPointError:
        return 4
    return EXIT_STOPPED if trainer.stopped_at is not None else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use python -m verl_omni.trainer.main_stage3")
