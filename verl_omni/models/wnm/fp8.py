"""An FP8 copy of the DiT for rollouts: the blocks' linear layers in float8 (e4m3) with row-wise scales.

The rollout spends about half of its compiled forward in the blocks' matrix products (attention projections and
feed-forward). On GPUs with FP8 tensor cores (compute capability 8.9 and up) those run on ``torch._scaled_mm``
with float8 operands: weights quantized once per weight version, one scale per output row; activations
quantized on the fly, one scale per token. Everything else (embeddings, norms, modulation, attention, heads)
stays in the copy's activation dtype.

Why not torchao's ``Float8DynamicActivationFloat8WeightConfig``: it calls the same ``torch._scaled_mm`` with the
same row-wise recipe, but refuses to run without a CUDA FP8 device, so the CPU test suite could not exercise the
path the GPU runs; ``torch._scaled_mm`` itself runs on CPU, and this module is that recipe in 60 lines.

An FP8 rollout samples from a slightly different policy than the bf16 weights being trained, so its own log-probs
are not the trainer's: the trainer recomputes the old log-probs under the bf16 weights
(``algorithm.recompute_old_logp``), which the config requires with it.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

FLOAT8 = torch.float8_e4m3fn
_FLOAT8_MAX = float(torch.finfo(FLOAT8).max)  # 448
# A zero row (all-zero weights or activations) gets this scale instead of 0, so that it quantizes to zeros.
_MIN_SCALE = 1e-12


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(x_fp8 [M, K] e4m3, scale [M, 1] fp32)`` with ``x ≈ x_fp8 * scale`` (amax per row -> 448)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / _FLOAT8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale).clamp(-_FLOAT8_MAX, _FLOAT8_MAX).to(FLOAT8), scale


class Float8Linear(nn.Module):
    """``nn.Linear`` inference in FP8: ``y = (x_q s_x) (W_q s_w)^T + b`` through ``torch._scaled_mm``.

    The weight is stored quantized (``weight_fp8 [N, K]`` e4m3, ``weight_scale [1, N]`` fp32); :meth:`load` takes
    a new full-precision weight (each weight version). Inference only: nothing here has a gradient.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=FLOAT8, device=device))
        self.register_buffer("weight_scale", torch.ones(1, out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device)
        q.load(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return q

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantizes ``weight [N, K]`` (any float dtype) into this layer; ``bias [N]`` is kept in full precision."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"Float8Linear.load: weight of shape {tuple(weight.shape)}, expected {expected}")
        w_fp8, scale = quantize_rowwise(weight.to(self.weight_fp8.device))
        self.weight_fp8.copy_(w_fp8)
        self.weight_scale.copy_(scale.t())
        if self.bias is not None:
            if bias is None:
                raise ValueError("Float8Linear.load: this layer has a bias and none was given")
            self.bias.copy_(bias)

    def _apply(self, fn, recurse=True):
        # module.to(torch.bfloat16) casts every floating-point buffer, float8 and the fp32 scales included; a
        # round trip through bf16 would lose scale bits. Keep this layer's dtypes and follow only device moves.
        before = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (bfloat16 on CUDA, where row-wise scaling needs it)."""
        lead = x.shape[:-1]
        x_fp8, x_scale = quantize_rowwise(x.reshape(-1, self.in_features))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = torch._scaled_mm(
            x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, bias=bias, out_dtype=x.dtype
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The block linears by role, as suffixes of their qualified names (diffusers' Wan module names).
LAYER_GROUPS = {
    "attention": (".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".attn1.to_out.0",
                  ".attn2.to_q", ".attn2.to_k", ".attn2.to_v", ".attn2.to_out.0"),
    "feed_forward_in": (".ffn.net.0.proj",),
    "feed_forward_out": (".ffn.net.2",),
}  # fmt: skip


def _block_linears(transformer: nn.Module, kinds: tuple[type, ...] = (nn.Linear, Float8Linear)):
    """``(qualified name, parent, attribute)`` of every linear layer of ``kinds`` inside ``transformer.blocks``."""
    found = []
    for name, module in transformer.named_modules():
        if not name.startswith("blocks."):
            continue
        for attr, child in module.named_children():
            if isinstance(child, kinds):
                found.append((f"{name}.{attr}", module, attr))
    return found


def float8_rollout_copy(transformer: nn.Module, groups: Iterable[str] | None = None) -> nn.Module:
    """A copy of an unsharded ``WNMTransformer`` whose blocks' linear layers are :class:`Float8Linear`.

    The copy keeps the source's dtype and device for everything else and shares nothing with it; refresh it after
    each update with :func:`load_float8_copy`. Compile it (``compile_blocks()``) like the bf16 model. Building it
    holds a full-precision copy of the source for a moment (the linears are converted after copying).

    Args:
        transformer: The model to copy.
        groups: Which block linears to convert, by :data:`LAYER_GROUPS` name (None = all). On an H100 the
            activation quantization cost about what the float8 product saved except in the feed-forward's first
            layer (``scripts/bench_fp8_linear.py``), so a subset may be the faster copy.

    Raises:
        ValueError: An unknown group name, or no group.
    """
    names = tuple(LAYER_GROUPS) if groups is None else tuple(groups)
    unknown = sorted(set(names) - set(LAYER_GROUPS))
    if unknown or not names:
        raise ValueError(
            f"float8_rollout_copy: groups must be a non-empty subset of {sorted(LAYER_GROUPS)}, got {names}"
        )
    suffixes = tuple(suffix for g in names for suffix in LAYER_GROUPS[g])
    dup = copy.deepcopy(transformer).requires_grad_(False).eval()
    for name, parent, attr in _block_linears(dup, (nn.Linear,)):
        if name.endswith(suffixes):
            setattr(parent, attr, Float8Linear.from_linear(getattr(parent, attr)))
    return dup


@torch.no_grad()
def load_float8_copy(dup: nn.Module, names: Iterable[str], source: Callable[[str], torch.Tensor]) -> int:
    """Loads full (unsharded) tensors, named as in the bf16 model's ``state_dict``, into the FP8 copy.

    ``names`` must cover the copy exactly once: unknown, missing or repeated names raise before any tensor is
    fetched or written, so a refused load leaves the copy as it was. Then ``source(name)`` is called once per name,
    in one fixed order (the copy's own), so that ranks whose ``source`` all-gathers a shard call it in step; each
    block linear is quantized as soon as its weight (and bias) arrive, so at most one full-precision layer is held.

    Returns:
        The number of tensors loaded.
    """
    fp8_layers = {name: getattr(parent, attr) for name, parent, attr in _block_linears(dup, (Float8Linear,))}
    linear_names = {f"{layer}.{leaf}": layer for layer, m in fp8_layers.items()
                    for leaf in (("weight", "bias") if m.bias is not None else ("weight",))}  # fmt: skip
    fp8_buffers = {f"{layer}.{leaf}" for layer in fp8_layers for leaf in ("weight_fp8", "weight_scale", "bias")}
    plain = {n: t for n, t in dup.state_dict(keep_vars=True).items() if n not in fp8_buffers}
    given = list(names)
    repeated = sorted(n for n, k in Counter(given).items() if k > 1)
    unknown = sorted(set(given) - set(plain) - set(linear_names))
    missing = sorted((set(plain) | set(linear_names)) - set(given))
    if repeated or unknown or missing:
        raise KeyError(
            f"load_float8_copy: names do not match the FP8 rollout copy (unknown {unknown[:3]}, missing "
            f"{missing[:3]}, repeated {repeated[:3]}); nothing was loaded"
        )
    for layer, module in fp8_layers.items():
        module.load(source(f"{layer}.weight"), source(f"{layer}.bias") if module.bias is not None else None)
    for name, tensor in plain.items():
        tensor.copy_(source(name).to(tensor.device, tensor.dtype))
    return len(given)
