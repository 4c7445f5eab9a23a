"""The complete WNM world-action model: trainable joint DiT plus frozen VAE and encoders.

Only ``transformer`` trains. The frozen parts are in eval mode with ``requires_grad=False`` and stay in eval
mode when the parent's ``train()`` is called; :meth:`WNMModel.encode_context` runs them once per prompt so
that all rollouts of the prompt share one :class:`WNMContext` (``WNMContext.select``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from verl_omni.data.actions import ActionNormalization

from . import external
from .config import WNMConfig
from .encoders import (
    BuiltinGeometryEncoder,
    BuiltinImageEncoder,
    BuiltinTextEncoder,
    ByteTokenizer,
    CLIPImageEncoder,
    HFTokenizer,
    UMT5TextEncoder,
    freeze,
    tiny_vae_config,
)
from .transformer import WNMContext, WNMTransformer

FROZEN_PARTS = ("vae", "text_encoder", "image_encoder", "geometry_encoder")


@dataclass(frozen=True)
class EncoderSources:
    """Local directories of pretrained frozen parts (real sizes only; nothing is downloaded).

    Defaults come from ``WNM_TOKENIZER_SOURCE``, ``WNM_TEXT_ENCODER_SOURCE``, ``WNM_IMAGE_ENCODER_SOURCE`` and
    ``WNM_VAE_SOURCE``.
    """

    tokenizer: str | None = None
    text_encoder: str | None = None
    image_encoder: str | None = None
    vae: str | None = None

    @classmethod
    def from_env(cls) -> EncoderSources:
        get = lambda k: os.environ.get(k) or None
        return cls(
            get("WNM_TOKENIZER_SOURCE"),
            get("WNM_TEXT_ENCODER_SOURCE"),
            get("WNM_IMAGE_ENCODER_SOURCE"),
            get("WNM_VAE_SOURCE"),
        )


def _require_source(path: str | None, env: str, what: str) -> Path:
    if not path:
        raise FileNotFoundError(f"{what}: no local source; set {env} to a local directory (nothing is downloaded)")
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{what}: {env}={p} is not a directory")
    return p


def _hf_dir(path: Path, subfolder: str) -> Path:
    """Accepts either the component directory or a pipeline root holding it as ``subfolder``."""
    return path / subfolder if (path / subfolder / "config.json").is_file() else path


def build_vae(config: WNMConfig, sources: EncoderSources) -> nn.Module:
    from diffusers import AutoencoderKLWan

    if config.vae_kind == "tiny":
        return AutoencoderKLWan(**tiny_vae_config(config))
    src = _hf_dir(_require_source(sources.vae, "WNM_VAE_SOURCE", f"{config.vae_kind} VAE"), "vae")
    vae = AutoencoderKLWan.from_pretrained(src, local_files_only=True)
    if vae.config.z_dim != config.latent_channels:
        raise ValueError(f"{src}: VAE z_dim {vae.config.z_dim} != WNMConfig.latent_channels {config.latent_channels}")
    return vae


def build_text_encoder(config: WNMConfig, sources: EncoderSources):
    """Returns ``(tokenizer, text_encoder)``."""
    if config.text_encoder_kind == "builtin":
        tok = ByteTokenizer(config.text_max_length)
        return tok, BuiltinTextEncoder(
            tok.vocab_size, config.text_max_length, config.text_dim, config.text_encoder_layers
        )
    from transformers import AutoTokenizer, UMT5EncoderModel

    tok_src = _hf_dir(_require_source(sources.tokenizer, "WNM_TOKENIZER_SOURCE", "UMT5 tokenizer"), "tokenizer")
    enc_src = _hf_dir(_require_source(sources.text_encoder, "WNM_TEXT_ENCODER_SOURCE", "UMT5 encoder"), "text_encoder")
    model = UMT5EncoderModel.from_pretrained(enc_src, local_files_only=True)
    if model.config.d_model != config.text_dim:
        raise ValueError(f"{enc_src}: UMT5 d_model {model.config.d_model} != WNMConfig.text_dim {config.text_dim}")
    return HFTokenizer(
        AutoTokenizer.from_pretrained(tok_src, local_files_only=True), config.text_max_length
    ), UMT5TextEncoder(model)


def build_image_encoder(config: WNMConfig, sources: EncoderSources) -> nn.Module:
    if config.image_encoder_kind == "builtin":
        return BuiltinImageEncoder(config.image_dim, config.image_tokens)
    from transformers import CLIPVisionModel

    src = _hf_dir(
        _require_source(sources.image_encoder, "WNM_IMAGE_ENCODER_SOURCE", "CLIP image encoder"), "image_encoder"
    )
    model = CLIPVisionModel.from_pretrained(src, local_files_only=True)
    if model.config.hidden_size != config.image_dim:
        raise ValueError(
            f"{src}: CLIP hidden_size {model.config.hidden_size} != WNMConfig.image_dim {config.image_dim}"
        )
    return CLIPImageEncoder(model)


def build_geometry_encoder(config: WNMConfig) -> nn.Module | None:
    if config.variant == "wnm_2d":
        return None
    if config.geometry_encoder_kind == "external":
        return external.build_external_geometry_encoder(config.to_dict())
    return BuiltinGeometryEncoder(
        config.geometry_dim, config.geometry_tokens, config.geometry_frames, config.history_frames
    )


class WNMModel(nn.Module):
    """Trainable joint DiT + frozen VAE, text, image and geometry encoders + action normalization.

    Args:
        config: Model config.
        action_normalization: Normalization of actions (identity when None).
        sources: Local pretrained sources for real-size frozen parts (default: from the environment).
        frozen: Prebuilt frozen parts by name (``vae``, ``tokenizer``, ``text_encoder``, ``image_encoder``,
            ``geometry_encoder``), used by the checkpoint loader; others are built from the config.
    """

    def __init__(
        self,
        config: WNMConfig,
        action_normalization: ActionNormalization | None = None,
        sources: EncoderSources | None = None,
        frozen: dict | None = None,
    ) -> None:
        super().__init__()
        sources = sources or EncoderSources.from_env()
        frozen = dict(frozen or {})
        self.config = config
        self.action_normalization = action_normalization or ActionNormalization.identity()
        self.transformer = WNMTransformer(config)
        if "tokenizer" in frozen or "text_encoder" in frozen:
            self.tokenizer, text_encoder = frozen["tokenizer"], frozen["text_encoder"]
        else:
            self.tokenizer, text_encoder = build_text_encoder(config, sources)
        self.vae = freeze(frozen["vae"] if "vae" in frozen else build_vae(config, sources))
        self.text_encoder = freeze(text_encoder)
        self.image_encoder = freeze(
            frozen["image_encoder"] if "image_encoder" in frozen else build_image_encoder(config, sources)
        )
        geometry = frozen["geometry_encoder"] if "geometry_encoder" in frozen else build_geometry_encoder(config)
        self.geometry_encoder = None if geometry is None else freeze(geometry)
        lat = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.register_buffer("latents_mean", lat, persistent=False)
        std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.register_buffer("latents_std", std, persistent=False)

    def train(self, mode: bool = True) -> WNMModel:
        """Sets train mode on the transformer only; frozen parts stay in eval mode."""
        super().train(mode)
        for name in FROZEN_PARTS:
            part = getattr(self, name)
            if part is not None:
                part.eval()
        return self

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    def set_latent_statistics(self, mean: list[float], std: list[float]) -> None:
        """Sets the per-channel latent normalization ``(z - mean) / std`` (stored in the VAE config).

        Pretrained Wan VAEs ship these statistics; a randomly initialised tiny VAE is calibrated on data.
        """
        c = self.config.latent_channels
        if len(mean) != c or len(std) != c or min(std) <= 0:
            raise ValueError(f"latent statistics need {c} means and {c} positive stds")
        self.vae.register_to_config(latents_mean=[float(v) for v in mean], latents_std=[float(v) for v in std])
        self.latents_mean.copy_(torch.tensor(mean, dtype=self.latents_mean.dtype).view(1, -1, 1, 1, 1))
        self.latents_std.copy_(torch.tensor(std, dtype=self.latents_std.dtype).view(1, -1, 1, 1, 1))

    # ----- video ----------------------------------------------------------------------------------------
    def _check_frames(self, frames: torch.Tensor, name: str, t: int | None = None) -> None:
        h, w = self.config.image_size
        if frames.dtype != torch.uint8 or frames.ndim != 5 or tuple(frames.shape[2:]) != (h, w, 3):
            raise ValueError(f"{name} must be uint8 [B, T, {h}, {w}, 3], got {frames.dtype} {tuple(frames.shape)}")
        if t is not None and frames.shape[1] != t:
            raise ValueError(f"{name} must have {t} frames, got {frames.shape[1]}")

    @torch.no_grad()
    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, T, H, W, 3]`` -> normalized latents ``[B, C, (T - 1) // 4 + 1, h, w]`` (posterior mode)."""
        self._check_frames(frames, "frames")
        vae_dtype = next(self.vae.parameters()).dtype
        x = frames.to(self.device).permute(0, 4, 1, 2, 3).to(vae_dtype) / 127.5 - 1.0
        z = self.vae.encode(x).latent_dist.mode().float()
        return (z - self.latents_mean) / self.latents_std

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents ``[B, C, T', h, w]`` -> uint8 frames ``[B, T, H, W, 3]``."""
        vae_dtype = next(self.vae.parameters()).dtype
        z = latents.float().to(self.device) * self.latents_std + self.latents_mean
        x = self.vae.decode(z.to(vae_dtype)).sample.float().clamp(-1, 1)
        return ((x + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)

    # ----- context --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, instructions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Instructions -> ``(features [B, Lt, text_dim] float32, mask [B, Lt] bool)``."""
        ids, mask = self.tokenizer(list(instructions))
        return self.encode_tokens(ids, mask), mask.to(self.device)

    @torch.no_grad()
    def encode_tokens(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, Lt]`` and mask ``[B, Lt]`` bool (from ``self.tokenizer``) -> features
        ``[B, Lt, text_dim]`` float32: :meth:`encode_text` for a caller that also keeps the ids."""
        return self.text_encoder(ids.to(self.device), mask.to(self.device)).float()

    @torch.no_grad()
    def encode_condition_features(self, history_frames: torch.Tensor, instructions: list[str]) -> dict:
        """Runs the frozen text/image/geometry encoders (no projection).

        Returns:
            dict with ``text [B, Lt, text_dim]``, ``text_mask [B, Lt] bool``, ``image [B, Li, image_dim]``,
            ``geometry [B, Lg, geometry_dim]`` or None.
        """
        self._check_frames(history_frames, "history_frames", self.config.history_frames)
        if len(instructions) != history_frames.shape[0]:
            raise ValueError(f"{len(instructions)} instructions for {history_frames.shape[0]} history clips")
        text, mask = self.encode_text(instructions)
        return {"text": text, "text_mask": mask, **self.encode_view_features(history_frames)}

    @torch.no_grad()
    def encode_view_features(self, history_frames: torch.Tensor) -> dict:
        """Runs the frozen image and geometry encoders on uint8 history clips ``[B, T, H, W, 3]``.

        Returns:
            dict with ``image [B, Li, image_dim]`` and ``geometry [B, Lg, geometry_dim]`` or None.
        """
        self._check_frames(history_frames, "history_frames", self.config.history_frames)
        frames = history_frames.to(self.device)
        return {
            "image": self.image_encoder(frames[:, -1]).float(),
            "geometry": None if self.geometry_encoder is None else self.geometry_encoder(frames).float(),
        }

    def context_from_features(self, history_latents: torch.Tensor, features: dict) -> WNMContext:
        """Projects precomputed encoder features with the transformer's (trainable) projectors.

        ``features["text_mask_all_true"]`` (optional): whether every entry of ``features["text_mask"]`` is True,
        when the caller knows it on the host; the context's mask is all True exactly then (image and geometry
        tokens are always attended), so the transformer need not check it on the device
        (``WNMContext.encoder_mask_all_true``).
        """
        dtype = self.transformer.patch_embedding.weight.dtype
        tokens, mask = self.transformer.project_context(
            features["text"].to(dtype),
            features["text_mask"],
            features["image"].to(dtype),
            None if features["geometry"] is None else features["geometry"].to(dtype),
        )
        return WNMContext(history_latents=history_latents, encoder_tokens=tokens, encoder_mask=mask,
                          encoder_mask_all_true=features.get("text_mask_all_true"))  # fmt: skip

    @torch.no_grad()
    def encode_context(self, history_frames: torch.Tensor, instructions: list[str]) -> WNMContext:
        """Encodes a prompt once: history latents and projected context tokens.

        Args:
            history_frames: uint8 ``[B, 33, H, W, 3]``; the last frame is the current view.
            instructions: B instruction strings.

        Returns:
            A :class:`WNMContext` on the model's device.
        """
        features = self.encode_condition_features(history_frames, instructions)
        return self.context_from_features(self.encode_video(history_frames), features)


def build_wnm_model(config: WNMConfig, action_normalization: ActionNormalization | None = None):
    """Builds the model: through the external adapter's ``build_wnm_model`` when ``WNM3D_SOURCE_ROOT`` is set
    and the adapter provides one, otherwise our :class:`WNMModel`."""
    if external.source_root() is not None:
        model = external.build_external_model(config.to_dict())
        if model is not None:
            return model
    return WNMModel(config, action_normalization)
