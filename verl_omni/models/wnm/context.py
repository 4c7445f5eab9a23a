"""The cross-attention context of the WNM transformer: the per-prompt conditioning and its feature projector.

:class:`WNMContext` carries what the frozen encoders computed for a prompt (history latents, context tokens,
optionally cached history keys/values); :class:`_FeatureProjector` maps an encoder's features to the DiT width
(used by :meth:`WNMTransformer.project_context` for the image and geometry tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm


@dataclass
class WNMContext:
    """Conditioning of one or more samples, computed once per prompt by the frozen encoders.

    Attributes:
        history_latents: ``[B, C, Th', h, w]`` normalized VAE latents of the 33 history frames.
        encoder_tokens: ``[B, L, D]`` text, image and geometry tokens, already projected to the DiT width.
        encoder_mask: ``[B, L]`` bool, True = attend; None = attend to all.
        history_kv: Per-block ``(key, value)`` of the history tokens, each ``[B, Nh, heads, head_dim]``, for
            models with ``history_attention == "isolated"`` (see :meth:`WNMTransformer.history_kv`); None =
            computed inside the forward.
        encoder_mask_all_true: Whether every entry of ``encoder_mask`` is True, when the caller knows it on the
            host (e.g. SFT, from its CPU-side row draws). None = not known: the transformer then checks on the
            device, which waits for the device once per forward (an all-True mask is dropped so that flash
            attention can run). A wrong value changes nothing but the attention kernel when the mask is all True;
            True with a mask that masks something would ignore it, so set it only from the mask itself.
        encoder_attended_range: ``(fewest, most)`` attended tokens of a row (True entries of ``encoder_mask``), when
            known on the host; see :meth:`with_attended_range`. None = not known: the bf16 forward, which cuts the
            context to its attended tokens, then counts them on the device, waiting for the device once per
            forward. Kept by :meth:`to`, dropped by :meth:`select` (other rows may count otherwise).
    """

    history_latents: torch.Tensor
    encoder_tokens: torch.Tensor
    encoder_mask: torch.Tensor | None = None
    history_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    encoder_mask_all_true: bool | None = None
    encoder_attended_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        b = self.history_latents.shape[0]
        if self.history_latents.ndim != 5:
            raise ValueError(
                f"WNMContext.history_latents must be [B, C, T, h, w], got {tuple(self.history_latents.shape)}"
            )
        if self.encoder_tokens.ndim != 3 or self.encoder_tokens.shape[0] != b:
            raise ValueError(f"WNMContext.encoder_tokens must be [B={b}, L, D], got {tuple(self.encoder_tokens.shape)}")
        if self.encoder_mask is not None and (
            self.encoder_mask.dtype != torch.bool
            or tuple(self.encoder_mask.shape) != tuple(self.encoder_tokens.shape[:2])
        ):
            raise ValueError(
                f"WNMContext.encoder_mask must be bool [B, L]={tuple(self.encoder_tokens.shape[:2])}, got "
                f"{self.encoder_mask.dtype} {tuple(self.encoder_mask.shape)}"
            )
        if self.encoder_attended_range is not None:
            # A range narrower than the mask's would make the bf16 forward cut attended tokens silently.
            length = self.encoder_tokens.shape[1]
            lo, hi = self.encoder_attended_range
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi))
            if self.encoder_mask is None or not ints or not 0 <= lo <= hi <= length:
                raise ValueError(
                    f"WNMContext.encoder_attended_range must be (fewest, most) attended tokens of a row of "
                    f"encoder_mask, integers 0 <= fewest <= most <= L={length}, got {self.encoder_attended_range} "
                    f"with {'no' if self.encoder_mask is None else 'a'} mask; set it with with_attended_range()"
                )

    def with_attended_range(self) -> WNMContext:
        """The same context with :attr:`encoder_attended_range` filled in (one host sync, here instead of in every
        forward that reuses the context, e.g. the denoising steps of one rollout chunk)."""
        if self.encoder_mask is None or self.encoder_attended_range is not None:
            return self
        counts = self.encoder_mask.sum(dim=1)
        lo, hi = (int(v) for v in torch.stack([counts.min(), counts.max()]).tolist())
        return dataclasses.replace(self, encoder_attended_range=(lo, hi))

    @property
    def batch_size(self) -> int:
        return self.history_latents.shape[0]

    def select(self, index: torch.Tensor) -> WNMContext:
        """Gathers rows (e.g. ``index = prompt_of_rollout`` to share one encoded prompt across its rollouts)."""
        index = index.to(self.history_latents.device, torch.long)
        kv = None
        if self.history_kv is not None:
            kv = tuple((k.index_select(0, index), v.index_select(0, index)) for k, v in self.history_kv)
        return WNMContext(
            history_latents=self.history_latents.index_select(0, index),
            encoder_tokens=self.encoder_tokens.index_select(0, index),
            encoder_mask=None if self.encoder_mask is None else self.encoder_mask.index_select(0, index),
            history_kv=kv,
            # Rows of an all-True mask are all True; rows of another mask may be, so that becomes unknown.
            encoder_mask_all_true=True if self.encoder_mask_all_true else None,
        )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> WNMContext:
        """Moves tensors; ``dtype`` applies to the float tensors only (the mask stays bool)."""
        kv = None
        if self.history_kv is not None:
            kv = tuple((k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)) for k, v in self.history_kv)
        return WNMContext(
            history_latents=self.history_latents.to(device=device, dtype=dtype),
            encoder_tokens=self.encoder_tokens.to(device=device, dtype=dtype),
            encoder_mask=None if self.encoder_mask is None else self.encoder_mask.to(device=device),
            history_kv=kv,
            encoder_mask_all_true=self.encoder_mask_all_true,
            encoder_attended_range=self.encoder_attended_range,
        )

    def with_history_kv(self, history_kv) -> WNMContext:
        """The same context carrying precomputed history keys/values (one entry per block)."""
        return dataclasses.replace(self, history_kv=tuple(history_kv))


class _FeatureProjector(nn.Module):
    """LayerNorm + 2-layer GELU MLP from an encoder's feature width to the DiT width."""

    def __init__(self, in_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = FP32LayerNorm(in_dim, eps)
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.float()).type_as(x)
        return self.linear_2(F.gelu(self.linear_1(h), approximate="tanh"))


def masked_mean(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``tokens [B, L, D]`` over the positions where ``mask [B, L]`` is True (all when None).

    Computed in ``tokens.dtype``; a row with no True position gives zeros. Returns ``[B, D]``.
    """
    if mask is None:
        weights = torch.ones(tokens.shape[:2], dtype=tokens.dtype, device=tokens.device)
    else:
        weights = mask.to(tokens.dtype)
    return (tokens * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp_min(1.0)
