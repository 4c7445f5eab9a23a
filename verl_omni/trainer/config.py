"""Typed, validated configuration of the Stage-III trainer.

The recipe's Hydra YAML files (``recipes/wnm_3d/stage3/config``) compose into one tree with the sections
below; :func:`trainer_config_from_dict` turns it into these dataclasses and validates every field, so a
bad value fails before Ray starts, with the dotted field name in the message.

Sections: ``model`` (checkpoints), ``data`` (Parquet roots, sizes), ``rollout`` (sampler, strata),
``algorithm`` (advantages, loss, PPO), ``actor`` (optimizer, FSDP), ``reward`` (reward set and workers),
``topology`` (world size and batch sizes), ``trainer`` (steps, intervals, output).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from verl_omni.contracts import LAYER_NAMES, VARIANTS

RECIPE_NAME = "wnm-3d-stage3-navigation-grpo-r1"
# The DiT's attention kernel families (verl_omni.models.wnm.attention.ATTENTION_BACKENDS, restated so that the
# config stays importable without torch; a CPU test checks that the two agree).
ATTENTION_BACKEND_NAMES = ("default", "cudnn", "fa4")


class ConfigError(ValueError):
    """A configuration field is missing or invalid; the message names the dotted field."""


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config field {name}: {msg}")


@dataclass
class ModelConfig:
    """Checkpoints and model variant.

    Attributes:
        initial_checkpoint: Complete Stage-II WNM checkpoint the actor starts from.
        data_contract_checkpoint: Checkpoint the data was converted with (contract must match).
        source_root: External WNM-3D checkout (``WNM3D_SOURCE_ROOT``) or None for the built-in model.
        variant: ``wnm_3d`` (geometry tokens) or ``wnm_2d``; every actor rank builds its model, rollout backend
            and actor through the variant's pipeline package (``verl_omni.pipelines.<variant>``). An initial
            checkpoint of the other variant is refused (driver, contract check and worker alike).
    """

    initial_checkpoint: str = ""
    data_contract_checkpoint: str = ""
    source_root: str | None = None
    variant: str = "wnm_3d"

    def validate(self, p: str = "model") -> None:
        _require(bool(self.initial_checkpoint), f"{p}.initial_checkpoint", "is empty (set WNM3D_INITIAL_CHECKPOINT)")
        _require(
            bool(self.data_contract_checkpoint),
            f"{p}.data_contract_checkpoint",
            "is empty (set WAM_DATA_CONTRACT_CHECKPOINT)",
        )
        _require(self.variant in VARIANTS, f"{p}.variant", f"must be one of {list(VARIANTS)}, got {self.variant!r}")


@dataclass
class DataConfig:
    """Training and validation data.

    Attributes:
        train_root: Directory with the sampled training Parquet and its manifest.json.
        val_file: Event-balanced validation Parquet directory (or manifest) or empty to skip validation.
        expected_train_size: Exact training row count the run was planned for.
        val_max_samples: Validation rows evaluated at each validation.
        seed: Seed of the per-epoch shuffling.
    """

    train_root: str = ""
    val_file: str = ""
    expected_train_size: int = 0
    val_max_samples: int = 0
    seed: int = 42

    def validate(self, p: str = "data") -> None:
        _require(bool(self.train_root), f"{p}.train_root", "is empty (set WAM_DATA_ROOT)")
        _require(self.expected_train_size > 0, f"{p}.expected_train_size", "must be > 0 (WAM_EXPECTED_TRAIN_SIZE)")
        _require(self.val_max_samples >= 0, f"{p}.val_max_samples", "must be >= 0 (WAM_VAL_MAX_SAMPLES)")


@dataclass
class WindowConfig:
    """Which denoising steps are SDE steps that carry log-probs and gradients."""

    strategy: str = "random"
    size: int = 2
    range: tuple[int, int] = (0, 4)
    start: int = 0
    progressive_interval: int = 1

    def validate(self, p: str, num_steps: int) -> None:
        _require(
            self.strategy in ("fixed", "random", "progressive"),
            f"{p}.strategy",
            f"must be fixed, random or progressive, got {self.strategy!r}",
        )
        lo, hi = self.range
        # The last step (to sigma 0) is always Euler: noise injected there would remain in the sample.
        _require(
            0 <= lo < hi <= num_steps - 1, f"{p}.range", f"must satisfy 0 <= lo < hi <= num_steps - 1 = {num_steps - 1}"
        )
        _require(1 <= self.size <= hi - lo, f"{p}.size", f"must be in [1, {hi - lo}] for range {self.range}")
        if self.strategy == "fixed":
            _require(lo <= self.start <= hi - self.size, f"{p}.start", f"must be in [{lo}, {hi - self.size}]")
        _require(self.progressive_interval >= 1, f"{p}.progressive_interval", "must be >= 1")


@dataclass
class RolloutConfig:
    """Counterfactual stratified sampling.

    Attributes:
        backend: ``native`` (in-process PyTorch) or ``vllm_omni``.
        strata: Initial-noise strata per prompt; branches: SDE branches per stratum (16 = 4 x 4 locked).
        num_steps: Denoising steps K; shift: sigma-schedule shift; eta: SDE noise level.
        sde_type: ``dance`` (constant coefficient) or ``flow_grpo``.
        shared_initial_noise: Branches of a stratum share x_0 (False only for the ablation).
        micro_batch_size: Rollouts per forward pass on one rank.
        dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``bfloat16`` or ``float32`` for the DiT.
        fp8: Opt-in: the native rollout runs an FP8 copy of the DiT, its blocks' linear layers in float8 with
            row-wise scales (``verl_omni.models.wnm.fp8``; GPUs of compute capability 8.9 and up), re-quantized
            from the actor's weights before each rollout. It samples from a slightly different policy than the
            weights being trained, so it needs ``algorithm.recompute_old_logp: true``.
        gelu_epilogue: On CUDA in bf16, the rollout computes each feed-forward's tanh GELU in its first GEMM's
            epilogue (``WNMTransformer.gelu_epilogue``): about 3% faster a forward. The update cannot (the fused
            op has no backward), so the first PPO ratios then differ from 1 by bf16 rounding; false gives back
            bit-equal log-probs where the update's graph otherwise matches the rollout's.
        norm_rope_kernel: On CUDA in bf16, the rollout computes each block's self-attention q/k RMS norm and RoPE
            in one Triton kernel (``WNMTransformer.norm_rope_kernel``, ``models/wnm/rms_norm_rope.py``). The
            update keeps the composite form (the kernel has no backward), so, as with ``gelu_epilogue``, the first
            PPO ratios then differ from 1 by bf16 rounding; false gives back bit-equal log-probs there.
        residual_norm_kernel: On CUDA in bf16, the rollout adds each branch to the residual stream and computes
            the LayerNorm after it in one Triton kernel, each block leaving its feed-forward residual to the next
            block's kernel (``WNMTransformer.residual_norm_kernel``, ``models/wnm/residual_norm.py``). The update
            keeps the composite form, so, as with ``norm_rope_kernel``, the first PPO ratios then differ from 1 by
            bf16 rounding; false gives back bit-equal log-probs there.
    """

    backend: str = "native"
    strata: int = 4
    branches: int = 4
    num_steps: int = 10
    shift: float = 3.0
    eta: float = 0.7
    sde_type: str = "dance"
    shared_initial_noise: bool = True
    window: WindowConfig = field(default_factory=WindowConfig)
    micro_batch_size: int = 16
    dtype: str = "auto"
    fp8: bool = False
    gelu_epilogue: bool = True
    norm_rope_kernel: bool = True
    residual_norm_kernel: bool = True

    def sampler_config(self):
        """This section as the sampler's own config (:class:`~verl_omni.pipelines.wnm_shared.SamplerConfig`)."""
        from verl_omni.pipelines.wnm_shared.config import SamplerConfig  # torch; only where a sampler is built

        w = self.window
        return SamplerConfig(
            num_steps=self.num_steps,
            shift=self.shift,
            eta=self.eta,
            sde_type=self.sde_type,
            window_strategy=w.strategy,
            window_size=w.size,
            window_range=tuple(w.range),
            window_start=w.start,
            progressive_interval=w.progressive_interval,
            num_strata=self.strata,
            num_branches=self.branches,
            shared_initial_noise=self.shared_initial_noise,
        )

    @property
    def rollouts_per_prompt(self) -> int:
        return self.strata * self.branches

    def validate(self, p: str = "rollout") -> None:
        _require(
            self.backend in ("native", "vllm_omni"),
            f"{p}.backend",
            f"must be native or vllm_omni, got {self.backend!r}",
        )
        _require(self.strata >= 1 and self.branches >= 1, f"{p}.strata/branches", "must be >= 1")
        _require(self.num_steps >= 2, f"{p}.num_steps", "must be >= 2")
        _require(self.shift > 0 and math.isfinite(self.shift), f"{p}.shift", "must be a positive number")
        _require(self.eta >= 0 and math.isfinite(self.eta), f"{p}.eta", "must be >= 0")
        _require(
            self.sde_type in ("dance", "flow_grpo"),
            f"{p}.sde_type",
            f"must be dance or flow_grpo, got {self.sde_type!r}",
        )
        _require(self.micro_batch_size >= 1, f"{p}.micro_batch_size", "must be >= 1")
        _require(self.dtype in ("auto", "bfloat16", "float32"), f"{p}.dtype", "must be auto, bfloat16 or float32")
        _require(self.fp8 in (True, False), f"{p}.fp8", f"must be true or false, got {self.fp8!r}")
        _require(
            self.gelu_epilogue in (True, False),
            f"{p}.gelu_epilogue",
            f"must be true or false, got {self.gelu_epilogue!r}",
        )
        _require(
            isinstance(self.norm_rope_kernel, bool),
            f"{p}.norm_rope_kernel",
            f"must be true or false, got {self.norm_rope_kernel!r}",
        )
        _require(
            isinstance(self.residual_norm_kernel, bool),
            f"{p}.residual_norm_kernel",
            f"must be true or false, got {self.residual_norm_kernel!r}",
        )
        _require(
            not self.fp8 or self.backend == "native",
            f"{p}.fp8",
            "applies to the native rollout backend only: set rollout.backend: native or rollout.fp8: false",
        )
        self.window.validate(f"{p}.window", self.num_steps)


@dataclass
class AlgorithmConfig:
    """Layer-conditioned GRPO (math in :mod:`verl_omni.trainer.diffusion`).

    Attributes:
        layers: Credit layers, in order (locked to the 9 layers).
        layer_weights: Loss weight per layer.
        baseline: ``stratum`` (mean over the rollout's counterfactual siblings) or ``prompt``.
        std: ``prompt`` (over the prompt's rollouts) or ``global`` (over the batch).
        layer_conditioned: False sums the layer rewards into one advantage (ablation).
        adv_eps, adv_clip: Std epsilon and advantage clip A_max.
        clip_eps: PPO ratio clip; kl_beta: KL weight against the initial policy (0 = off).
        ppo_epochs: Passes over the step's rollouts.
        recompute_old_logp: Recompute old log-probs with the pre-update weights instead of using the
            rollout's (costs one extra forward per window step; useful when rollout and actor kernels differ).
        max_nonfinite_updates: Stop the run after this many skipped updates with a NaN/inf loss or gradient.
    """

    layers: tuple[str, ...] = LAYER_NAMES
    layer_weights: dict[str, float] = field(default_factory=lambda: {n: 1.0 for n in LAYER_NAMES})
    baseline: str = "stratum"
    std: str = "prompt"
    layer_conditioned: bool = True
    adv_eps: float = 1e-4
    adv_clip: float = 5.0
    clip_eps: float = 1e-4
    kl_beta: float = 0.0
    ppo_epochs: int = 1
    recompute_old_logp: bool = False
    max_nonfinite_updates: int = 3

    def loss_config(self):
        """The clipped-loss settings of this section (:class:`~verl_omni.trainer.diffusion.config.LossConfig`)."""
        from verl_omni.trainer.diffusion.config import LossConfig

        return LossConfig(clip_eps=self.clip_eps, layer_weights=dict(self.layer_weights), kl_beta=self.kl_beta)

    def advantage_config(self, rollout: RolloutConfig):
        """The advantage estimator's settings (:class:`~verl_omni.trainer.diffusion.config.AdvantageConfig`);
        the strata and branches come from the ``rollout`` section."""
        from verl_omni.trainer.diffusion.config import AdvantageConfig

        return AdvantageConfig(
            baseline=self.baseline,
            std=self.std,
            eps=self.adv_eps,
            a_max=self.adv_clip,
            num_strata=rollout.strata,
            num_branches=rollout.branches,
            layer_conditioned=self.layer_conditioned,
        )

    def validate(self, p: str = "algorithm") -> None:
        _require(tuple(self.layers) == LAYER_NAMES, f"{p}.layers", f"must be {list(LAYER_NAMES)}")
        missing = [n for n in LAYER_NAMES if n not in self.layer_weights]
        unknown = [n for n in self.layer_weights if n not in LAYER_NAMES]
        _require(not missing and not unknown, f"{p}.layer_weights", f"missing {missing}, unknown {unknown}")
        _require(
            all(v >= 0 for v in self.layer_weights.values()) and sum(self.layer_weights.values()) > 0,
            f"{p}.layer_weights",
            "must be >= 0 with a positive sum",
        )
        _require(self.baseline in ("stratum", "prompt"), f"{p}.baseline", "must be stratum or prompt")
        _require(self.std in ("prompt", "global"), f"{p}.std", "must be prompt or global")
        _require(self.adv_eps > 0, f"{p}.adv_eps", "must be > 0")
        _require(self.adv_clip > 0, f"{p}.adv_clip", "must be > 0")
        _require(0 < self.clip_eps < 1, f"{p}.clip_eps", "must be in (0, 1)")
        _require(self.kl_beta >= 0, f"{p}.kl_beta", "must be >= 0")
        _require(self.ppo_epochs >= 1, f"{p}.ppo_epochs", "must be >= 1")
        _require(self.max_nonfinite_updates >= 1, f"{p}.max_nonfinite_updates", "must be >= 1")


@dataclass
class ActorConfig:
    """Optimizer and FSDP2 settings of the trainable DiT.

    ``compile`` runs the DiT blocks through ``torch.compile`` (one graph shared by all blocks) for both
    the colocated rollout and the update; it pays at Wan-1.3B size on GPUs and costs compile time at start.
    ``history_attention: isolated`` makes history tokens attend only among themselves so the rollout computes
    their keys/values once per prompt (about half the DiT work per step); it changes the model that Stage II
    trained with full attention, so it is off (``full``) unless a user accepts that.

    ``gradient_checkpointing`` runs DiT blocks under activation checkpointing: a checkpointed block keeps only
    its inputs and recomputes its forward in the backward, which is what lets large micro-batches fit.
    ``checkpoint_blocks`` says how many of the blocks, from the first, do so (None = all, 0 = none; ignored
    while ``gradient_checkpointing`` is false). Fewer checkpointed blocks trade memory for less recomputation:
    each block left out keeps its activations for the backward and is not run a second time. Where the trade
    pays depends on the model size, micro-batch and GPU; measure it with ``scripts/bench_stage3_gpu.py
    --ckpt-blocks`` before changing it. A value above the model's block count is refused where the model is
    built (the actor worker), since only the checkpoint tells that count.

    ``attention_backend`` picks the DiT's attention kernels for the rollout and the update alike (so both round the
    same way): ``default`` (PyTorch's choice, cuDNN's fused kernel on Hopper), ``cudnn`` (forced) or ``fa4``
    (FlashAttention-4, the optional ``flash-attn-4`` package, on Hopper and Blackwell; CPU keeps the default).
    Measured on one H100 at Wan2.1-1.3B (docs/benchmarks.md, session 35): ``fa4`` made the compiled forward 3% faster
    (1.049x against 1.017x compiled diffusers) and its backward kernel 11% faster than cuDNN's at our self-attention
    shape. Its kernels are JIT-compiled at their first call (start-up time not measured separately). Off
    (``default``) unless a user installs the package.

    ``activation_memory_budget`` (compiled actors only; None = inductor's default) hands the choice of what to
    recompute to inductor's partitioner instead: the compiled block keeps at most that share of the activations
    it would keep by default and recomputes the cheapest of the rest in the backward (PyTorch's
    ``torch._functorch.config.activation_memory_budget``). It requires ``gradient_checkpointing: false``. On one
    H200 at Wan2.1-1.3B, micro-batch 16, 0.2 ran the update at 51.5% of the matmul peak in 117 GiB against 45.0%
    in 37 GiB with every block checkpointed, and its recomputed log-probs equalled the rollout's (a first PPO
    ratio of exactly 1, which checkpointing does not give); docs/benchmarks.md. On one 80 GB H100, 0.05 ran it at
    50.3% in 52 GiB against 44.9% checkpointed (0.1 ran out of memory). Neither budget has run inside the Ray
    trainer on a GPU, which needs more memory than the benchmark, so the recipe keeps checkpointing.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    param_offload: bool = False
    reshard_after_forward: bool = True
    gradient_checkpointing: bool = False
    checkpoint_blocks: int | None = None
    activation_memory_budget: float | None = None
    compile: bool = False
    history_attention: str = "full"
    attention_backend: str = "default"

    def validate(self, p: str = "actor") -> None:
        _require(self.lr > 0, f"{p}.lr", "must be > 0")
        _require(self.grad_clip > 0, f"{p}.grad_clip", "must be > 0")
        _require(self.lr_warmup_steps >= 0, f"{p}.lr_warmup_steps", "must be >= 0")
        _require(self.lr_schedule in ("constant", "cosine"), f"{p}.lr_schedule", "must be constant or cosine")
        _require(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", "must be in [0, 1]")
        _require(self.compile in (True, False), f"{p}.compile", f"must be true or false, got {self.compile!r}")
        n = self.checkpoint_blocks
        # bool is an int subclass: `true` would otherwise mean "1 block".
        _require(
            n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0),
            f"{p}.checkpoint_blocks",
            f"must be null (all blocks) or an int >= 0 (how many blocks, from the first, to checkpoint), got {n!r}",
        )
        b = self.activation_memory_budget
        _require(
            b is None or (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b <= 1),
            f"{p}.activation_memory_budget",
            f"must be null (inductor's default) or a number in (0, 1], got {b!r}",
        )
        _require(
            b is None or self.compile is True,
            f"{p}.activation_memory_budget",
            "applies to the compiled DiT only: set actor.compile: true (WAM_COMPILE=true) or leave it null",
        )
        _require(
            b is None or not self.gradient_checkpointing,
            f"{p}.activation_memory_budget",
            "replaces activation checkpointing (a checkpointed block recomputes its whole forward and drops what the "
            "budget keeps): set actor.gradient_checkpointing: false with it, or leave it null",
        )
        _require(
            self.history_attention in ("full", "isolated"),
            f"{p}.history_attention",
            f"must be full or isolated, got {self.history_attention!r}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKEND_NAMES,
            f"{p}.attention_backend",
            f"must be one of {', '.join(ATTENTION_BACKEND_NAMES)} (WAM_ATTENTION_BACKEND), "
            f"got {self.attention_backend!r}",
        )


@dataclass
class RewardConfig:
    """Reward workers and the reward set (passed to ``verl_omni.utils.reward_score.build_reward_set``)."""

    num_workers: int = 1
    reward_set: dict[str, Any] = field(default_factory=dict)

    def validate(self, p: str = "reward") -> None:
        _require(self.num_workers >= 1, f"{p}.num_workers", "must be >= 1")


@dataclass
class TopologyConfig:
    """World size and batch sizes; see ``verl_omni.trainer.topology`` for how they are derived.

    Attributes:
        nnodes, gpus_per_node: GPU topology; ``gpus_per_node == 0`` means CPU workers.
        cpu_workers_per_node: Actor processes per node when running on CPU.
        prompts_per_step: Prompt batch P (16 P rollouts per step).
        ppo_mini_batch_prompts: Prompts per optimizer step.
        micro_batch_rollouts: Rollouts per forward/backward on one rank.
    """

    nnodes: int = 1
    gpus_per_node: int = 0
    cpu_workers_per_node: int = 2
    prompts_per_step: int = 2
    ppo_mini_batch_prompts: int = 2
    micro_batch_rollouts: int = 4

    @property
    def world_size(self) -> int:
        return self.nnodes * (self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_workers_per_node)

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_node > 0

    def validate(self, rollouts_per_prompt: int, p: str = "topology") -> None:
        _require(self.nnodes >= 1, f"{p}.nnodes", "must be >= 1")
        _require(self.gpus_per_node >= 0, f"{p}.gpus_per_node", "must be >= 0")
        _require(self.gpus_per_node > 0 or self.cpu_workers_per_node >= 1, f"{p}.cpu_workers_per_node", "must be >= 1")
        g = self.world_size
        n = rollouts_per_prompt
        _require(self.prompts_per_step >= 1, f"{p}.prompts_per_step", "must be >= 1")
        _require(
            1 <= self.ppo_mini_batch_prompts <= self.prompts_per_step
            and self.prompts_per_step % self.ppo_mini_batch_prompts == 0,
            f"{p}.ppo_mini_batch_prompts",
            f"must divide prompts_per_step={self.prompts_per_step}",
        )
        _require(
            (n * self.prompts_per_step) % g == 0,
            f"{p}.prompts_per_step",
            f"{n} x {self.prompts_per_step} rollouts do not divide by world size {g}",
        )
        per_rank = n * self.ppo_mini_batch_prompts // g if (n * self.ppo_mini_batch_prompts) % g == 0 else None
        _require(
            per_rank is not None,
            f"{p}.ppo_mini_batch_prompts",
            f"{n} x {self.ppo_mini_batch_prompts} rollouts per mini-batch do not divide by world size {g}",
        )
        _require(
            self.micro_batch_rollouts >= 1 and per_rank % self.micro_batch_rollouts == 0,
            f"{p}.micro_batch_rollouts",
            f"each rank gets {per_rank} rollouts per mini-batch, not a multiple of {self.micro_batch_rollouts}",
        )


@dataclass
class TrainerConfig:
    """Run length, intervals and outputs.

    ``deterministic`` turns on PyTorch's deterministic algorithms (warnings only, where none exists) and, on CPU,
    one request per DiT call, so that each rollout's bits do not depend on its batch-mates. On GPUs the DiT keeps
    ``rollout.micro_batch_size`` requests per call (``workers.actor_rollout.one_request_per_call`` says why).
    """

    total_steps: int = 2
    save_freq: int = 1
    val_freq: int = 0
    log_media_freq: int = 0
    output_dir: str = ""
    seed: int = 1234
    resume: str = "auto"
    experiment_name: str = "stage3"
    deterministic: bool = True
    max_checkpoints_to_keep: int = 0

    def validate(self, p: str = "trainer") -> None:
        _require(self.total_steps >= 1, f"{p}.total_steps", "must be >= 1 (WAM_TOTAL_STEPS)")
        _require(self.save_freq >= 0, f"{p}.save_freq", "must be >= 0 (0 = only at the end)")
        _require(self.val_freq >= 0, f"{p}.val_freq", "must be >= 0 (0 = never)")
        _require(self.log_media_freq >= 0, f"{p}.log_media_freq", "must be >= 0 (0 = never)")
        _require(bool(self.output_dir), f"{p}.output_dir", "is empty (set WAM_OUTPUT_DIR)")
        _require(self.resume in ("auto", "never"), f"{p}.resume", "must be auto or never")
        _require(self.max_checkpoints_to_keep >= 0, f"{p}.max_checkpoints_to_keep", "must be >= 0 (0 keeps all)")


@dataclass
class Stage3Config:
    """The whole trainer configuration."""

    recipe: str = RECIPE_NAME
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> Stage3Config:
        self.model.validate()
        self.data.validate()
        self.rollout.validate()
        self.algorithm.validate()
        self.actor.validate()
        self.reward.validate()
        self.topology.validate(self.rollout.rollouts_per_prompt)
        self.trainer.validate()
        _require(
            not self.rollout.fp8 or self.algorithm.recompute_old_logp,
            "rollout.fp8",
            "samples with FP8 weights, whose log-probs are not the trained bf16 policy's: set "
            "algorithm.recompute_old_logp: true with it",
        )
        if self.rollout.fp8 and not self.actor.compile:
            # Eager, each FP8 linear quantizes its input in separate kernels over an fp32 copy: on an H100 at Wan-1.3B
            # dims the eager FP8 forward took 331 ms against the bf16 model's 182 ms (batch 4); compiled, 129 ms.
            warnings.warn(
                "rollout.fp8 without actor.compile: the eager FP8 rollout is slower than the bf16 one (measured 1.8x "
                "on an H100); set actor.compile: true",
                stacklevel=2,
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, data: Any, path: str):
    """Recursively builds dataclass ``cls`` from a plain dict, rejecting unknown keys by dotted name."""
    if not dataclasses.is_dataclass(cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config field {path or '<root>'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config field(s) {[where + u for u in unknown]}; known: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        sub = f"{path}.{name}" if path else name
        value = data[name]
        ftype = f.type if not isinstance(f.type, str) else _resolve_type(cls, name)
        if dataclasses.is_dataclass(ftype):
            value = _build(ftype, value, sub)
        elif isinstance(value, list) and _default_is_tuple(f):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"config section {path or '<root>'}: {e}") from e


def _default_is_tuple(f: dataclasses.Field) -> bool:
    if f.default is not dataclasses.MISSING:
        return isinstance(f.default, tuple)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return isinstance(f.default_factory(), tuple)  # type: ignore[misc]
    return False


def _resolve_type(cls, name: str):
    import typing

    return typing.get_type_hints(cls)[name]


def trainer_config_from_dict(data: dict) -> Stage3Config:
    """Builds and validates a :class:`Stage3Config` from a plain (resolved) dict."""
    cfg = _build(Stage3Config, dict(data), "")
    return cfg.validate()
