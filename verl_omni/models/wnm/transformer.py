"""The joint video/action diffusion transformer (the trainable part of the WNM model).

Sequence layout (self-attention)::

    [ history video tokens (clean, timestep 0) | target video tokens (noisy) | action tokens (noisy) ]
      Th' * h/ph * w/pw                          Tt' * h/ph * w/pw             32

History and target are patchified with the same Wan patch embedding and get Wan's 3D RoPE as if they were
one video whose target frames follow the history frames; action step k sits at the fractional latent time
where its motion ends (``rope.py``). Video and action tokens of a sample share the noise level sigma; the
history is clean, so modulation is per token (two groups: clean / noisy), the Wan2.2-TI2V idea.

Cross-attention context: [text, image, geometry] tokens projected to the DiT width (``project_context``).

Parameter names of the video part equal those of diffusers' ``WanTransformer3DModel`` (``patch_embedding``,
``condition_embedder``, ``blocks.N``, ``proj_out``, ``scale_shift_table``), so a Wan2.x diffusers state dict
initialises it through :meth:`WNMTransformer.load_wan_video_weights`. The action embedder/head, the
image/geometry projectors and the optional text paths (``text_pool_projector``, ``text_gate_*``) are ours.

This module holds the top-level model (embeddings, sequence layout, heads, forward, Wan weight loading); the
block is in ``block.py``, its attention in ``attention.py`` and the context container/projector in
``context.py``; their public names are re-exported here.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding

from .attention import ATTENTION_BACKENDS
from .block import WNMTransformerBlock, run_blocks
from .compilation import raise_recompile_limit
from .config import WNMConfig
from .context import WNMContext, _FeatureProjector, masked_mean
from .rope import joint_sequence_rope

# Re-exported: callers and tests import these from here (the module they lived in before the split).
__all__ = [
    "ATTENTION_BACKENDS",
    "WAN_VIDEO_PREFIXES",
    "WNMContext",
    "WNMTransformer",
    "WNMTransformerBlock",
    "is_wan_video_key",
]

# The last block returns only the target and action tokens (WNMTransformerBlock.block_forward's outputs_from): the
# heads never read the history tokens' outputs, so that block skips their queries, cross-attention and feed-forward
# (half its work). False runs it over all tokens, for benchmarks that time both; the outputs are the same.
SKIP_UNREAD_OUTPUTS = True

# In inference with the add + norm kernel on, each block but the last leaves its feed-forward residual to the next
# block's kernel (block.run_blocks; eager and fp32 bits unchanged): H100, batch 16, FA4, 451.2 against 454.5 ms
# (session 39). Not in training (12 GiB more activations for 1.3% of a step), nor for inductor's fusion alone (it
# recomputes the sum in both consumers). False = every block adds its own residual, for benchmarks that time both.
DEFER_FFN_RESIDUAL = True

# In bf16/fp16, cross-attention runs over the attended context tokens only (WNMTransformer._cross_attention_context):
# a prompt's padded text positions are dropped instead of masked. Real instructions fill a few dozen of the 512 text
# positions, so a real run's context is about half padding, and every block projected it to keys/values and
# attended over it for nothing (about 3% of a Wan-1.3B forward's FLOPs at 32 text tokens), through a mask that
# rules out flash attention and costs cuDNN an additive bias. Exact in real arithmetic (masked keys weigh 0); in
# bf16 the sums run in another order; fp32 keeps the masked form bit for bit. False = masked everywhere (benchmarks).
COMPACT_CONTEXT = True

# Keys (prefixes) of the Wan-compatible video part; everything else in our state dict is WNM-specific.
WAN_VIDEO_PREFIXES = ("patch_embedding.", "condition_embedder.", "blocks.", "proj_out.", "scale_shift_table")


def is_wan_video_key(key: str) -> bool:
    """True for a state-dict key of the Wan-compatible video part (see :data:`WAN_VIDEO_PREFIXES`)."""
    return any(key == p or key.startswith(p) for p in WAN_VIDEO_PREFIXES)


class WNMTransformer(nn.Module):
    """Joint video/action DiT predicting the rectified-flow velocity ``v = eps - x0``.

    Args:
        config: The model config (dims, latent grid, action layout).
    """

    def __init__(self, config: WNMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        c = config.latent_channels
        self.patch_embedding = nn.Conv3d(c, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim=d, time_freq_dim=config.freq_dim, time_proj_dim=6 * d, text_embed_dim=config.text_dim
        )
        self.blocks = nn.ModuleList(
            [
                WNMTransformerBlock(d, config.ffn_dim, config.num_heads, "rms_norm_across_heads", True, config.eps)
                for _ in range(config.num_layers)
            ]
        )
        self.norm_out = FP32LayerNorm(d, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(d, c * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)

        # WNM-specific parts: action embedder/head and the image/geometry projectors.
        self.action_embedder = nn.Sequential(nn.Linear(config.action_channels, d), nn.SiLU(), nn.Linear(d, d))
        self.action_norm_out = FP32LayerNorm(d, config.eps, elementwise_affine=False)
        self.action_proj_out = nn.Linear(d, config.action_channels)
        self.action_scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.image_projector = _FeatureProjector(config.image_dim, d, config.eps)
        self.geometry_projector = (
            _FeatureProjector(config.geometry_dim, d, config.eps) if config.variant == "wnm_3d" else None
        )
        # Optional global goal path (config.pooled_text_modulation): pooled text tokens -> timestep embedding.
        # Zero-initialised output, so a fresh model starts as the plain cross-attention model.
        self.text_pool_projector = None
        if config.pooled_text_modulation:
            self.text_pool_projector = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
            nn.init.zeros_(self.text_pool_projector[2].weight)
            nn.init.zeros_(self.text_pool_projector[2].bias)
        # Optional gated-attention fusion (config.text_gated_context): pooled text -> channel gate of the visual
        # context tokens. Image and geometry tokens come from different encoders through different projectors,
        # so a channel means different things in each: one gate Linear per kind. Zero-initialised, so the gate
        # starts at exactly 1 (the plain model) while its weight still gets a gradient (d tanh / dx = 1 at 0).
        self.text_gate_image = None
        self.text_gate_geometry = None
        if config.text_gated_context:
            self.text_gate_image = nn.Linear(d, d)
            if self.geometry_projector is not None:
                self.text_gate_geometry = nn.Linear(d, d)
            for gate in (self.text_gate_image, self.text_gate_geometry):
                if gate is not None:
                    nn.init.zeros_(gate.weight)
                    nn.init.zeros_(gate.bias)
        self.compiled_blocks = False
        # "full": every token attends to every token (how Stage II trains). "isolated": history tokens attend
        # only among themselves, so their per-block keys/values depend on the context alone and are computed
        # once per prompt (history_kv) instead of at every step of every rollout. That changes the model: a
        # checkpoint trained with full attention loses the target->history influence; opt-in for speed only.
        self.history_attention = "full"
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def attention_backend(self) -> str:
        """Attention kernel family of every block: ``default``, ``cudnn`` or ``fa4`` (see :data:`ATTENTION_BACKENDS`).

        Setting ``fa4`` where a GPU is visible raises ImportError (with the install command) unless FlashAttention-4
        can be imported, so a missing package fails at set-up and not at the first forward.
        """
        return self.blocks[0].attention_backend if len(self.blocks) else "default"

    @attention_backend.setter
    def attention_backend(self, backend: str) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        if backend == "fa4" and torch.cuda.is_available():
            from .flash_attention4 import fa4_import_problem

            if (problem := fa4_import_problem()) is not None:
                raise ImportError(problem)
        for block in self.blocks:
            block.attention_backend = backend

    def _set_block_switch(self, name: str, on: bool) -> None:
        """Sets the on/off inference fast path ``name`` (a ``WNMTransformerBlock`` attribute) on every block."""
        if on not in (True, False):
            raise ValueError(f"{name} must be True or False, got {on!r}")
        for block in self.blocks:
            setattr(block, name, on)

    gelu_epilogue = property(
        lambda self: self.blocks[0].gelu_epilogue if len(self.blocks) else True,
        lambda self, on: self._set_block_switch("gelu_epilogue", on),
        doc="""Whether inference on CUDA computes each feed-forward's tanh GELU in its first GEMM's epilogue (default
        True; see ``block._feed_forward``). Training always runs the GEMM and the GELU as two kernels, so with it
        the rollout's bf16 log-probs round slightly differently from the update's.""",
    )
    norm_rope_kernel = property(
        lambda self: self.blocks[0].norm_rope_kernel if len(self.blocks) else True,
        lambda self, on: self._set_block_switch("norm_rope_kernel", on),
        doc="""Whether bf16/fp16 inference on CUDA computes self-attention's q/k RMS norm and RoPE in one Triton
        kernel (default True; ``rms_norm_rope.py``; training, fp32 and CPU keep the composite form).""",
    )
    residual_norm_kernel = property(
        lambda self: self.blocks[0].residual_norm_kernel if len(self.blocks) else True,
        lambda self, on: self._set_block_switch("residual_norm_kernel", on),
        doc="""Whether bf16/fp16 inference on CUDA adds each branch to the stream and computes the LayerNorm after
        it in one Triton kernel (default True; ``residual_norm.py``; training, fp32 and CPU keep the composite).""",
    )

    @staticmethod
    def _context_mask(context: WNMContext) -> torch.Tensor | None:
        """The cross-attention mask, or None when it masks nothing.

        A bool mask rules out flash attention and makes PyTorch build an additive bias for cuDNN's kernel (or run
        the memory-efficient one); an all-True mask changes no output, so it is dropped. Unless the context says
        whether its mask is all True (``WNMContext.encoder_mask_all_true``), that is checked on the device: one
        host sync per forward, not per block, which keeps the host from preparing the next call meanwhile.
        """
        mask = context.encoder_mask
        if mask is None:
            return None
        known = context.encoder_mask_all_true
        all_true = bool(mask.all()) if known is None else known
        return None if all_true else mask

    def _cross_attention_context(self, context: WNMContext, dtype: torch.dtype):
        """``(tokens [B, L', D] in dtype, mask [B, L'] bool or None)`` for the blocks' cross-attention.

        In fp32 (or with ``COMPACT_CONTEXT`` off) the context as it is, with :meth:`_context_mask`. In bf16/fp16
        each row's attended tokens move to the front in their order, the context is cut to the longest row's count,
        and a mask remains only where rows differ in length (rows of one prompt never do). One host sync a forward.
        """
        tokens, mask = context.encoder_tokens.to(dtype), context.encoder_mask
        if not COMPACT_CONTEXT or dtype not in (torch.bfloat16, torch.float16) or mask is None:
            return tokens, self._context_mask(context)
        if context.encoder_mask_all_true:
            return tokens, None
        counts = mask.sum(dim=1)
        if context.encoder_attended_range is not None:  # counted on the host once for many forwards
            lo, hi = context.encoder_attended_range
        else:
            lo, hi = (int(v) for v in torch.stack([counts.min(), counts.max()]).tolist())
        if lo == mask.shape[1]:
            return tokens, None
        # A stable sort of "masked?" puts the attended positions first, each row keeping its own order.
        order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)[:, :hi]
        tokens = tokens.gather(1, order[..., None].expand(-1, -1, tokens.shape[-1]))
        if lo == hi:
            return tokens, None
        return tokens, torch.arange(hi, device=mask.device)[None, :] < counts[:, None]

    @property
    def gradient_checkpointing(self) -> bool:
        """True when every block runs under activation checkpointing (applied inside each block, see
        ``WNMTransformerBlock``); False when some or none do. Setting True checkpoints all blocks, False none
        (:meth:`set_activation_checkpointing` checkpoints part of them)."""
        return all(block.activation_checkpointing for block in self.blocks)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.set_activation_checkpointing(None if on else 0)

    def set_activation_checkpointing(self, num_blocks: int | None) -> None:
        """Runs the first ``num_blocks`` blocks under activation checkpointing and the others without.

        A checkpointed block keeps only its inputs for the backward and recomputes its forward there; a block
        without it keeps every activation and recomputes nothing. Checkpointing only part of the blocks spends
        memory left over by checkpointing all of them on less recomputation (measure the trade with
        ``scripts/bench_stage3_gpu.py --ckpt-blocks``). Only memory and time change, not the math.

        Why the first blocks: every block has the same shapes, so any choice of ``num_blocks`` blocks saves the
        same activations and recomputes the same work; a prefix (block ``i`` is checkpointed iff
        ``i < num_blocks``) is the simplest choice to state and check.

        Args:
            num_blocks: How many blocks, from the first, to checkpoint: None = all, 0 = none.

        Raises:
            ValueError: ``num_blocks`` is not None or an int in ``[0, number of blocks]``.
        """
        total = len(self.blocks)
        if num_blocks is None:
            num_blocks = total
        # bool is an int subclass; True would silently mean "1 block".
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 0 <= num_blocks <= total:
            raise ValueError(
                f"num_blocks must be None (all) or an int in [0, {total}] (this model has {total} blocks), "
                f"got {num_blocks!r}"
            )
        for i, block in enumerate(self.blocks):
            block.activation_checkpointing = i < num_blocks

    def compile_blocks(self, mode: str | None = None, dynamic: bool | None = None, multi_kernel: bool = False) -> None:
        """Compiles the transformer block's math with ``torch.compile`` (inductor), once for all blocks.

        One compiled function is shared by every block and bound as each block's ``block_forward``: the blocks have
        the same code and shapes, so dynamo traces it once (parameters are graph inputs), and each block's
        ``__call__`` still runs its module hooks eagerly, which is what FSDP2's per-block all-gather and
        reshard need. Inductor fuses the fp32 norm/modulation/gating chains and the RoPE arithmetic around the
        bf16 matmuls and attention, the part eager mode spends in many small memory-bound kernels.

        Args:
            mode: ``torch.compile`` mode (None = default; ``max-autotune-no-cudagraphs`` tunes GEMMs longer).
            dynamic: Passed to ``torch.compile`` (None = dynamo's automatic dynamic shapes).
            multi_kernel: Inductor's ``triton.multi_kernel``: for reductions up to 16x longer than its default
                limit it also generates a persistent kernel (the whole row in registers, read once) beside the
                looped one (the row read twice) and keeps whichever runs faster at the first call. Our LayerNorms
                and RMS norms reduce over the model width (1536 at Wan-1.3B), above the default limit of 1024.
                Not with ``mode`` (torch.compile takes a mode or options, not both).
        """
        if self.compiled_blocks:
            return
        raise_recompile_limit()
        if multi_kernel and mode is not None:
            raise ValueError(f"compile_blocks: multi_kernel cannot be combined with mode={mode!r}")
        # No FX graph cache: torch 2.11 fails loading a cached multi-kernel graph (MultiKernelCall.load_cache, H100,
        # session 39). Compiling afresh costs start-up time only.
        options = {"triton.multi_kernel": 1, "fx_graph_cache": False} if multi_kernel else None
        compiled = torch.compile(WNMTransformerBlock.block_forward, mode=mode, dynamic=dynamic, options=options)
        for block in self.blocks:
            block.block_forward = types.MethodType(compiled, block)
        self.compiled_blocks = True

    # ----- layout ---------------------------------------------------------------------------------------
    def _grid(self, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
        pt, ph, pw = self.config.patch_size
        _, t, h, w = latent_shape
        return (t // pt, h // ph, w // pw)

    def sequence_layout(self) -> dict[str, slice]:
        """Token slices of the joint sequence: ``history``, ``target``, ``action``.

        The target and action slices depend only on the config's frame counts and image size, never on the
        history content, so the rollout can address them statically.
        """
        nh = math.prod(self._grid(self.config.history_latent_shape))
        nt = math.prod(self._grid(self.config.target_latent_shape))
        na = self.config.action_steps
        return {"history": slice(0, nh), "target": slice(nh, nh + nt), "action": slice(nh + nt, nh + nt + na)}

    def rotary_embedding(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, S, 1, head_dim]`` for the joint sequence, cached per device."""
        key = (str(device),)
        if key not in self._rope_cache:
            cfg = self.config
            cos, sin = joint_sequence_rope(
                self._grid(cfg.history_latent_shape),
                self._grid(cfg.target_latent_shape),
                cfg.action_steps,
                cfg.vae_temporal_compression,
                cfg.head_dim,
                cfg.rope_theta,
            )
            self._rope_cache[key] = (cos.to(device), sin.to(device))
        return self._rope_cache[key]

    # ----- context --------------------------------------------------------------------------------------
    def project_context(
        self,
        text_features: torch.Tensor,
        text_mask: torch.Tensor,
        image_features: torch.Tensor,
        geometry_features: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projects frozen-encoder features to DiT-width context tokens.

        With ``text_gated_context`` the image and geometry tokens are multiplied channel-wise by
        ``1 + tanh(Linear(pooled))``, ``pooled [B, D]`` the masked mean of the projected text tokens (one gate
        Linear per kind, see ``__init__``). The context is computed once per prompt, so the gate adds no cost
        per denoising step.

        Args:
            text_features: ``[B, Lt, text_dim]``.
            text_mask: ``[B, Lt]`` bool, True for real tokens.
            image_features: ``[B, Li, image_dim]``.
            geometry_features: ``[B, Lg, geometry_dim]`` (wnm_3d) or None (wnm_2d).

        Returns:
            ``(tokens [B, Lt + Li (+ Lg), D], mask [B, Lt + Li (+ Lg)] bool)``.
        """
        if (geometry_features is None) != (self.geometry_projector is None):
            raise ValueError(f"variant {self.config.variant}: geometry features must be given iff variant is wnm_3d")
        # Wan zero-fills text positions past the prompt before its projection; keep that convention.
        text = text_features * text_mask[..., None].to(text_features.dtype)
        text_tokens = self.condition_embedder.text_embedder(text)
        visual = [self.image_projector(image_features)]
        gates = [self.text_gate_image]
        masks = [text_mask.bool(), torch.ones(image_features.shape[:2], dtype=torch.bool, device=text_mask.device)]
        if geometry_features is not None:
            visual.append(self.geometry_projector(geometry_features))
            gates.append(self.text_gate_geometry)
            masks.append(torch.ones(geometry_features.shape[:2], dtype=torch.bool, device=text_mask.device))
        if self.text_gate_image is not None:
            # Padded text positions hold the projection's bias, not zeros: the mean must skip them.
            pooled = masked_mean(text_tokens, text_mask.bool())
            visual = [v * (1 + torch.tanh(gate(pooled)))[:, None, :] for v, gate in zip(visual, gates, strict=True)]
        return torch.cat([text_tokens, *visual], dim=1), torch.cat(masks, dim=1)

    def set_history_attention(self, mode: str) -> None:
        """``full`` (default, the trained model) or ``isolated`` (history keys/values cached per prompt)."""
        if mode not in ("full", "isolated"):
            raise ValueError(f"history_attention must be 'full' or 'isolated', got {mode!r}")
        self.history_attention = mode

    def history_kv(self, context: WNMContext) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per-block self-attention keys/values of the history tokens of an ``isolated`` model.

        They depend only on the context (history latents at timestep 0, context tokens) and the weights, so
        the rollout computes them once per prompt and every step of every rollout reuses them.

        Returns:
            One ``(key, value)`` per block, each ``[B, Nh, heads, head_dim]`` in the DiT dtype.
        """
        dtype = self.patch_embedding.weight.dtype
        b = context.batch_size
        x = self._patchify(context.history_latents.to(dtype))
        nh = x.shape[1]
        _, proj = self._time_embeddings(torch.zeros(b, device=x.device), dtype, context)
        cos, sin = self.rotary_embedding(x.device)
        rope = (cos[:, :nh], sin[:, :nh])
        ctx, mask = self._cross_attention_context(context, dtype)
        kv = []
        for block in self.blocks:
            x, block_kv = block(x, ctx, proj[:, 0], rope, mask, None, None, True)
            kv.append(block_kv)
        return tuple(kv)

    def _forward_isolated(self, target_latents, actions, sigma, context: WNMContext):
        """Forward of an ``isolated`` model: only target and action tokens run, over cached history keys/values."""
        layout = self.sequence_layout()
        dtype = self.patch_embedding.weight.dtype
        history = context.history_kv if context.history_kv is not None else self.history_kv(context)
        x = torch.cat([self._patchify(target_latents.to(dtype)), self.action_embedder(actions.to(dtype))], dim=1)
        temb, proj = self._time_embeddings(sigma, dtype, context)
        cos, sin = self.rotary_embedding(x.device)
        nh = layout["history"].stop
        rope = (cos[:, nh:], sin[:, nh:])
        ctx, mask = self._cross_attention_context(context, dtype)
        x = self._run_blocks(x, (ctx, proj[:, 1], rope, mask, None), prefixes=history)
        nt = layout["target"].stop - layout["target"].start
        return self._heads(x[:, :nt], x[:, nt:], temb[:, 1:2])

    def _run_blocks(self, x, block_args, prefixes=None, last_outputs_from: int = 0) -> torch.Tensor:
        """:func:`block.run_blocks` over the blocks, with the residual deferred where ``DEFER_FFN_RESIDUAL`` says."""
        defer = DEFER_FFN_RESIDUAL and not torch.is_grad_enabled() and self.residual_norm_kernel
        return run_blocks(self.blocks, x, block_args, prefixes, last_outputs_from, defer)

    def _heads(
        self, xt: torch.Tensor, xa: torch.Tensor, noisy_temb: torch.Tensor, action_temb: torch.Tensor | None = None
    ):
        """Output heads: Wan's on the target tokens, ours on the action tokens (``noisy_temb [B, 1, D]``; the action
        head uses ``action_temb [B, 1, D]`` instead when the actions have their own noise level)."""
        shift, scale = (self.scale_shift_table + noisy_temb.float()).chunk(2, dim=1)
        xt = (self.norm_out(xt.float()) * (1 + scale) + shift).type_as(xt)
        v_video = self._unpatchify(self.proj_out(xt), self.config.target_latent_shape)
        action_temb = noisy_temb if action_temb is None else action_temb
        shift, scale = (self.action_scale_shift_table + action_temb.float()).chunk(2, dim=1)
        xa = (self.action_norm_out(xa.float()) * (1 + scale) + shift).type_as(xa)
        return v_video, self.action_proj_out(xa)

    # ----- forward --------------------------------------------------------------------------------------
    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()

    def _unpatchify(self, tokens: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
        # Inverse of Wan's unpatchify: [B, N, pt*ph*pw*C] -> [B, C, T, H, W].
        b = tokens.shape[0]
        pt, ph, pw = self.config.patch_size
        t, h, w = self._grid(latent_shape)
        x = tokens.reshape(b, t, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _time_embeddings(
        self,
        sigma: torch.Tensor,
        dtype: torch.dtype,
        context: WNMContext | None = None,
        action_sigma: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the G noise levels per sample: history (0) and target/actions (sigma), or history,
        target (sigma) and actions (``action_sigma``) when the actions have their own level (G = 3).

        With ``pooled_text_modulation`` the pooled instruction of ``context`` is added to all before the
        projection to the blocks' modulation.

        Returns:
            ``temb [B, G, D]`` and ``timestep_proj [B, G, 6, D]``.
        """
        ce = self.condition_embedder
        levels = [torch.zeros_like(sigma), sigma] + ([] if action_sigma is None else [action_sigma.to(sigma)])
        t = torch.stack(levels, dim=1).float() * self.config.timestep_scale  # [B, G]
        freq = ce.timesteps_proj(t.flatten())
        embed_dtype = next(iter(ce.time_embedder.parameters())).dtype
        b, groups = sigma.shape[0], len(levels)
        temb = ce.time_embedder(freq.to(embed_dtype)).to(dtype).view(b, groups, -1)
        if self.text_pool_projector is not None:
            if context is None:
                raise ValueError("pooled_text_modulation: the time embeddings need the context (its text tokens)")
            temb = temb + self._pooled_text(context, dtype)[:, None]
        proj = ce.time_proj(ce.act_fn(temb))
        return temb, proj.view(b, groups, 6, -1)

    def _pooled_text(self, context: WNMContext, dtype: torch.dtype) -> torch.Tensor:
        """``[B, D]``: the projected text tokens (the first ``text_max_length`` context tokens), masked mean,
        through ``text_pool_projector``."""
        lt = self.config.text_max_length
        mask = None if context.encoder_mask is None else context.encoder_mask[:, :lt]
        return self.text_pool_projector(masked_mean(context.encoder_tokens[:, :lt].to(dtype), mask))

    def forward(
        self,
        target_latents: torch.Tensor,
        actions: torch.Tensor,
        sigma: torch.Tensor,
        context: WNMContext,
        action_sigma: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicts velocities for the noisy target video latents and actions.

        Args:
            target_latents: ``[B, C, Tt', h, w]`` noisy target latents x_sigma.
            actions: ``[B, 32, 4]`` noisy normalized actions x_sigma.
            sigma: ``[B]`` noise level in [0, 1] shared by the sample's video and action tokens.
            context: Encoded history latents and context tokens for the B samples.
            action_sigma: ``[B]`` noise level of the actions when it differs from the video's (Stage-II training
                with independent noise, ``SFTConfig.independent_action_noise``); None = ``sigma`` (rollouts, the
                ordinary forward). The actions then form a third modulation group.

        Returns:
            ``(v_video [B, C, Tt', h, w], v_action [B, 32, 4])``.
        """
        cfg = self.config
        b = target_latents.shape[0]
        if tuple(target_latents.shape[1:]) != cfg.target_latent_shape:
            raise ValueError(
                f"target_latents must be [B, {cfg.target_latent_shape}], got {tuple(target_latents.shape)}"
            )
        if tuple(context.history_latents.shape[1:]) != cfg.history_latent_shape:
            raise ValueError(
                f"context.history_latents must be [B, {cfg.history_latent_shape}], got "
                f"{tuple(context.history_latents.shape)}"
            )
        if tuple(actions.shape) != (b, cfg.action_steps, cfg.action_channels):
            raise ValueError(
                f"actions must be [{b}, {cfg.action_steps}, {cfg.action_channels}], got {tuple(actions.shape)}"
            )
        if sigma.shape != (b,) or context.batch_size != b:
            raise ValueError(
                f"sigma must be [{b}] and context batch {b}; got {tuple(sigma.shape)}, {context.batch_size}"
            )

        if action_sigma is not None and action_sigma.shape != (b,):
            raise ValueError(f"action_sigma must be [{b}], got {tuple(action_sigma.shape)}")
        if self.history_attention == "isolated":
            if action_sigma is not None:
                raise ValueError("action_sigma (independent action noise) is a Stage-II training input; isolated "
                                 "history attention is a rollout mode: use history_attention='full'")  # fmt: skip
            return self._forward_isolated(target_latents, actions, sigma, context)
        dtype = self.patch_embedding.weight.dtype
        x = torch.cat(
            [
                self._patchify(context.history_latents.to(dtype)),
                self._patchify(target_latents.to(dtype)),
                self.action_embedder(actions.to(dtype)),
            ],
            dim=1,
        )
        layout = self.sequence_layout()
        nh = layout["history"].stop
        na = actions.shape[1]
        if action_sigma is None:
            groups = [nh, x.shape[1] - nh]  # clean history | noisy target + actions
        else:
            groups = [nh, x.shape[1] - nh - na, na]  # clean history | target at sigma | actions at action_sigma
        temb, timestep_proj = self._time_embeddings(sigma, dtype, context, action_sigma)
        rope = self.rotary_embedding(x.device)
        ctx, mask = self._cross_attention_context(context, dtype)
        x = self._run_blocks(
            x, (ctx, timestep_proj, rope, mask, groups), last_outputs_from=nh if SKIP_UNREAD_OUTPUTS else 0
        )
        if not SKIP_UNREAD_OUTPUTS or not len(self.blocks):
            x = x[:, nh:]  # history outputs are not used: the heads read the target and action tokens

        action_temb = None if action_sigma is None else temb[:, 2:3]
        nt = layout["target"].stop - nh
        return self._heads(x[:, :nt], x[:, nt:], temb[:, 1:2], action_temb)

    # ----- Wan weights ----------------------------------------------------------------------------------
    @torch.no_grad()
    def load_wan_video_weights(self, state_dict: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Initialises the video part from a diffusers ``WanTransformer3DModel`` state dict.

        Args:
            state_dict: Wan transformer tensors (e.g. read from its safetensors shards).

        Returns:
            ``(missing, unexpected)``: video-part keys the state dict lacks, and state-dict keys that have no
            place in the video part (e.g. I2V image embedder or added-KV projections). Our action and projector
            parameters are never reported: Wan has none.

        Raises:
            ValueError: A shared key has a different shape (names the tensor and both shapes).
        """
        own = self.state_dict()
        video_keys = [k for k in own if is_wan_video_key(k)]
        matched = {}
        for k in video_keys:
            if k in state_dict:
                if tuple(state_dict[k].shape) != tuple(own[k].shape):
                    raise ValueError(
                        f"Wan weights: tensor {k!r} has shape {tuple(state_dict[k].shape)}, the WNM config "
                        f"({self.config.size}) expects {tuple(own[k].shape)}"
                    )
                matched[k] = state_dict[k]
        missing = [k for k in video_keys if k not in matched]
        unexpected = sorted(k for k in state_dict if k not in matched)
        self.load_state_dict(matched, strict=False)
        return missing, unexpected
