#!/usr/bin/env python
"""Which kernels inductor generates for the compiled DiT block, in the current form and in the earlier forms.

A profiler says how long each kernel takes; this says which kernels exist, and it runs where no GPU is. For each
form of the block (the per-token modulation select or session 32's split/concatenate, RoPE written into slices or
stacked), it compiles ``WNMTransformer.compile_blocks()`` afresh, runs one no-grad forward, reads inductor's
generated code (``torch._inductor.utils.run_and_get_code``) and prints the names of the fused kernels of every
graph: the repeated block's first, then the last block's (which returns only the target tokens). Inductor names a
fused kernel after the operators it contains, so a layout copy in front of attention shows up as its own
``..._to_copy_transpose...`` kernel and a norm whose modulation was not fused into it as a separate pointwise
kernel.

On CPU the C++ backend emits one function per fusion group, and its fusion rules are not the GPU's: what it shows is
evidence for the GPU's kernels, not a measurement of them (``scripts/profile_dit.py`` times them on a GPU).

    python scripts/inspect_block_kernels.py                      # tiny model, bf16, on CPU
    python scripts/inspect_block_kernels.py --device cuda --size wan2.1-1.3b --batch 2
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_modulation import stacked_rope  # noqa: E402
from bench_stage3_gpu import build_ours, forward_inputs, padded_instruction  # noqa: E402

# Inductor's fused-kernel names: C++ functions on CPU, Triton kernels on CUDA.
KERNEL_NAME = re.compile(r"\b(?:cpp_fused|triton_(?:poi|red|per|tem)_fused)\w*")


def graph_kernels(model, inputs: tuple) -> list[list[str]]:
    """Names of the fused kernels of each graph inductor generates for one no-grad forward of ``model``, in the
    order the graphs were compiled: the first block's, the repeated middle block's, the last block's (with fewer
    than three blocks, the middle one's is missing)."""
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        _, codes = run_and_get_code(lambda: model(*inputs))
    if not codes:
        raise RuntimeError("inductor generated no code: was the model compiled (compile_blocks)?")
    return [sorted(set(KERNEL_NAME.findall(code))) for code in codes]


def form_kernels(cfg, inputs: tuple, device, dtype, *, select: bool, rope) -> list[list[str]]:
    """:func:`graph_kernels` of a freshly built and compiled model in one form of the block.

    Args:
        select: The compiled blocks pick each token's modulation row with ``torch.where`` (the product) rather
            than splitting and concatenating (``block.COMPILED_GROUP_SELECT``).
        rope: The RoPE function the attention calls (``attention._apply_rope`` or another form of it).

    The module switches are read at trace time, so compilation starts afresh (``torch._dynamo.reset()``) and the
    switches are restored afterwards, whatever happens.
    """
    from verl_omni.models.wnm import attention as wnm_attention
    from verl_omni.models.wnm import block as wnm_block

    before = wnm_block.COMPILED_GROUP_SELECT, wnm_attention._apply_rope
    wnm_block.COMPILED_GROUP_SELECT, wnm_attention._apply_rope = select, rope
    try:
        torch._dynamo.reset()
        model = build_ours(cfg, device, dtype)
        model.compile_blocks()
        return graph_kernels(model, inputs)
    finally:
        wnm_block.COMPILED_GROUP_SELECT, wnm_attention._apply_rope = before
        torch._dynamo.reset()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--text-valid", type=int, default=4, help="attended text positions of the context (default 4)")
    args = p.parse_args(argv)
    from verl_omni.models.wnm import WNMConfig
    from verl_omni.models.wnm import attention as wnm_attention

    cfg = WNMConfig.from_size(args.size)
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if not 1 <= args.text_valid <= cfg.text_max_length:
        p.error(f"--text-valid must be in [1, {cfg.text_max_length}] for size {args.size}, got {args.text_valid}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    _, inputs = forward_inputs(cfg, args.batch, 8, device, dtype)
    inputs = padded_instruction(inputs, args.text_valid, cfg)
    product_rope = wnm_attention._apply_rope
    forms = [
        ("now (per-token select, RoPE into slices)", True, product_rope),
        ("split/cat modulation", False, product_rope),
        ("stacked RoPE", True, stacked_rope),
        ("stacked RoPE + split/cat (session 33's forward)", False, stacked_rope),
    ]
    print(f"size {cfg.size}, {args.dtype}, batch {args.batch}, {args.device}, torch {torch.__version__}")
    for name, select, rope in forms:
        graphs = form_kernels(cfg, inputs, device, dtype, select=select, rope=rope)
        print(f"\n{name}: {len(graphs)} graph(s)")
        labels = ["the first block", "the repeated middle block", "the last block"]
        if len(graphs) == 2:  # two blocks: no middle one
            labels = [labels[0], labels[2]]
        for g, kernels in enumerate(graphs):
            what = labels[g] if g < len(labels) else f"graph {g}"
            print(f"  {what}: {len(kernels)} fused kernels")
            for k in kernels:
                print(f"    {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
