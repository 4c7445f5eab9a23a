"""Helpers shared by the benchmark scripts: device-synchronized timing, peak memory, the diffusers anchor."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Frees cached blocks and restarts the peak-memory counter (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    """Peak allocated GiB since :func:`reset_peak`; NaN on CPU, where torch does not track it."""
    return torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")


def sm_clock_mhz(device: torch.device) -> int | None:
    """The GPU's SM clock over its last sample period (``torch.cuda.clock_rate``, through NVML), or None on CPU or
    where NVML (the ``nvidia-ml-py`` package) is missing. Read beside a timing, it tells a slower step from a
    throttled card."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # NVML missing or not answering: the timing stands without it
        return None


def median_time(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median wall seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (device-synchronized)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def timed_once(fn, device: torch.device) -> tuple[float, object]:
    """``(seconds, fn())`` of one device-synchronized call."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def wan_anchor(cfg, device, dtype, text_dim: int | None = None):
    """diffusers ``WanTransformer3DModel`` with the DiT dims of a ``WNMConfig`` (random weights, eval mode).

    Args:
        cfg: The ``WNMConfig`` whose dims to copy.
        text_dim: Width of the text tokens it takes (default ``cfg.dim``: context already projected).
    """
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=tuple(cfg.patch_size),
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        text_dim=cfg.dim if text_dim is None else text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        eps=cfg.eps,
    )
    return model.to(device=device, dtype=dtype).eval()
