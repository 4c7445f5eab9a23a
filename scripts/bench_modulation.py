#!/usr/bin/env python
"""A/B/C of the eager block's low-precision fast paths: bf16 LayerNorms, one addcmul per modulation group.

Times, in one process and interleaved (A, B, C, anchor, A, B, C, anchor, ...) so that clock drift hits all alike,
the eager bf16 DiT forward of our WNMTransformer in three forms, and diffusers' ``WanTransformer3DModel`` eager as
the anchor, at the dims of ``scripts/bench_stage3_gpu.py``:

- now: ``block.LOW_PRECISION_NORM`` and ``block.LOW_PRECISION_ADDCMUL`` on (the default);
- fp32 norms: the LayerNorms on an fp32 copy as diffusers' ``FP32LayerNorm`` does (session 17's block);
- mul + add: that, and the modulation as a mul into an fp32 temporary then an add (the block before it);
- last block over all tokens: the default block, but the last block also computes the history tokens' outputs,
  which the heads never read (``transformer.SKIP_UNREAD_OUTPUTS = False``, the forward before session 30);
- separate GELU kernel: the default block without the feed-forward's GELU in the GEMM epilogue
  (``WNMTransformer.gelu_epilogue = False``), eager and (with ``--compiled``) compiled;
- q/k norm + RoPE composite / by inductor: self-attention's q/k RMS norm and RoPE as separate operators (eager)
  or inductor's fusion of them (compiled), instead of the Triton kernel of ``rms_norm_rope.py``
  (``WNMTransformer.norm_rope_kernel = False``, the forward before session 38);
- residual added in its block: each block adds its own feed-forward residual instead of leaving it to the next
  block's first LayerNorm (``transformer.DEFER_FFN_RESIDUAL = False``), compiled;
- add + norm by inductor: the block's three residual adds and the LayerNorms after them as inductor fuses them,
  instead of the Triton kernel of ``residual_norm.py`` (``WNMTransformer.residual_norm_kernel = False``), compiled;
  and session 38 (both off): both of the above, the compiled forward before session 39;
- stacked RoPE: the rotary embedding in its form before session 33 (:func:`stacked_rope`: the same arithmetic as a
  stacked result whose layout inductor picks), eager and compiled;
- split/cat modulation: compiled blocks build the grouped modulation and gating by splitting and concatenating, as
  before session 33 (``block.COMPILED_GROUP_SELECT = False``); and compiled with both earlier forms (the forward
  session 33 measured), and with the separate GELU kernel too (session 32's forward).

With ``--compile-mode M`` both models are also timed compiled in that ``torch.compile`` mode; with ``--fp8-groups``
an FP8 copy of only those layer groups is timed too. With ``--current-only``
the settled earlier forms (fp32 norms, mul + add, last block over all tokens) are left out. With ``--compiled`` the
same process also times our ``compile_blocks()`` with and without the skipped outputs, and
diffusers after ``compile_repeated_blocks(fullgraph=True)`` as the second anchor. With ``--fp8`` it also times the
opt-in FP8 rollout copy (``verl_omni.models.wnm.fp8``: the blocks' linear layers in float8 with row-wise scales),
eager and (with ``--compiled``) compiled, and prints its velocity's distance from the bf16 model's. With
``--text-valid N`` our context attends to only the first N of its text positions, as a real instruction's padded
tokens do, and the same process also times the masked cross-attention that real runs took before
``transformer.COMPACT_CONTEXT`` (eager, and compiled with ``--compiled``).

Prints a table of medians with the ratio against the anchors.

    python scripts/bench_modulation.py --size wan2.1-1.3b --batches 4,16 [--rounds 5] [--compiled]
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_time, wan_anchor  # noqa: E402
from bench_stage3_gpu import build_ours, forward_inputs, padded_instruction  # noqa: E402


def stacked_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as the block computed it before session 33 (same arithmetic, a stacked result whose
    layout inductor chooses), for the "stacked RoPE" rows."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="wan2.1-1.3b")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--text-tokens", type=int, default=512, help="the anchor's text tokens (default 512)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each times every model 3 times")
    p.add_argument("--compiled", action="store_true", help="also time both models compiled (regional compilation)")
    p.add_argument("--fp8", action="store_true", help="also time the FP8 rollout copy of our model (CUDA sm89+)")
    p.add_argument(
        "--fa4",
        action="store_true",
        help="also time our model with attention_backend 'fa4' (FlashAttention-4; the anchors keep their default)",
    )
    p.add_argument(
        "--text-valid",
        type=int,
        default=None,
        help="our context attends to only this many text positions (a padded instruction); default: all",
    )
    p.add_argument(
        "--fp8-groups",
        default=None,
        help="with --fp8 and --compiled, also time a compiled FP8 copy converting only these comma-separated layer "
        "groups (attention, feed_forward_in, feed_forward_out; verl_omni.models.wnm.fp8.LAYER_GROUPS)",
    )
    p.add_argument(
        "--compile-mode",
        default=None,
        help="with --compiled, also time both models compiled in this torch.compile mode (e.g. "
        "max-autotune-no-cudagraphs, whose Triton GEMM templates can take the GELU and bias as epilogues)",
    )
    p.add_argument(
        "--multi-kernel",
        action="store_true",
        help="with --compiled, also time our model compiled with inductor's triton.multi_kernel (persistent "
        "reductions over the model width; compile_blocks(multi_kernel=True)); the anchors keep their default",
    )
    p.add_argument(
        "--current-only",
        action="store_true",
        help="leave out the earlier forms already settled (fp32 norms, mul + add, last block over all tokens)",
    )
    p.add_argument(
        "--drop",
        default="",
        help="comma-separated name fragments (so a fragment cannot hold a comma): rows of our model whose name "
        "contains one are not timed (the anchors always are), e.g. 'masked,eager' to time only compiled rows within "
        "a device call's time",
    )
    p.add_argument(
        "--keep",
        default=None,
        help="a Python regular expression: only rows of our model whose name it matches (re.search) are timed, "
        "after --drop (the anchors always are), e.g. 'FA4|FlashAttention-4' for the FlashAttention-4 rows; for "
        "fragments that hold a comma, which --drop cannot take",
    )
    args = p.parse_args(argv)
    try:
        keep = None if args.keep is None else re.compile(args.keep)
    except re.error as e:
        p.error(f"--keep must be a Python regular expression, got {args.keep!r}: {e}")
    if args.compile_mode is not None and not args.compiled:
        p.error("--compile-mode needs --compiled")
    if args.fp8_groups is not None:
        from verl_omni.models.wnm.fp8 import LAYER_GROUPS

        groups = [g.strip() for g in args.fp8_groups.split(",") if g.strip()]
        if not (args.fp8 and args.compiled):
            p.error("--fp8-groups needs --fp8 and --compiled")
        if not groups or set(groups) - set(LAYER_GROUPS):
            p.error(f"--fp8-groups must be comma-separated names from {sorted(LAYER_GROUPS)}, got {args.fp8_groups!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_modulation.py needs a CUDA device")
    from verl_omni.models.wnm import WNMConfig
    from verl_omni.models.wnm import attention as wnm_attention
    from verl_omni.models.wnm import block as wnm_block
    from verl_omni.models.wnm import transformer as wnm_transformer

    device, dtype = torch.device("cuda"), torch.bfloat16
    product_rope = wnm_attention._apply_rope
    drop = [f for f in args.drop.split(",") if f]

    def dropped(name: str) -> bool:
        if not name.startswith("WNM"):
            return False
        return any(f in name for f in drop) or (keep is not None and not keep.search(name))

    cfg = WNMConfig.from_size(args.size)
    if args.text_valid is not None and not 1 <= args.text_valid <= cfg.text_max_length:
        p.error(f"--text-valid must be in [1, {cfg.text_max_length}] for size {args.size}, got {args.text_valid}")
    ours = build_ours(cfg, device, dtype)
    anchor = wan_anchor(cfg, device, dtype, text_dim=cfg.text_dim)
    ours_compiled = anchor_compiled = None
    if args.compiled:
        ours_compiled = build_ours(cfg, device, dtype)  # same seed, so the same weights as ``ours``
        ours_compiled.compile_blocks()
        anchor_compiled = copy.deepcopy(anchor)
        anchor_compiled.compile_repeated_blocks(fullgraph=True)
    ours_multi = None
    if args.multi_kernel:
        if not args.compiled:
            p.error("--multi-kernel needs --compiled")
        ours_multi = build_ours(cfg, device, dtype)
        ours_multi.compile_blocks(multi_kernel=True)
    ours_moded = anchor_moded = None
    if args.compile_mode is not None:
        ours_moded = build_ours(cfg, device, dtype)
        ours_moded.compile_blocks(mode=args.compile_mode)
        anchor_moded = copy.deepcopy(anchor)
        anchor_moded.compile_repeated_blocks(fullgraph=True, mode=args.compile_mode)
    fp8 = fp8_compiled = None
    if args.fp8:
        from verl_omni.models.wnm.fp8 import float8_rollout_copy

        fp8 = float8_rollout_copy(ours)
        if args.compiled:
            fp8_compiled = float8_rollout_copy(ours)
            fp8_compiled.compile_blocks()
    fp8_some = None
    if args.fp8_groups is not None:
        fp8_some = float8_rollout_copy(ours, groups=[g.strip() for g in args.fp8_groups.split(",") if g.strip()])
        fp8_some.compile_blocks()
    print(f"size {cfg.size}, bf16, torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(f"{'batch':>5}  {'model':<48}{'ms':>9}{'x d.eager':>11}{'x d.comp':>10}")
    for b in (int(v) for v in args.batches.split(",")):
        anchor_args, ours_args = forward_inputs(cfg, b, args.text_tokens, device, dtype)
        ours_args = padded_instruction(ours_args, args.text_valid, cfg)

        @torch.no_grad()
        def run_ours(
            norm: bool,
            fused: bool,
            skip: bool = True,
            model=ours,
            ours_args=ours_args,
            compact=True,
            gelu_epilogue=True,
            rope=None,
            group_select=True,
            attention=None,
            norm_rope_kernel=True,
            defer=True,
            add_norm_kernel=True,
        ):
            wnm_block.LOW_PRECISION_NORM, wnm_block.LOW_PRECISION_ADDCMUL = norm, fused
            saved_attention = model.attention_backend
            if attention is not None:
                model.attention_backend = attention
            if rope is not None:
                wnm_attention._apply_rope = rope
            wnm_block.COMPILED_GROUP_SELECT = group_select
            wnm_transformer.SKIP_UNREAD_OUTPUTS, wnm_transformer.COMPACT_CONTEXT = skip, compact
            wnm_transformer.DEFER_FFN_RESIDUAL = defer
            model.residual_norm_kernel = add_norm_kernel
            model.gelu_epilogue = gelu_epilogue
            # A replaced RoPE form only runs where the q/k norm + RoPE kernel does not.
            model.norm_rope_kernel = norm_rope_kernel and rope is None
            try:
                return model(*ours_args)
            finally:
                wnm_block.LOW_PRECISION_NORM, wnm_block.LOW_PRECISION_ADDCMUL = True, True
                wnm_transformer.SKIP_UNREAD_OUTPUTS, wnm_transformer.COMPACT_CONTEXT = True, True
                wnm_transformer.DEFER_FFN_RESIDUAL = True
                model.residual_norm_kernel = True
                model.gelu_epilogue = True
                model.norm_rope_kernel = True
                wnm_attention._apply_rope = product_rope
                wnm_block.COMPILED_GROUP_SELECT = True
                model.attention_backend = saved_attention

        @torch.no_grad()
        def run_anchor(model=anchor, anchor_args=anchor_args):
            return model(*anchor_args, return_dict=False)

        with torch.no_grad():  # the forms agree to bf16 rounding (printed, not asserted)
            v_now = run_ours(True, True)[0].float()
            v_norm = run_ours(False, True)[0].float()
            v_old = run_ours(False, False)[0].float()
            v_all = run_ours(True, True, False)[0].float()
            v_two_kernel = run_ours(True, True, gelu_epilogue=False)[0].float()
            v_stacked = run_ours(True, True, rope=stacked_rope)[0].float()
            v_composite = run_ours(True, True, norm_rope_kernel=False)[0].float()
        diffs = {
            "now vs GEMM + separate GELU kernel": float((v_now - v_two_kernel).norm() / v_two_kernel.norm()),
            "now vs stacked RoPE": float((v_now - v_stacked).norm() / v_stacked.norm()),
            "now vs q/k norm + RoPE composite": float((v_now - v_composite).norm() / v_composite.norm()),
            "now vs fp32 norms": float((v_now - v_norm).norm() / v_norm.norm()),
            "fp32 norms vs mul + add": float((v_norm - v_old).norm() / v_old.norm()),
            "now vs last block over all tokens": float((v_now - v_all).norm() / v_all.norm()),
        }
        if args.compiled and not dropped("WNM compiled, session 38 (both off)"):
            with torch.no_grad():  # rounding differences of the compiled forms against session 38's
                v_s38 = run_ours(True, True, True, ours_compiled, defer=False, add_norm_kernel=False)[0].float()
                for label, kwargs in (
                    ("now", {}),
                    ("residual deferred only", {"add_norm_kernel": False}),
                    ("add + norm kernel only", {"defer": False}),
                ):
                    v = run_ours(True, True, True, ours_compiled, **kwargs)[0].float()
                    diffs[f"compiled: {label} vs session 38's compiled"] = float((v - v_s38).norm() / v_s38.norm())
        entries = {
            "WNM eager, bf16 norms + addcmul (now)": lambda f=run_ours: f(True, True),
            "WNM eager, separate GELU kernel": lambda f=run_ours: f(True, True, gelu_epilogue=False),
            "WNM eager, q/k norm + RoPE composite": lambda f=run_ours: f(True, True, norm_rope_kernel=False),
            "WNM eager, add + norm composite": lambda f=run_ours: f(True, True, add_norm_kernel=False),
            "WNM eager, stacked RoPE": lambda f=run_ours: f(True, True, rope=stacked_rope),
            "WNM eager, last block over all tokens": lambda f=run_ours: f(True, True, False),
            "WNM eager, fp32 norms + addcmul": lambda f=run_ours: f(False, True),
            "WNM eager, fp32 norms + mul + add": lambda f=run_ours: f(False, False),
            "diffusers eager": run_anchor,
        }
        if args.compiled:
            entries.update({
                "WNM compiled (now)": lambda f=run_ours: f(True, True, True, ours_compiled),
                "WNM compiled, separate GELU kernel": lambda f=run_ours: f(
                    True, True, True, ours_compiled, gelu_epilogue=False
                ),
                "WNM compiled, q/k norm + RoPE by inductor": lambda f=run_ours: f(
                    True, True, True, ours_compiled, norm_rope_kernel=False
                ),
                "WNM compiled, stacked RoPE": lambda f=run_ours: f(True, True, True, ours_compiled, rope=stacked_rope),
                "WNM compiled, split/cat modulation": lambda f=run_ours: f(
                    True, True, True, ours_compiled, group_select=False
                ),
                "WNM compiled, stacked RoPE + split/cat (s33 measured)": lambda f=run_ours: f(
                    True, True, True, ours_compiled, rope=stacked_rope, group_select=False
                ),
                "WNM compiled, those + separate GELU (session 32)": lambda f=run_ours: f(
                    True, True, True, ours_compiled, gelu_epilogue=False, rope=stacked_rope, group_select=False
                ),
                "WNM compiled, last block over all tokens": lambda f=run_ours: f(True, True, False, ours_compiled),
                "WNM compiled, residual added in its block": lambda f=run_ours: f(
                    True, True, True, ours_compiled, defer=False
                ),
                "WNM compiled, add + norm by inductor": lambda f=run_ours: f(
                    True, True, True, ours_compiled, add_norm_kernel=False
                ),
                "WNM compiled, session 38 (both off)": lambda f=run_ours: f(
                    True, True, True, ours_compiled, defer=False, add_norm_kernel=False
                ),
                "diffusers compiled": lambda f=run_anchor: f(anchor_compiled),
            })  # fmt: skip
            if ours_multi is not None:
                entries["WNM compiled, multi-kernel reductions"] = lambda f=run_ours: f(True, True, True, ours_multi)
        if ours_moded is not None:
            entries.update({
                f"WNM compiled, {args.compile_mode}": lambda f=run_ours: f(True, True, True, ours_moded),
                f"diffusers compiled, {args.compile_mode}": lambda f=run_anchor: f(anchor_moded),
            })  # fmt: skip
        if args.fa4:
            with torch.no_grad():
                v_fa4 = run_ours(True, True, attention="fa4")[0].float()
            diffs["FlashAttention-4 vs now (cuDNN)"] = float((v_fa4 - v_now).norm() / v_now.norm())
            entries["WNM eager, FlashAttention-4"] = lambda f=run_ours: f(True, True, attention="fa4")
            if args.compiled:
                entries["WNM compiled, FlashAttention-4"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, attention="fa4"
                )
                entries["WNM compiled, FA4, q/k norm + RoPE by inductor"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, attention="fa4", norm_rope_kernel=False
                )
                entries["WNM compiled, FA4, residual added in its block"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, attention="fa4", defer=False
                )
                entries["WNM compiled, FA4, add + norm by inductor"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, attention="fa4", add_norm_kernel=False
                )
                entries["WNM compiled, FA4, session 38 (both off)"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, attention="fa4", defer=False, add_norm_kernel=False
                )
                if ours_multi is not None:
                    entries["WNM compiled, FA4, multi-kernel reductions"] = lambda f=run_ours: f(
                        True, True, True, ours_multi, attention="fa4"
                    )
        if args.current_only:
            for name in [n for n in entries if "fp32 norms" in n or "last block over all" in n]:
                del entries[name]
        for name in [n for n in entries if dropped(n)]:
            del entries[name]
        for name in [n for n in entries if "compiled" in n]:
            entries[name]()  # compiles outside the timed rounds (masked and FP8 rows compile below)
        if args.text_valid is not None and not dropped("WNM eager, masked context (before)"):
            entries["WNM eager, masked context (before)"] = lambda f=run_ours: f(True, True, compact=False)
            with torch.no_grad():
                v_masked = run_ours(True, True, compact=False)[0].float()
            diffs["compacted vs masked context"] = float((v_now - v_masked).norm() / v_masked.norm())
            if args.compiled and not dropped("WNM compiled, masked context (before)"):
                entries["WNM compiled, masked context (before)"] = lambda f=run_ours: f(
                    True, True, True, ours_compiled, compact=False
                )
                entries["WNM compiled, masked context (before)"]()  # compiles outside the timed rounds
        if fp8 is not None:
            if not dropped("WNM eager, FP8 linears"):
                entries["WNM eager, FP8 linears"] = lambda f=run_ours: f(True, True, True, fp8)
            with torch.no_grad():
                v_fp8 = run_ours(True, True, True, fp8)[0].float()
            diffs["FP8 linears vs now (bf16)"] = float((v_fp8 - v_now).norm() / v_now.norm())
            if fp8_compiled is not None and not dropped("WNM compiled, FP8 linears"):
                entries["WNM compiled, FP8 linears"] = lambda f=run_ours: f(True, True, True, fp8_compiled)
                entries["WNM compiled, FP8 linears"]()  # compiles outside the timed rounds
            if fp8_some is not None:
                name = f"WNM compiled, FP8 {args.fp8_groups} only"
                entries[name] = lambda f=run_ours: f(True, True, True, fp8_some)
                entries[name]()
                with torch.no_grad():
                    v_some = run_ours(True, True, True, fp8_some)[0].float()
                diffs[f"FP8 {args.fp8_groups} only vs now (bf16)"] = float((v_some - v_now).norm() / v_now.norm())
        times: dict[str, list[float]] = {k: [] for k in entries}
        for _ in range(args.rounds):
            for name, fn in entries.items():
                times[name].append(median_time(fn, device, 1, 3))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for name, sec in med.items():
            comp = f"{med['diffusers compiled'] / sec:9.3f}x" if args.compiled else f"{'-':>10}"
            print(f"{b:>5}  {name:<48}{sec * 1e3:9.1f}{med['diffusers eager'] / sec:10.3f}x{comp}", flush=True)
        for what, d in diffs.items():
            print(f"{b:>5}  (relative difference of the velocities, {what}: {d:.2e})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
