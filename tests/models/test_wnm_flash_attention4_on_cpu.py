"""The FlashAttention-4 op's plumbing (``flash_attention4.py``) on CPU: shapes, layout, scale, autograd, compile.

FlashAttention-4's kernels run only on Hopper/Blackwell GPUs, so here the package's two entry points are replaced
by a float64 double written out from the attention formulas (forward: softmax of the scaled scores; backward: the
standard closed form dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = s dS K, dK = s dS^T Q). Everything of ours
around the kernel (the [B, S, H, Dh] layout, the default scale, the log-sum-exp output, the autograd formula, the
fake implementation that torch.compile traces) is what runs. The kernels themselves are compared with PyTorch's
math attention in ``test_wnm_flash_attention4_on_gpu.py``.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from wnm_inputs import random_dit_inputs

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.models.wnm import flash_attention4 as fa4

torch.set_num_threads(1)


def _scores(q, k, scale):
    # q [B, S, H, D], k [B, L, H, D] -> [B, H, S, L]
    return torch.einsum("bshd,blhd->bhsl", q.double(), k.double()) * scale


def _double_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, **unused):
    assert not causal and return_lse and not unused
    s = _scores(q, k, softmax_scale)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, S]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhsl,blhd->bshd", p, v.double())
    return out.to(q.dtype), lse.float(), None, None, None


def _double_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, **unused):
    assert not causal and not unused
    p = torch.exp(_scores(q, k, softmax_scale) - lse.double()[..., None])
    do = dout.double()
    dv = torch.einsum("bhsl,bshd->blhd", p, do)
    dp = torch.einsum("bshd,blhd->bhsl", do, v.double())
    delta = (do * out.double()).sum(-1).transpose(1, 2)  # rowsum(dO * O) -> [B, H, S]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhsl,blhd->bshd", ds, k.double()) * softmax_scale
    dk = torch.einsum("bhsl,bshd->blhd", ds, q.double()) * softmax_scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def kernel_double(monkeypatch):
    calls = {"fwd": 0, "bwd": 0}

    def fwd(*a, **kw):
        calls["fwd"] += 1
        return _double_fwd(*a, **kw)

    def bwd(*a, **kw):
        calls["bwd"] += 1
        return _double_bwd(*a, **kw)

    monkeypatch.setattr(fa4, "_interface", lambda: types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd))
    return calls


def _qkv(b=2, s=7, length=5, h=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=g, dtype=dtype) for n in (s, length, length))


def test_fake_shapes_are_flash_attention_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 10, 3, 8, dtype=torch.bfloat16)
        k = torch.empty(2, 7, 3, 8, dtype=torch.bfloat16)
        out, lse = torch.ops.wnm.fa4_attention(q, k, k, 0.5)
        grads = torch.ops.wnm.fa4_attention_backward(out, q, k, k, out, lse, 0.5)
    assert out.shape == (2, 10, 3, 8) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 3, 10) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_output_and_gradients_equal_sdpa_with_the_default_scale(kernel_double):
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = fa4.fa4_attention(q, k, v)
    assert out.shape == q.shape
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    # SDPA takes [B, H, S, D]; its default scale is 1/sqrt(D), which fa4_attention must pass on.
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (ref_q, ref_k, ref_v))).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), grad)
    for g, w in zip(got, want, strict=True):  # the log-sum-exp travels as float32, as the kernel stores it
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert kernel_double == {"fwd": 1, "bwd": 1}


def test_torch_compile_fullgraph_keeps_the_op(kernel_double):
    q, k, v = (t.requires_grad_() for t in _qkv(seed=1))

    def f(q, k, v):
        return (fa4.fa4_attention(q, k, v) * 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = f(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, w in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, w)
    assert kernel_double["fwd"] >= 2 and kernel_double["bwd"] >= 2


def _tiny_model():
    torch.manual_seed(0)
    cfg = WNMConfig.from_size("tiny")
    return WNMTransformer(cfg).eval()


def test_model_falls_back_to_the_default_kernel_off_gpu(kernel_double):
    """On CPU (or with a mask, or in fp32) the fa4 backend is the default SDPA call: same outputs, no FA4 call."""
    model = _tiny_model()
    m = copy.deepcopy(model)
    m.attention_backend = "fa4"
    assert all(b.attention_backend == "fa4" for b in m.blocks)
    inputs = random_dit_inputs(model.config, b=2, seed=3)
    with torch.no_grad():
        for g, r in zip(m(*inputs), model(*inputs), strict=True):
            assert torch.equal(g, r)
    assert kernel_double == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("backend", ["fa4", "cudnn", "default"])
def test_self_and_cross_attention_both_use_the_blocks_backend(monkeypatch, backend):
    from verl_omni.models.wnm import attention

    seen = []
    real = attention._attention

    def recording(q, k, v, mask, kernel):
        seen.append((sys._getframe(1).f_code.co_name, kernel))  # who asked for which kernel
        return real(q, k, v, mask, kernel)

    monkeypatch.setattr(attention, "_attention", recording)
    model = _tiny_model()
    model.attention_backend = backend
    with torch.no_grad():
        model(*random_dit_inputs(model.config, b=1, seed=4))
    layers = model.config.num_layers
    assert sorted(seen) == sorted([("_cross_attention", backend)] * layers + [("_self_attention", backend)] * layers)


def test_setting_fa4_where_a_gpu_is_visible_but_the_package_is_not_fails_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problem = f"{fa4.FA4_INSTALL_HINT}; import failed with: No module named 'flash_attn'"
    monkeypatch.setattr(fa4, "fa4_import_problem", lambda: problem)
    model = _tiny_model()
    with pytest.raises(ImportError, match="pip install flash-attn-4.*No module named 'flash_attn'"):
        model.attention_backend = "fa4"
    assert model.attention_backend == "default"


@pytest.fixture
def fresh_fa4_import(monkeypatch):
    """Lets a test import ``flash_attn``/``cutlass`` from a tree it builds: hides the loaded ones, and afterwards drops
    what the test's imports left in ``sys.modules`` (a package whose submodule failed stays there) before
    ``monkeypatch`` puts the hidden ones back."""
    packages = ("flash_attn", "cutlass")

    def ours(name: str) -> bool:
        return name.split(".")[0] in packages

    for name in [m for m in sys.modules if ours(m)]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if ours(m)]:
        del sys.modules[name]


def test_a_partly_installed_cutlass_is_reported_with_the_wheels_that_make_it_up(
    tmp_path, monkeypatch, fresh_fa4_import
):
    # What the device had after a `pip install --target --upgrade` of one cutlass wheel: FlashAttention-4 present,
    # and a `cutlass` folder holding only the compiled bindings, without the package's Python (libs-core).
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("import cutlass.cute\n")
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("")
    (tmp_path / "cutlass" / "_mlir").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = fa4.fa4_import_problem()
    assert problem is not None and not fa4.fa4_available()
    assert "pip install flash-attn-4" in problem
    assert "No module named 'cutlass.cute'" in problem
    assert "nvidia-cutlass-dsl-libs-core" in problem and "--upgrade" in problem


def test_a_native_library_that_fails_to_load_is_reported_as_a_failed_import(tmp_path, monkeypatch, fresh_fa4_import):
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise OSError('libcute_dsl_runtime.so: bad ELF')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = fa4.fa4_import_problem()
    assert problem is not None and "pip install flash-attn-4" in problem
    assert "OSError: libcute_dsl_runtime.so: bad ELF" in problem


def test_a_missing_flash_attn_gets_the_install_hint_without_the_cutlass_one(monkeypatch, fresh_fa4_import):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes the import fail as an absent package does
    problem = fa4.fa4_import_problem()
    assert problem is not None and "pip install flash-attn-4" in problem and "flash_attn" in problem
    assert "libs-core" not in problem


def test_backward_warns_under_deterministic_algorithms(kernel_double):
    q, k, v = (t.requires_grad_() for t in _qkv(seed=2))
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.warns(UserWarning, match="FlashAttention-4.*deterministic"):
            torch.autograd.grad(fa4.fa4_attention(q, k, v).sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _meta(*shape, grad=True):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)


def test_flop_counter_counts_the_ops_as_pytorchs_attention():
    # Hand count with B=2, H=4, S=64 queries, L=48 keys, Dh=32 (BHSLDh = 786,432): the forward is two products,
    # scores and values, 2 * BHSLDh each; the backward recomputes the scores and forms dV, dP, dQ and dK, five
    # products. Meta tensors: only the fake implementations run.
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _meta(2, 64, 4, 32), _meta(2, 48, 4, 32), _meta(2, 48, 4, 32)
    with FlopCounterMode(display=False) as forward:
        fa4.fa4_attention(q, k, v)
    assert forward.get_total_flops() == 4 * 786_432
    with FlopCounterMode(display=False) as both:
        fa4.fa4_attention(q, k, v).float().sum().backward()
    assert both.get_total_flops() == (4 + 10) * 786_432


@pytest.mark.parametrize("weigh_custom_ops", [False, True])
def test_memory_budget_keeps_the_attention_output_once_custom_ops_are_weighed(weigh_custom_ops):
    # Three projections, the attention and an output projection, through AOTAutograd's min-cut partitioner under a
    # memory budget of 0.5 (meta tensors: the partitioner only reads shapes). The attention (1024 queries over 1024
    # keys, 1.07 GFLOP) costs 16x a projection (67 MFLOP) for an output of the same size, so a partitioner that
    # knows its cost keeps its output and recomputes projections instead. PyTorch's most aggressive pass treats an
    # op outside its own lists as free to recompute unless custom ops are weighed, which set_activation_memory_budget
    # turns on; then the attention forward runs again in the backward graph.
    import torch._functorch.config as functorch_config
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    b, s, h, d = 2, 1024, 4, 32

    def block(x, w_q, w_k, w_v, w_o):
        q, k, v = (F.gelu(x @ w).unflatten(-1, (h, d)) for w in (w_q, w_k, w_v))
        return F.gelu(fa4.fa4_attention(q, k, v).flatten(-2) @ w_o).sum()

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compiler

    saved = functorch_config.activation_memory_budget, functorch_config.is_non_builtin_to_include
    try:
        functorch_config.activation_memory_budget = 0.5
        functorch_config.is_non_builtin_to_include = weigh_custom_ops
        fn = aot_function(
            block, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=min_cut_rematerialization_partition
        )
        fn(_meta(b, s, h * d), *(_meta(h * d, h * d) for _ in range(4))).backward()
    finally:
        functorch_config.activation_memory_budget, functorch_config.is_non_builtin_to_include = saved
    recomputed = [n for n in graphs["bw"].graph.nodes if n.target is torch.ops.wnm.fa4_attention.default]
    assert len(recomputed) == (0 if weigh_custom_ops else 1)
