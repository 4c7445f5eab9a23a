"""scripts/inspect_block_kernels.py: the kernel-name pattern, and what inductor generates for the two RoPE forms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import inspect_block_kernels as ibk  # noqa: E402


def test_kernel_name_pattern_reads_cpu_and_triton_names():
    code = (
        "cpp_fused_gelu_view_7 = async_compile.cpp(...)\n"
        "triton_red_fused__to_copy_native_layer_norm_0 = async_compile.triton(...)\n"
        "triton_poi_fused_add_1.run(buf0)\n"
        "extern_kernels.mm(a, b)  # not a fused kernel\n"
    )
    assert ibk.KERNEL_NAME.findall(code) == [
        "cpp_fused_gelu_view_7",
        "triton_red_fused__to_copy_native_layer_norm_0",
        "triton_poi_fused_add_1",
    ]


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--text-valid", "0"], ["--text-valid", "100000"]])
def test_bad_arguments_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit):
        ibk.main(argv)
    assert argv[0] in capsys.readouterr().err


def test_stacked_rope_adds_a_layout_copy_kernel_in_front_of_attention():
    """The H100 profile of session 33 showed a transposing copy of the self-attention output with the stacked RoPE;
    writing into ``empty_like(x)`` slices removed it there. Inductor's CPU backend shows the same: one fused kernel
    more, whose name is a copy/transpose feeding attention and holds no norm or RoPE arithmetic."""
    from bench_modulation import stacked_rope
    from bench_stage3_gpu import forward_inputs, padded_instruction

    from verl_omni.models.wnm import WNMConfig
    from verl_omni.models.wnm import attention as wnm_attention
    from verl_omni.models.wnm import block as wnm_block

    cfg = WNMConfig.from_size("tiny")
    _, inputs = forward_inputs(cfg, 2, 8, torch.device("cpu"), torch.bfloat16)
    inputs = padded_instruction(inputs, 4, cfg)
    product_rope = wnm_attention._apply_rope
    graphs = {
        name: ibk.form_kernels(cfg, inputs, torch.device("cpu"), torch.bfloat16, select=True, rope=rope)
        for name, rope in (("slices", product_rope), ("stacked", stacked_rope))
    }
    # Three graphs each, in compile order: the first block (which leaves its feed-forward residual to the next), the
    # repeated middle block (which takes one and leaves one) and the last block (which returns only the target tokens).
    assert [len(g) for g in graphs.values()] == [3, 3]
    found = {name: g[1] for name, g in graphs.items()}
    # The product's forms are back in place afterwards.
    assert wnm_attention._apply_rope is product_rope and wnm_block.COMPILED_GROUP_SELECT is True
    if not found["slices"]:
        pytest.fail("inductor generated no fused kernels for the compiled block")
    extra = set(found["stacked"]) - set(found["slices"])
    copies = [k for k in extra if "transpose" in k and "to_copy" in k and "rsqrt" not in k and "stack" not in k]
    assert len(found["stacked"]) == len(found["slices"]) + 1, (found["slices"], found["stacked"])
    assert len(copies) == 1, extra
