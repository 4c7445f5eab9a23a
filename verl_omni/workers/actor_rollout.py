"""FSDP2 actor worker with the colocated ``native`` rollout backend (verl single controller).

One process per GPU (or per CPU worker). Each holds:

- the trainable joint DiT, sharded with ``fully_shard`` per transformer block and at the root
  (bf16 compute with fp32 reduction on GPU, fp32 on CPU), and its AdamW optimizer;
- the frozen encoders (VAE, text, image, geometry) unsharded, in eval mode, without gradients;
- a :class:`NativeRolloutBackend` over the *same* transformer module: rollouts always use the weights
  the optimizer just produced, so no weight sync is needed for the colocated backend.

Every collective-bearing call (generate, update, save/load) is issued to all ranks with the same number
of forward passes per rank; the driver guarantees equal shares (``verl_omni.trainer.topology``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl_omni.trainer.config import Stage3Config, trainer_config_from_dict
from verl_omni.trainer.device import DeviceSpec, peak_memory_gb, reset_peak_memory, resolve_device


def sampler_config_from(cfg: Stage3Config):
    """The rollout section of the trainer config as the sampler's own config."""
    from verl_omni.pipelines.wnm_shared.config import SamplerConfig

    r = cfg.rollout
    return SamplerConfig(
        num_steps=r.num_steps,
        shift=r.shift,
        eta=r.eta,
        sde_type=r.sde_type,
        window_strategy=r.window.strategy,
        window_size=r.window.size,
        window_range=tuple(r.window.range),
        window_start=r.window.start,
        progressive_interval=r.window.progressive_interval,
        num_strata=r.strata,
        num_branches=r.branches,
        shared_initial_noise=r.shared_initial_noise,
    )


def loss_config_from(cfg: Stage3Config):
    from verl_omni.trainer.diffusion.config import LossConfig

    a = cfg.algorithm
    return LossConfig(clip_eps=a.clip_eps, layer_weights=dict(a.layer_weights), kl_beta=a.kl_beta)


def lr_lambda(cfg: Stage3Config):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to ``min_lr_ratio``."""
    a, total = (
        cfg.actor,
        max(
            cfg.trainer.total_steps
            * cfg.algorithm.ppo_epochs
            * (cfg.topology.prompts_per_step // cfg.topology.ppo_mini_batch_prompts),
            1,
        ),
    )

    def f(i: int) -> float:
        if a.lr_warmup_steps and i < a.lr_warmup_steps:
            return (i + 1) / a.lr_warmup_steps
        if a.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (i - a.lr_warmup_steps) / max(1, total - a.lr_warmup_steps))
        return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class ActorRolloutWorker(Worker):
    """verl worker: FSDP2 DiT + optimizer + colocated native rollout.

    Args:
        config: The resolved trainer config as a plain dict (validated again here).
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.cfg = trainer_config_from_dict(config)
        self.spec: DeviceSpec | None = None
        self.model = None
        self.backend = None
        self.rollout = None  # what generate() samples with: self.backend (native) or a vllm_omni backend
        self.optimizer = None
        self.scheduler = None
        self.reference = None
        self.version = 0
        self.nonfinite_updates = 0

    # ------------------------------------------------------------------------------------------- setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Initializes the process group, loads the initial checkpoint, shards the DiT, builds the optimizer."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from verl_omni.models.wnm import load_wnm_checkpoint
        from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig
        from verl_omni.pipelines.wnm_shared.native import NativeRolloutBackend

        cfg = self.cfg
        self.spec = resolve_device(cfg.topology.use_gpu, cfg.rollout.dtype)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if not dist.is_initialized():
            # verl's helper would build a "cuda:nccl" string even on CPU; we pick the backend ourselves.
            dist.init_process_group(backend=self.spec.backend, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(cfg.trainer.seed)
        device = self.spec.device
        model = load_wnm_checkpoint(cfg.model.initial_checkpoint, device=device, dtype=torch.float32)
        if cfg.actor.gradient_checkpointing and hasattr(model.transformer, "gradient_checkpointing"):
            model.transformer.gradient_checkpointing = True
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
        if cfg.actor.compile:
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
        self.backend = NativeRolloutBackend.from_model(
            model,
            sampler_config_from(cfg),
            NativeBackendConfig(
                device=str(device),
                dtype="float32",
                deterministic=cfg.trainer.deterministic,
                chunk_size=cfg.rollout.micro_batch_size,
            ),
        )
        self.rollout = self._build_rollout_backend(model)
        if cfg.algorithm.kl_beta > 0:
            import copy

            self.reference = copy.deepcopy(model.transformer).eval().requires_grad_(False)
        n_params = sum(p.numel() for p in model.transformer.parameters())
        return {
            "rank": self.rank,
            "device": str(device),
            "backend": self.spec.backend,
            "dit_dtype": str(self.spec.dit_dtype),
            "trainable_params": int(n_params),
        }

    def _build_rollout_backend(self, model):
        """``native``: the colocated backend itself. ``vllm_omni``: a vLLM-Omni engine on this rank's GPU
        serving the initial checkpoint (version 0), put to sleep between rollouts; ``generate`` syncs it to
        the actor's version first (bucketed, versioned; docs/vllm_omni.md)."""
        cfg = self.cfg
        if cfg.rollout.backend != "vllm_omni":
            return self.backend
        from verl_omni.pipelines.wnm_vllm_omni.extra import require_vllm_omni

        require_vllm_omni()
        if self.spec.kind != "cuda":
            raise RuntimeError("rollout.backend=vllm_omni needs NVIDIA GPUs (vLLM's CUDA engine); use native on CPU")
        from verl_omni.pipelines.wnm_vllm_omni.backend import VllmOmniRolloutBackend
        from verl_omni.pipelines.wnm_vllm_omni.engine import VllmOmniEngineConfig

        engine_cfg = VllmOmniEngineConfig(
            checkpoint=str(cfg.model.initial_checkpoint),
            dtype="bfloat16" if self.spec.dit_dtype == torch.bfloat16 else "float32",
            deterministic=cfg.trainer.deterministic,
            chunk_size=cfg.rollout.micro_batch_size,
            max_num_seqs=cfg.rollout.micro_batch_size,
        )
        rollout = VllmOmniRolloutBackend.from_model(model, sampler_config_from(cfg), engine_cfg)
        rollout.sleep()
        return rollout

    def _rollout_generate(self, requests, context, ode: bool):
        if self.rollout is self.backend:
            return self.backend.generate(requests, context, ode=ode)
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
    def generate(self, shard: dict) -> dict:
        """Samples this rank's share of the step's rollouts.

        Args:
            shard: ``{"rows": [Stage3Row], "source_root": str, "requests": [RolloutRequest],
                "mode": "sde"|"ode"}``; each request's ``context_row`` indexes ``rows``.

        Returns:
            CPU tensors: results, the encoded contexts and the ground-truth target latents per prompt.
        """
        t0 = time.perf_counter()
        reset_peak_memory(self.spec)
        requests = shard["requests"]
        context, target_latents = self._load_prompts(shard["rows"], shard["source_root"])
        t_encode = time.perf_counter() - t0
        results = self._rollout_generate(requests, context, ode=shard.get("mode", "sde") == "ode")
        return {
            "results": results,
            "context": context.to("cpu", torch.float32),
            "target_latents": target_latents.float().cpu(),
            "timing": {"encode_s": t_encode, "generate_s": time.perf_counter() - t0 - t_encode},
            "peak_memory_gb": peak_memory_gb(self.spec),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def decode_video(self, latents: torch.Tensor) -> np.ndarray:
        """``[B, C, T', h, w]`` latents -> ``uint8 [B, T, H, W, 3]`` frames (frozen VAE, no collectives)."""
        with torch.no_grad():
            return self.model.decode_video(latents.to(self.spec.device)).cpu().numpy()

    # ------------------------------------------------------------------------------------------- training
    def _recompute(self, mb: dict, module, grad: bool) -> torch.Tensor:
        from verl_omni.trainer.diffusion.recompute import recompute_layer_logprobs

        ctx = mb["context"]
        with torch.set_grad_enabled(grad):
            return recompute_layer_logprobs(
                module,
                self.backend.layout,
                mb["window_states"].to(self.spec.device),
                mb["window_steps"],
                mb["noise_coefs"],
                mb["sigmas"],
                ctx.to(self.spec.device, torch.float32),
                mb["context_rows"],
                dtype=torch.float32,
                device=self.spec.device,
                chunk_size=self.backend.config.effective_chunk_size,
                request_ids=mb["request_ids"],
            )

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def compute_logprobs(self, micro_batches: list[dict]) -> list[torch.Tensor]:
        """Per-layer log-probs ``[R, W, 9]`` of stored transitions under the current weights (no grad)."""
        self.model.transformer.eval()
        return [self._recompute(mb, self.model.transformer, grad=False).cpu() for mb in micro_batches]

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def update(self, payload: dict) -> dict:
        """PPO epochs over this rank's share of each mini-batch.

        Args:
            payload: ``{"mini_batches": [[micro-batch dict, ...], ...]}``; every rank receives the same number
                of mini-batches and micro-batches. A micro-batch holds ``window_states [R, W+1, D]``,
                ``window_steps``, ``noise_coefs``, ``sigmas``, ``old_logprobs [R, W, 9]``,
                ``advantages [R, 9]``, ``context`` (rows for these rollouts), ``context_rows``,
                ``request_ids`` and ``weight`` (this micro-batch's share of the mini-batch loss).

        Returns:
            Metrics averaged over mini-batches (ratio stats, clip fraction, approx KL, grad norm, lr,
            logp drift of the first mini-batch, skipped updates).
        """
        from torch.distributed.tensor import DTensor

        from verl_omni.trainer.diffusion.loss import clipped_layer_loss

        t0 = time.perf_counter()
        reset_peak_memory(self.spec)
        loss_cfg = loss_config_from(self.cfg)
        self.model.transformer.train()
        metrics: dict[str, list[float]] = {}
        skipped = 0
        first_ratio_dev = None
        for mb_index, mini in enumerate(payload["mini_batches"]):
            self.optimizer.zero_grad(set_to_none=True)
            mini_metrics: dict[str, list[float]] = {}
            for mb_pos, mb in enumerate(mini):
                # Gradients accumulate unsharded on each rank and are reduce-scattered once, after the last
                # micro-batch of the mini-batch, instead of once per micro-batch (FSDP2 no-sync accumulation).
                self.model.transformer.set_requires_gradient_sync(mb_pos == len(mini) - 1)
                logp = self._recompute(mb, self.model.transformer, grad=True)
                old = mb["old_logprobs"].to(logp.device)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self._recompute(mb, self.reference, grad=False)
                out = clipped_layer_loss(logp, old, mb["advantages"].to(logp.device), loss_cfg, logp_ref=ref)
                (out.loss * float(mb["weight"])).backward()
                if mb_index == 0:
                    dev = float((logp.detach() - old).abs().max())
                    first_ratio_dev = dev if first_ratio_dev is None else max(first_ratio_dev, dev)
                for k, v in out.metrics.items():
                    mini_metrics.setdefault(k, []).append(float(v))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.transformer.parameters(), self.cfg.actor.grad_clip)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            if not math.isfinite(grad_norm):
                # Never apply a NaN/inf update: skip it, count it, and let the driver stop the run at the limit.
                skipped += 1
                self.nonfinite_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
                self.scheduler.step()
            metrics.setdefault("actor/grad_norm", []).append(grad_norm)
            for k, v in mini_metrics.items():
                metrics.setdefault(k, []).append(float(np.mean(v)))
        self.version += 1
        self.backend.mark_weight_version(self.version)  # colocated: the backend runs the very module we just updated
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        out["actor/skipped_nonfinite_updates"] = float(skipped)
        out["actor/total_nonfinite_updates"] = float(self.nonfinite_updates)
        out["actor/logp_abs_diff_first_minibatch"] = float(first_ratio_dev if first_ratio_dev is not None else 0.0)
        out["timing/update_s"] = time.perf_counter() - t0
        out["memory/update_peak_gb"] = peak_memory_gb(self.spec)
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
    def parameter_checksum(self) -> float:
        """Sum of |full parameters| (for tests: did the weights change?)."""
        from torch.distributed.tensor import DTensor

        total = 0.0
        for p in self.model.transformer.parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            total += float(t.detach().double().abs().sum())
        return total

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()
