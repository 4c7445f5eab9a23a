"""Typed configuration of the WNM world-action model, with the named sizes.

A :class:`WNMConfig` fixes everything that must agree between a checkpoint, the data converter and the
rollout: frame counts, image size, VAE compression, latent shapes, action layout, DiT dims and the kinds of
frozen encoders. It is serialised into ``config.json`` of a checkpoint (see ``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl_omni.contracts import VARIANTS
from verl_omni.data.actions import ACTION_CHANNELS, ACTION_LAYOUT

CONFIG_FORMAT = "wnm-config/1"
TEXT_ENCODER_KINDS = ("builtin", "umt5")
IMAGE_ENCODER_KINDS = ("builtin", "clip")
GEOMETRY_ENCODER_KINDS = ("builtin", "external")
VAE_KINDS = ("wan2.1", "wan2.2", "tiny")


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"WNMConfig.{field_name}: {msg}")


@dataclass(frozen=True)
class WNMConfig:
    """Configuration of the joint video/action DiT and its frozen parts.

    Attributes:
        size: Name of the size preset this config came from (informational, part of the contract).
        variant: ``wnm_3d`` (geometry tokens in the context) or ``wnm_2d`` (none).
        history_frames / target_frames: RGB frames of the history and target clips (33 each).
        image_size: ``(H, W)`` of every RGB frame.
        fps: Frame rate of the clips.
        latent_channels: VAE latent channels C.
        vae_kind: ``tiny`` (randomly initialised small AutoencoderKLWan), ``wan2.1`` or ``wan2.2`` (loaded).
        vae_base_dim / vae_dim_mult / vae_num_res_blocks: AutoencoderKLWan dims (used for ``tiny``).
        vae_temporal_compression / vae_spatial_compression: frames / pixels per latent cell.
        patch_size: DiT 3D patch ``(pt, ph, pw)`` over latents.
        num_layers / num_heads / head_dim / ffn_dim / freq_dim: Wan transformer dims.
        text_dim: Width of text-encoder features (input of the Wan text projection).
        text_max_length: Tokens per instruction (padded).
        text_encoder_kind / text_encoder_layers: ``builtin`` byte encoder (layers used) or ``umt5``.
        pooled_text_modulation: Also add the masked mean of the projected instruction tokens, through a small
            zero-initialised MLP, to the timestep embedding that modulates every block (the pooled-text path of
            SD3/Flux). Wan reads the instruction only through cross-attention, where context tokens never meet
            each other; this gives the goal a global path. Off by default (Wan's layout, older checkpoints).
        text_gated_context: Multiply the projected image (and geometry) context tokens channel-wise by a gate
            ``1 + tanh(Linear(pooled text))``, the gated-attention fusion of Chaplot et al. 2018 (cf. FiLM), so
            "is the named object here" becomes a feature of each visual token. The Linear layers are
            zero-initialised: a fresh model equals the plain one. Off by default (Wan's layout, older checkpoints).
        image_encoder_kind / image_dim / image_tokens: ``builtin`` conv encoder or ``clip``; feature width and
            token count it produces.
        geometry_encoder_kind / geometry_dim / geometry_tokens / geometry_frames: ``builtin`` or
            ``external`` (from ``WNM3D_SOURCE_ROOT``); feature width, token count, history frames it sees.
        rope_theta: RoPE base.
        action_steps / action_channels / action_chunks: the action layout (32 x 4, 4 chunks).
        timestep_scale: sigma in [0, 1] is embedded as ``sigma * timestep_scale`` (Wan used 1000).
        eps: Norm epsilon of the blocks.
    """

    size: str
    variant: str = "wnm_3d"
    history_frames: int = 33
    target_frames: int = 33
    image_size: tuple[int, int] = (64, 64)
    fps: int = 4
    latent_channels: int = 16
    vae_kind: str = "tiny"
    vae_base_dim: int = 16
    vae_dim_mult: tuple[int, ...] = (1, 2, 2, 2)
    vae_num_res_blocks: int = 1
    vae_temporal_compression: int = 4
    vae_spatial_compression: int = 8
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    ffn_dim: int = 256
    freq_dim: int = 64
    text_dim: int = 64
    text_max_length: int = 32
    text_encoder_kind: str = "builtin"
    text_encoder_layers: int = 2
    pooled_text_modulation: bool = False
    text_gated_context: bool = False
    image_encoder_kind: str = "builtin"
    image_dim: int = 64
    image_tokens: int = 16
    geometry_encoder_kind: str = "builtin"
    geometry_dim: int = 64
    geometry_tokens: int = 16
    geometry_frames: int = 4
    rope_theta: float = 10000.0
    action_steps: int = ACTION_LAYOUT.steps
    action_channels: int = len(ACTION_CHANNELS)
    action_chunks: int = ACTION_LAYOUT.chunks
    timestep_scale: float = 1000.0
    eps: float = 1e-6
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", tuple(int(v) for v in self.image_size))
        object.__setattr__(self, "patch_size", tuple(int(v) for v in self.patch_size))
        object.__setattr__(self, "vae_dim_mult", tuple(int(v) for v in self.vae_dim_mult))
        _require(self.variant in VARIANTS, "variant", f"must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("history_frames", "target_frames"):
            t = getattr(self, name)
            _require(
                t >= 1 and (t - 1) % self.vae_temporal_compression == 0,
                name,
                f"must be 1 + k * vae_temporal_compression ({self.vae_temporal_compression}), got {t}",
            )
        _require(len(self.image_size) == 2, "image_size", f"must be (H, W), got {self.image_size}")
        cell = self.vae_spatial_compression * self.patch_size[1]
        for axis, px in zip("HW", self.image_size):
            _require(
                px > 0 and px % (self.vae_spatial_compression * self.patch_size[1 if axis == "H" else 2]) == 0,
                "image_size",
                f"{axis}={px} must be a positive multiple of vae_spatial_compression x patch ({cell})",
            )
        _require(len(self.patch_size) == 3 and min(self.patch_size) >= 1, "patch_size", "must be 3 positive ints")
        _require(self.patch_size[0] == 1, "patch_size", "temporal patch must be 1 (action tokens align to latents)")
        _require(self.vae_kind in VAE_KINDS, "vae_kind", f"must be one of {VAE_KINDS}, got {self.vae_kind!r}")
        _require(self.text_encoder_kind in TEXT_ENCODER_KINDS, "text_encoder_kind", f"must be in {TEXT_ENCODER_KINDS}")
        _require(
            self.image_encoder_kind in IMAGE_ENCODER_KINDS, "image_encoder_kind", f"must be in {IMAGE_ENCODER_KINDS}"
        )
        _require(
            self.geometry_encoder_kind in GEOMETRY_ENCODER_KINDS,
            "geometry_encoder_kind",
            f"must be in {GEOMETRY_ENCODER_KINDS}",
        )
        for name in (
            "num_layers",
            "num_heads",
            "head_dim",
            "ffn_dim",
            "freq_dim",
            "text_dim",
            "latent_channels",
            "image_dim",
            "image_tokens",
            "geometry_dim",
            "geometry_tokens",
            "geometry_frames",
            "fps",
            "text_max_length",
        ):
            _require(int(getattr(self, name)) > 0, name, f"must be > 0, got {getattr(self, name)}")
        # Wan's 3D RoPE gives h and w 2 * (head_dim // 6) dims each and t the rest; all must be even.
        _require(
            self.head_dim % 2 == 0 and self.head_dim >= 6, "head_dim", f"must be even and >= 6, got {self.head_dim}"
        )
        _require(self.freq_dim % 2 == 0, "freq_dim", f"must be even, got {self.freq_dim}")
        _require(self.action_steps == ACTION_LAYOUT.steps, "action_steps", f"must be {ACTION_LAYOUT.steps}")
        _require(self.action_channels == len(ACTION_CHANNELS), "action_channels", f"must be {len(ACTION_CHANNELS)}")
        _require(self.action_chunks == ACTION_LAYOUT.chunks, "action_chunks", f"must be {ACTION_LAYOUT.chunks}")
        _require(
            self.target_frames - 1 == self.action_steps,
            "target_frames",
            f"must be action_steps + 1 ({self.action_steps + 1}): one action per target frame transition",
        )
        _require(self.timestep_scale > 0, "timestep_scale", "must be > 0")
        for name in ("pooled_text_modulation", "text_gated_context"):
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")

    # ----- derived shapes -------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """DiT width D."""
        return self.num_heads * self.head_dim

    @property
    def latent_hw(self) -> tuple[int, int]:
        return (self.image_size[0] // self.vae_spatial_compression, self.image_size[1] // self.vae_spatial_compression)

    def latent_frames(self, frames: int) -> int:
        """Latent frames T' = (T - 1) // temporal + 1 of a causal Wan VAE."""
        return (frames - 1) // self.vae_temporal_compression + 1

    @property
    def history_latent_shape(self) -> tuple[int, int, int, int]:
        return (self.latent_channels, self.latent_frames(self.history_frames), *self.latent_hw)

    @property
    def target_latent_shape(self) -> tuple[int, int, int, int]:
        return (self.latent_channels, self.latent_frames(self.target_frames), *self.latent_hw)

    @property
    def tokens_per_latent_frame(self) -> int:
        h, w = self.latent_hw
        return (h // self.patch_size[1]) * (w // self.patch_size[2])

    @property
    def history_tokens(self) -> int:
        return self.history_latent_shape[1] * self.tokens_per_latent_frame

    @property
    def target_tokens(self) -> int:
        return self.target_latent_shape[1] * self.tokens_per_latent_frame

    @property
    def sequence_length(self) -> int:
        """Self-attention sequence: history + target video tokens + one token per action step."""
        return self.history_tokens + self.target_tokens + self.action_steps

    @property
    def context_tokens(self) -> int:
        """Cross-attention context length: text + image (+ geometry for wnm_3d)."""
        geo = self.geometry_tokens if self.variant == "wnm_3d" else 0
        return self.text_max_length + self.image_tokens + geo

    # ----- serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["format"] = CONFIG_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "model_config") -> WNMConfig:
        d = dict(d)
        fmt = d.pop("format", CONFIG_FORMAT)
        if fmt != CONFIG_FORMAT:
            raise ValueError(f"{source}: unsupported format {fmt!r} (expected {CONFIG_FORMAT!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}")
        if "size" not in d:
            raise ValueError(f"{source}: missing field 'size'")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_size(cls, name: str, variant: str = "wnm_3d", **overrides: Any) -> WNMConfig:
        """Builds a named size preset (``tiny``, ``small``, ``wan2.1-1.3b``, ``wan2.2-5b``)."""
        if name not in SIZES:
            raise ValueError(f"WNMConfig.size: unknown size {name!r}; choose one of {sorted(SIZES)}")
        kwargs = {**SIZES[name], **overrides}
        return cls(size=name, variant=variant, **kwargs)

    def transform_metadata(self) -> dict[str, Any]:
        """What a data pipeline must reproduce to feed this model (frames, image size, fps, actions)."""
        return {
            "history_frames": self.history_frames,
            "target_frames": self.target_frames,
            "image_size": list(self.image_size),
            "fps": self.fps,
            "vae_temporal_compression": self.vae_temporal_compression,
            "vae_spatial_compression": self.vae_spatial_compression,
            "history_latent_shape": list(self.history_latent_shape),
            "target_latent_shape": list(self.target_latent_shape),
            "action_layout": {
                "steps": self.action_steps,
                "channels": list(ACTION_CHANNELS),
                "chunks": self.action_chunks,
                "frame": "robot frame of the previous pose",
            },
            "pixel_range": [-1.0, 1.0],
        }


# The four presets. Real sizes take the transformer dims of the published diffusers configs
# (Wan2.1-T2V-1.3B: 12 x 128 heads, 30 layers, ffn 8960; Wan2.2-TI2V-5B: 24 x 128, 30 layers, ffn 14336,
# 48 latent channels with a 16x spatial VAE); image sizes are ours (navigation clips are small).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "image_size": (128, 128),
        "vae_base_dim": 32,
        "num_layers": 8,
        "num_heads": 6,
        "head_dim": 64,
        "ffn_dim": 1536,
        "freq_dim": 256,
        "text_dim": 256,
        "text_max_length": 64,
        "text_encoder_layers": 4,
        "image_dim": 256,
        "image_tokens": 64,
        "geometry_dim": 256,
        "geometry_tokens": 64,
    },
    "wan2.1-1.3b": {
        "image_size": (256, 256),
        "vae_kind": "wan2.1",
        "vae_base_dim": 96,
        "vae_dim_mult": (1, 2, 4, 4),
        "vae_num_res_blocks": 2,
        "num_layers": 30,
        "num_heads": 12,
        "head_dim": 128,
        "ffn_dim": 8960,
        "freq_dim": 256,
        "text_dim": 4096,
        "text_max_length": 512,
        "text_encoder_kind": "umt5",
        "image_encoder_kind": "clip",
        "image_dim": 1280,
        "image_tokens": 257,
        "geometry_dim": 1024,
        "geometry_tokens": 256,
        "geometry_frames": 8,
    },
    "wan2.2-5b": {
        "image_size": (352, 352),
        "latent_channels": 48,
        "vae_kind": "wan2.2",
        "vae_base_dim": 160,
        "vae_dim_mult": (1, 2, 4, 4),
        "vae_num_res_blocks": 2,
        "vae_spatial_compression": 16,
        "num_layers": 30,
        "num_heads": 24,
        "head_dim": 128,
        "ffn_dim": 14336,
        "freq_dim": 256,
        "text_dim": 4096,
        "text_max_length": 512,
        "text_encoder_kind": "umt5",
        "image_encoder_kind": "clip",
        "image_dim": 1280,
        "image_tokens": 257,
        "geometry_dim": 1024,
        "geometry_tokens": 256,
        "geometry_frames": 8,
    },
}
