"""An FP8 linear layer's expected output, worked out in float64 independently of ``verl_omni.models.wnm.fp8``."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def dequantized_linear(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` in float64: each row of the weight and of ``x`` scaled so its max |value| is 448,
    rounded to the nearest e4m3 value, scaled back, then an ordinary matmul plus the bias."""

    def dequantize_rows(t: torch.Tensor) -> torch.Tensor:
        scale = t.abs().amax(1, keepdim=True) / 448
        return (t / scale).float().to(E4M3).double() * scale

    w = dequantize_rows(linear.weight.detach().double())
    x2 = dequantize_rows(x.reshape(-1, x.shape[-1]).double())
    out = x2 @ w.t()
    if linear.bias is not None:
        out = out + linear.bias.detach().double()
    return out.reshape(*x.shape[:-1], w.shape[0])
