"""Typed configuration of the sampler and the native backend, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_omni.pipelines.wnm_shared.schedule import shifted_sigmas
from verl_omni.pipelines.wnm_shared.sde import SDE_TYPES, noise_coefficient
from verl_omni.pipelines.wnm_shared.window import WINDOW_STRATEGIES, window_steps

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class SamplerConfig:
    """How rollouts are sampled.

    Attributes:
        num_steps: Denoising steps ``K``.
        shift: Sigma-schedule time shift (> 0).
        eta: Noise level: ``eta`` of the dance form, ``a`` of the Flow-GRPO form (> 0).
        sde_type: ``dance`` (constant coefficient) or ``flow_grpo``.
        window_strategy: ``fixed``, ``random`` or ``progressive`` (see ``window.py``).
        window_size: SDE steps per rollout ``W``.
        window_range: ``(lo, hi)`` with the window inside ``[lo, hi)``; ``None`` = ``(0, num_steps - 1)``.
            The last step (to sigma 0) is always Euler: noise injected there would stay in the sample.
        window_start: First SDE step of the ``fixed`` strategy.
        progressive_interval: Training steps per one-step shift of the ``progressive`` window.
        num_strata: Noise strata per prompt.
        num_branches: Counterfactual branches per stratum.
        shared_initial_noise: Branches of a stratum share ``x_0`` (the counterfactual design). False draws
            ``x_0`` per rollout, for the ablation that removes the counterfactual structure.
    """

    num_steps: int = 10
    shift: float = 3.0
    eta: float = 0.3
    sde_type: str = "dance"
    window_strategy: str = "random"
    window_size: int = 2
    window_range: tuple[int, int] | None = None
    window_start: int = 0
    progressive_interval: int = 1
    num_strata: int = 4
    num_branches: int = 4
    shared_initial_noise: bool = True

    def __post_init__(self) -> None:
        for name in ("num_steps", "window_size", "progressive_interval", "num_strata", "num_branches"):
            _positive_int(f"SamplerConfig.{name}", getattr(self, name))
        if not (isinstance(self.shift, (int, float)) and self.shift > 0):
            raise ValueError(f"SamplerConfig.shift must be > 0, got {self.shift!r}")
        if not (isinstance(self.eta, (int, float)) and self.eta > 0):
            raise ValueError(f"SamplerConfig.eta must be > 0 (use the ODE sampler for eta = 0), got {self.eta!r}")
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"SamplerConfig.sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")
        if self.window_strategy not in WINDOW_STRATEGIES:
            raise ValueError(
                f"SamplerConfig.window_strategy must be one of {WINDOW_STRATEGIES}, got {self.window_strategy!r}"
            )
        if self.num_steps < 2:
            raise ValueError("SamplerConfig.num_steps must be >= 2 (the last step is always Euler)")
        rng = self.window_range if self.window_range is not None else (0, self.num_steps - 1)
        if len(rng) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in rng):
            raise ValueError(f"SamplerConfig.window_range must be two ints (lo, hi), got {self.window_range!r}")
        lo, hi = rng
        if not 0 <= lo < hi <= self.num_steps - 1:
            raise ValueError(
                f"SamplerConfig.window_range {rng} must satisfy 0 <= lo < hi <= num_steps - 1 = {self.num_steps - 1}"
            )
        object.__setattr__(self, "window_range", (lo, hi))
        if self.window_size > hi - lo:
            raise ValueError(f"SamplerConfig.window_size {self.window_size} exceeds window_range {rng}")
        if self.window_strategy == "fixed" and not lo <= self.window_start <= hi - self.window_size:
            raise ValueError(
                f"SamplerConfig.window_start {self.window_start} must be in [{lo}, {hi - self.window_size}] "
                f"for window_size {self.window_size} and window_range {rng}"
            )

    @property
    def rollouts_per_prompt(self) -> int:
        return self.num_strata * self.num_branches

    def sigmas(self) -> torch.Tensor:
        """``[K + 1]`` float64 schedule."""
        return shifted_sigmas(self.num_steps, self.shift)

    def window(self, run_seed: int, step: int) -> tuple[int, ...]:
        """SDE-window step indices for training step ``step`` of run ``run_seed``."""
        return window_steps(
            self.window_strategy,
            self.window_size,
            self.window_range,
            run_seed,
            step,
            window_start=self.window_start,
            progressive_interval=self.progressive_interval,
        )

    def noise_coefficient(self, sigmas: torch.Tensor, denoising_step: int) -> float:
        """``g_i`` of one SDE step."""
        return noise_coefficient(self.sde_type, self.eta, sigmas, denoising_step)


@dataclass(frozen=True)
class NativeBackendConfig:
    """Execution settings of the native backend.

    Attributes:
        device: Torch device string for the DiT and the SDE math.
        dtype: DiT compute dtype: ``float32``, ``bfloat16`` or ``float16`` (SDE math is always fp32).
        deterministic: Evaluate every request on its own (batch of one) so that results are bit-identical
            whatever batch a request lands in. ``None`` = on for CPU, off for CUDA.
        chunk_size: Max requests per DiT call when not deterministic (``None`` = whole batch).
        check_finite: Check latents and velocities for NaN/inf after every step.
        share_prefix: Compute the Euler steps before the SDE window once per distinct initial noise and
            context row (exact: the branches of a stratum are identical until the window). Off only to
            measure what it saves.
    """

    device: str = "cpu"
    dtype: str = "float32"
    deterministic: bool | None = None
    chunk_size: int | None = None
    check_finite: bool = True
    share_prefix: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"NativeBackendConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"NativeBackendConfig.device {self.device!r} is not a torch device: {e}") from e
        if self.chunk_size is not None:
            _positive_int("NativeBackendConfig.chunk_size", self.chunk_size)
        if self.deterministic is None:
            object.__setattr__(self, "deterministic", torch.device(self.device).type == "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def effective_chunk_size(self) -> int | None:
        """Requests per DiT call: 1 in deterministic mode, else ``chunk_size``."""
        return 1 if self.deterministic else self.chunk_size
