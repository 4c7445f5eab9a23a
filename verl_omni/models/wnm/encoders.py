"""Frozen encoders of the WNM model, each behind a small interface.

Interfaces (all modules are frozen by :func:`freeze`; inputs are uint8 frames in ``[B, T, H, W, 3]``):

- text: ``tokenizer(list[str]) -> (ids [B, L] long, mask [B, L] bool)``; ``text_encoder(ids, mask) ->
  [B, L, text_dim]``. ``builtin``: a UTF-8 byte tokenizer plus a small transformer (no vocabulary file, no
  download). ``umt5``: transformers' UMT5 encoder and tokenizer loaded from local directories.
- image: ``image_encoder(frames [B, H, W, 3] uint8) -> [B, image_tokens, image_dim]`` of the current view.
  ``builtin``: a small strided conv net; ``clip``: transformers' CLIP vision tower (penultimate hidden states,
  as Wan's I2V conditioning uses).
- geometry: the :class:`GeometryEncoder` protocol; ``builtin``: :class:`BuiltinGeometryEncoder`; ``external``:
  built from the WNM-3D checkout (``external.py``).
- VAE: diffusers ``AutoencoderKLWan``; ``tiny`` is a small randomly initialised instance of the same class.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import WNMConfig

# The OpenAI CLIP pixel statistics that CLIP vision towers were trained with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def freeze(module: nn.Module) -> nn.Module:
    """Puts a module in eval mode with no parameter requiring grad."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def frames_to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., H, W, 3]`` -> float ``[..., 3, H, W]`` in [0, 1]."""
    if frames.dtype != torch.uint8 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [..., H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    return frames.movedim(-1, -3).float() / 255.0


# ----- text ---------------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 byte tokenizer: id = byte + 3; 0 = pad, 1 = end of text, 2 = truncated marker.

    A byte vocabulary needs no learned vocabulary file, so the tiny model works on a fresh machine.
    """

    PAD, EOS, TRUNC, OFFSET = 0, 1, 2, 3
    vocab_size = 256 + OFFSET

    def __init__(self, max_length: int) -> None:
        if max_length < 2:
            raise ValueError(f"ByteTokenizer.max_length must be >= 2, got {max_length}")
        self.max_length = max_length

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``ids [B, max_length]`` long and ``mask [B, max_length]`` bool."""
        ids = torch.full((len(texts), self.max_length), self.PAD, dtype=torch.long)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"instruction {i} is {type(text).__name__}, expected str")
            b = [c + self.OFFSET for c in text.encode("utf-8")]
            tail = self.EOS if len(b) < self.max_length else self.TRUNC
            b = b[: self.max_length - 1] + [tail]
            ids[i, : len(b)] = torch.tensor(b, dtype=torch.long)
        return ids, ids != self.PAD

    def to_dict(self) -> dict:
        return {"kind": "byte", "max_length": self.max_length}


class BuiltinTextEncoder(nn.Module):
    """Byte embedding + learned positions + a small pre-norm transformer encoder.

    Args:
        vocab_size: Token ids range.
        max_length: Sequence length.
        dim: Output feature width (``text_dim``).
        layers: Transformer layers.
    """

    def __init__(self, vocab_size: int, max_length: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(1, max_length, dim) * 0.02)
        heads = max(1, dim // 32)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ids, mask [B, L]`` -> features ``[B, L, dim]``."""
        h = self.embed(ids) + self.pos[:, : ids.shape[1]]
        h = self.encoder(h, src_key_padding_mask=~mask)
        return self.norm(h)


class UMT5TextEncoder(nn.Module):
    """transformers' UMT5 encoder; returns the last hidden state (Wan's text conditioning)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state


class HFTokenizer:
    """Wraps a transformers tokenizer into the ``(ids, mask)`` interface with fixed padding length."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.tokenizer(
            texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return out["input_ids"], out["attention_mask"].bool()


# ----- image --------------------------------------------------------------------------------------------
class BuiltinImageEncoder(nn.Module):
    """Small strided conv net: current frame -> a grid of ``tokens`` feature vectors.

    Each grid cell carries a learned position embedding: the DiT's cross-attention is blind to the order of
    its context tokens, so without it the policy could tell *that* the named object is in view but not
    *where* (left or right), which is what it must steer by.

    Args:
        dim: Output feature width (``image_dim``).
        tokens: Output tokens; must be a square number (a ``g x g`` pooled grid).
    """

    def __init__(self, dim: int, tokens: int) -> None:
        super().__init__()
        self.grid = int(round(math.sqrt(tokens)))
        if self.grid * self.grid != tokens:
            raise ValueError(f"WNMConfig.image_tokens: builtin image encoder needs a square number, got {tokens}")
        self.net = nn.Sequential(
            nn.Conv2d(3, dim // 2, 4, stride=4),
            nn.GELU(),
            nn.Conv2d(dim // 2, dim, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(dim, dim, 3, padding=1),
        )
        self.cell_embed = nn.Parameter(torch.randn(tokens, dim) * 0.02)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """``frames [B, H, W, 3]`` uint8 -> ``[B, tokens, dim]``."""
        x = frames_to_unit(frames).to(self.net[0].weight.dtype) * 2 - 1
        h = F.adaptive_avg_pool2d(self.net(x), self.grid)
        return h.flatten(2).transpose(1, 2) + self.cell_embed


class CLIPImageEncoder(nn.Module):
    """transformers' CLIP vision tower; returns the penultimate layer's hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        size = self.model.config.image_size
        x = frames_to_unit(frames).to(self.mean.device)
        x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)
        x = ((x - self.mean) / self.std).to(next(self.model.parameters()).dtype)
        return self.model(pixel_values=x, output_hidden_states=True).hidden_states[-2]


# ----- geometry -----------------------------------------------------------------------------------------
@runtime_checkable
class GeometryEncoder(Protocol):
    """What the model needs from a geometry encoder (built-in or from the WNM-3D checkout).

    Attributes:
        output_dim: Feature width of the returned tokens (must equal ``WNMConfig.geometry_dim``).
        num_tokens: Tokens per sample (must equal ``WNMConfig.geometry_tokens``).
    """

    output_dim: int
    num_tokens: int

    def __call__(self, history_frames: torch.Tensor) -> torch.Tensor:
        """``history_frames [B, T, H, W, 3]`` uint8 -> geometry tokens ``[B, num_tokens, output_dim]``."""
        ...


def geometry_frame_indices(history_frames: int, used: int) -> list[int]:
    """``used`` frame indices spread evenly over the history, always including the newest frame."""
    if used >= history_frames:
        return list(range(history_frames))
    step = (history_frames - 1) / (used - 1) if used > 1 else 0
    return [int(round(history_frames - 1 - step * (used - 1 - i))) for i in range(used)]


class BuiltinGeometryEncoder(nn.Module):
    """A small multi-view conv encoder standing in for VGGT-style geometry tokens.

    Encodes ``frames`` evenly spaced history frames with a shared conv net, pools each view into a grid of
    cells and adds learned per-view and per-cell embeddings: ``tokens`` = views x cells tokens.

    Args:
        dim: Output feature width (``geometry_dim``).
        tokens: Output tokens.
        frames: History frames looked at.
        history_frames: History length T (to pick the frame indices).
    """

    def __init__(self, dim: int, tokens: int, frames: int, history_frames: int) -> None:
        super().__init__()
        self.output_dim = dim
        self.num_tokens = tokens
        self.frame_indices = geometry_frame_indices(history_frames, frames)
        if tokens % len(self.frame_indices):
            raise ValueError(
                f"WNMConfig.geometry_tokens ({tokens}) must be a multiple of "
                f"geometry_frames ({len(self.frame_indices)})"
            )
        per_view = tokens // len(self.frame_indices)
        self.grid = int(round(math.sqrt(per_view)))
        if self.grid * self.grid != per_view:
            raise ValueError(f"WNMConfig.geometry_tokens / geometry_frames must be a square number, got {per_view}")
        self.net = nn.Sequential(
            nn.Conv2d(3, dim // 2, 4, stride=4),
            nn.GELU(),
            nn.Conv2d(dim // 2, dim, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(dim, dim, 3, padding=1),
        )
        self.view_embed = nn.Parameter(torch.randn(len(self.frame_indices), dim) * 0.02)
        # Where in the view a cell lies (see BuiltinImageEncoder: context tokens have no order of their own).
        self.cell_embed = nn.Parameter(torch.randn(per_view, dim) * 0.02)

    def forward(self, history_frames: torch.Tensor) -> torch.Tensor:
        t = history_frames.shape[1]
        if t <= max(self.frame_indices):
            raise ValueError(f"geometry encoder needs >= {max(self.frame_indices) + 1} history frames, got {t}")
        return self.encode_views(history_frames[:, self.frame_indices])

    def encode_views(self, views: torch.Tensor) -> torch.Tensor:
        """``views [B, V, H, W, 3]`` uint8 (the history at ``frame_indices``) -> ``[B, num_tokens, output_dim]``.

        Stage-II SFT keeps only these views of each state when it trains this encoder (not the whole history).
        """
        b = views.shape[0]
        if views.shape[1] != len(self.frame_indices):
            raise ValueError(f"geometry encoder needs {len(self.frame_indices)} views, got {views.shape[1]}")
        x = frames_to_unit(views.flatten(0, 1)).to(self.view_embed.dtype) * 2 - 1
        h = F.adaptive_avg_pool2d(self.net(x), self.grid).flatten(2).transpose(1, 2)  # [B*V, g*g, D]
        h = h.view(b, len(self.frame_indices), -1, self.output_dim) + self.view_embed[None, :, None, :]
        h = h + self.cell_embed[None, None]
        return h.flatten(1, 2)


# ----- VAE ----------------------------------------------------------------------------------------------
def tiny_vae_config(config: WNMConfig) -> dict:
    """``AutoencoderKLWan`` kwargs of the randomly initialised tiny VAE of a config."""
    downsamples = len(config.vae_dim_mult) - 1
    if 2**downsamples != config.vae_spatial_compression:
        raise ValueError(
            f"WNMConfig.vae_dim_mult: {len(config.vae_dim_mult)} levels give {2**downsamples}x spatial compression, "
            f"vae_spatial_compression is {config.vae_spatial_compression}"
        )
    temporal = int(round(math.log2(config.vae_temporal_compression)))
    temperal_downsample = [False] * (downsamples - temporal) + [True] * temporal
    return {
        "base_dim": config.vae_base_dim,
        "z_dim": config.latent_channels,
        "dim_mult": list(config.vae_dim_mult),
        "num_res_blocks": config.vae_num_res_blocks,
        "attn_scales": [],
        "temperal_downsample": temperal_downsample,
        "latents_mean": [0.0] * config.latent_channels,
        "latents_std": [1.0] * config.latent_channels,
    }
