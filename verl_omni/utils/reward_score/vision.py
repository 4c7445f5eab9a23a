"""Vision reward (layer ``visual``): agreement of the generated future view with the ground truth.

Metrics (option ``metric``), one value per rollout:

* ``latent_mse`` (default): ``visual = -mean((z_gen - z_gt)^2)`` over all latent dimensions of the
  rollout (``generated_latents`` / ``target_latents``, any shape ``[N, ...]``).
* ``psnr``: ``visual = mean over frames of min(10 log10(L^2 / MSE_f), psnr_cap_db)`` in dB, ``MSE_f`` over
  the frame's pixels and channels, ``L`` the data range (255 for uint8 frames, 1.0 for float frames, or
  ``data_range``). Identical frames score ``psnr_cap_db``.
* ``ssim``: ``visual = mean over frames and channels of SSIM`` (Wang et al. 2004): Gaussian window
  sigma 1.5 truncated to 11 x 11 taps, ``C1 = (0.01 L)^2``, ``C2 = (0.03 L)^2``, the SSIM map averaged over
  the positions where the window fits entirely inside the frame. In [-1, 1], 1 for identical frames.

Pixel metrics read ``generated_frames`` / ``target_frames`` ``[N, T, H, W, 3]``. When the inputs the metric
needs are missing, ``visual = 0`` for every rollout with a ``batch:`` warning; a rollout with non-finite
inputs scores NaN, which the reward set replaces by ``invalid_penalty`` with a warning naming it.
Diagnostics (``[N]``): the metric value under its own name (``latent_mse``, ``psnr_db`` or ``ssim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_omni.utils.reward_score.registry import (
    ModuleResult,
    RewardModule,
    RewardModuleConfig,
    check_positive,
    register_reward,
)
from verl_omni.utils.reward_score.trajectory import RolloutGeometry
from verl_omni.utils.reward_score.types import RewardBatch

METRICS = ("latent_mse", "psnr", "ssim")
SSIM_SIGMA, SSIM_TAPS, SSIM_K1, SSIM_K2 = 1.5, 11, 0.01, 0.03


@dataclass(frozen=True)
class VisionConfig(RewardModuleConfig):
    """Options of the ``vision`` reward (see module docstring).

    Attributes:
        metric: One of ``METRICS``.
        psnr_cap_db: Upper bound of the per-frame PSNR (dB).
        data_range: Pixel value range; None infers 255 for uint8 frames and 1.0 otherwise.
        rollouts_per_block: Rollouts processed together (bounds the memory of pixel metrics).
    """

    metric: str = "latent_mse"
    psnr_cap_db: float = 50.0
    data_range: float | None = None
    rollouts_per_block: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metric not in METRICS:
            raise ValueError(f"vision.metric must be one of {METRICS}, got {self.metric!r}")
        check_positive("vision", "psnr_cap_db", self.psnr_cap_db)
        if self.data_range is not None:
            check_positive("vision", "data_range", self.data_range)
        if not isinstance(self.rollouts_per_block, int) or self.rollouts_per_block < 1:
            raise ValueError(f"vision.rollouts_per_block must be an integer >= 1, got {self.rollouts_per_block!r}")


def _as_float_tensor(x, dtype):
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype)


def latent_mse(generated, target) -> np.ndarray:
    """``[N, ...]`` latents (numpy or torch, any device) -> float64 ``[N]`` mean squared error."""
    import torch

    with torch.no_grad():
        g = _as_float_tensor(generated, torch.float32)
        t = _as_float_tensor(target, torch.float32).to(g.device)
        return ((g - t) ** 2).flatten(1).mean(dim=1).double().cpu().numpy()


def _infer_range(frames, data_range: float | None) -> float:
    if data_range is not None:
        return float(data_range)
    return 255.0 if str(frames.dtype).endswith("uint8") else 1.0


def psnr(generated, target, data_range: float, cap_db: float) -> np.ndarray:
    """``[N, T, H, W, C]`` frames -> float64 ``[N]`` mean per-frame PSNR (dB), capped at ``cap_db``."""
    import torch

    with torch.no_grad():
        g = _as_float_tensor(generated, torch.float64)
        t = _as_float_tensor(target, torch.float64).to(g.device)
        mse = ((g - t) ** 2).flatten(2).mean(dim=2)  # [N, T]
        value = 10.0 * torch.log10(data_range**2 / mse.clamp_min(1e-30))
        value = torch.where(torch.isnan(mse), mse, value.clamp(max=cap_db))
        return value.mean(dim=1).cpu().numpy()


def _gaussian_taps(dtype, device):
    import torch

    r = SSIM_TAPS // 2
    x = torch.arange(-r, r + 1, dtype=dtype, device=device)
    w = torch.exp(-(x**2) / (2 * SSIM_SIGMA**2))
    return w / w.sum()


def ssim(generated, target, data_range: float) -> np.ndarray:
    """``[N, T, H, W, C]`` frames (H, W >= 11) -> float64 ``[N]`` mean SSIM over frames and channels."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        g = _as_float_tensor(generated, torch.float64)
        t = _as_float_tensor(target, torch.float64).to(g.device)
        n, frames, h, w, c = g.shape
        if h < SSIM_TAPS or w < SSIM_TAPS:
            raise ValueError(f"ssim needs frames of at least {SSIM_TAPS}x{SSIM_TAPS} pixels, got {h}x{w}")
        # [N*T*C, 1, H, W]: every channel of every frame is an independent image.
        g = g.permute(0, 1, 4, 2, 3).reshape(-1, 1, h, w)
        t = t.permute(0, 1, 4, 2, 3).reshape(-1, 1, h, w)
        taps = _gaussian_taps(g.dtype, g.device)
        kx, ky = taps.view(1, 1, 1, -1), taps.view(1, 1, -1, 1)

        def blur(x):  # separable Gaussian, "valid" region only
            return F.conv2d(F.conv2d(x, kx), ky)

        mu_g, mu_t = blur(g), blur(t)
        var_g = blur(g * g) - mu_g**2
        var_t = blur(t * t) - mu_t**2
        cov = blur(g * t) - mu_g * mu_t
        c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
        ssim_map = ((2 * mu_g * mu_t + c1) * (2 * cov + c2)) / ((mu_g**2 + mu_t**2 + c1) * (var_g + var_t + c2))
        return ssim_map.flatten(1).mean(dim=1).view(n, frames * c).mean(dim=1).cpu().numpy()


@register_reward("vision")
class VisionReward(RewardModule):
    config_class = VisionConfig
    layers = ("visual",)
    needs_geometry = False

    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        cfg: VisionConfig = self.config  # type: ignore[assignment]
        n = batch.size
        if cfg.metric == "latent_mse":
            gen, tgt, what = batch.generated_latents, batch.target_latents, "generated_latents/target_latents"
        else:
            gen, tgt, what = batch.generated_frames, batch.target_frames, "generated_frames/target_frames"
        if gen is None:
            return ModuleResult(
                scores={"visual": np.zeros(n)},
                warnings=[
                    f"batch: vision metric {cfg.metric!r} needs {what}, which are missing; "
                    f"visual scores set to 0 for all {n} rollouts"
                ],
            )
        if cfg.metric == "ssim" and (gen.shape[-3] < SSIM_TAPS or gen.shape[-2] < SSIM_TAPS):
            return ModuleResult(
                scores={"visual": np.zeros(n)},
                warnings=[
                    f"batch: ssim needs frames of at least {SSIM_TAPS}x{SSIM_TAPS} pixels, got "
                    f"{list(gen.shape)}; visual scores set to 0 for all {n} rollouts"
                ],
            )
        values = np.empty(n)
        for lo in range(0, n, cfg.rollouts_per_block):
            sl = slice(lo, lo + cfg.rollouts_per_block)
            if cfg.metric == "latent_mse":
                values[sl] = latent_mse(gen[sl], tgt[sl])
            elif cfg.metric == "psnr":
                values[sl] = psnr(gen[sl], tgt[sl], _infer_range(gen, cfg.data_range), cfg.psnr_cap_db)
            else:
                values[sl] = ssim(gen[sl], tgt[sl], _infer_range(gen, cfg.data_range))
        if cfg.metric == "latent_mse":
            return ModuleResult(scores={"visual": -values}, diagnostics={"latent_mse": values})
        name = "psnr_db" if cfg.metric == "psnr" else "ssim"
        return ModuleResult(scores={"visual": values}, diagnostics={name: values})
