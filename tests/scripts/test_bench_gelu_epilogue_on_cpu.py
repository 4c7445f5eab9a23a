"""scripts/bench_gelu_epilogue.py: its cuBLAS settings and the row-blocked epilogue GEMM (the timing needs a GPU)."""

import re

import pytest
import torch
import torch.nn.functional as F
from stage3_e2e_helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_gelu_epilogue")


def test_settings_become_environment_variables_and_a_library(bench):
    assert bench.parse_setting("lt-ws=32768") == ({"CUBLASLT_WORKSPACE_SIZE": "32768"}, None)
    assert bench.parse_setting("ws=:4096:8+lib=cublaslt") == ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "cublaslt")
    assert bench.parse_setting("lib=cublas+lt-ws=1024") == ({"CUBLASLT_WORKSPACE_SIZE": "1024"}, "cublas")


@pytest.mark.parametrize(
    "text, message",
    [
        ("workspace=1", "'workspace=1' is not one of lt-ws=KIB"),
        ("lt-ws", "'lt-ws' is not one of"),
        ("lt-ws=", "'lt-ws=' is not one of"),
        ("lib=hipblas", "lib='hipblas'; use lib=cublas or lib=cublaslt"),
    ],
)
def test_bad_settings_are_refused_naming_the_item(bench, text, message):
    with pytest.raises(SystemExit, match="--settings: .*" + re.escape(message)):
        bench.parse_setting(text)


def test_row_blocked_epilogue_gemm_writes_every_block_of_one_output(bench):
    # On CPU PyTorch's epilogue computes the exact GELU (the script prints this), so the independent reference is
    # F.gelu(x W^T + b) in float64; 10 rows in 4 blocks leaves a short last block (3, 3, 3, 1).
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(10, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    reference = F.gelu(F.linear(x.double(), w.double(), b.double())).float()
    for chunks in (1, 2, 4):
        torch.testing.assert_close(bench.addmm_gelu_chunked(x, w, b, chunks), reference, rtol=1e-5, atol=1e-6)


def test_without_cuda_it_says_so(bench):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--settings", "lt-ws=1024"])
    with pytest.raises(SystemExit, match="--settings: 'nope=1'"):  # settings are checked first
        bench.main(["--settings", "nope=1"])


@pytest.mark.parametrize("batches", ["", "4,x", "0", "4,-16"])
def test_bad_batches_are_refused_before_anything_runs(bench, batches, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--batches", batches])
    assert (
        f"--batches must be comma-separated positive integers (e.g. 4,16), got {batches!r}" in capsys.readouterr().err
    )
