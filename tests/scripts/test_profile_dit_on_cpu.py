"""scripts/profile_dit.py: the kernel classification and the per-kind table (the profiling itself needs a GPU)."""

import pytest
from stage3_e2e_helpers import load_script


@pytest.fixture(scope="module")
def profile_dit():
    return load_script("profile_dit")


def test_kernel_names_from_an_h200_profile_are_classified(profile_dit):
    # Names as torch.profiler recorded them on the H200 (docs/bench/h200_profile_dit_session17_b4.txt).
    names = {
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1": "attention",
        "triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention_permute_view_3": "attention",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float": "norm",
        "triton_red_fused__fused_rms_norm_add_copy_mul_slice_sub_unbind_view_1": "norm",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tensor": "copy/cast",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(at::Tensor": "elementwise",
        "triton_poi_fused_gelu_view_6": "elementwise",
        "Memset (Device)": "other",
    }  # fmt: skip
    for name, kind in names.items():
        assert profile_dit.kind_of(name) == kind, name


def test_report_sums_per_kind_by_hand(profile_dit):
    rows = [("nvjet_gemm_a", 6.0, 10), ("flash_fprop", 3.0, 2), ("triton_poi_fused_gelu", 1.0, 1)]
    text = profile_dit.report("toy", rows, top=2)
    lines = text.splitlines()
    assert lines[0] == "== toy: 10.0 ms of kernels per forward"
    # gemm 6 of 10 ms (60%), attention 3 (30%), elementwise 1 (10%), largest first; then the top 2 kernels.
    assert lines[2].split() == ["gemm", "6.00", "60.0%", "10"]
    assert lines[3].split() == ["attention", "3.00", "30.0%", "2"]
    assert lines[4].split() == ["elementwise", "1.00", "10.0%", "1"]
    assert lines[5] == "top 2 kernels:" and len(lines) == 8 and "nvjet_gemm_a" in lines[6]
    # A training step's profile says what one profiled call was.
    assert profile_dit.report("step", rows, top=2, per="step").splitlines()[0] == "== step: 10.0 ms of kernels per step"


def test_forward_inputs_drive_both_models_at_tiny_size(profile_dit):
    # The shared inputs of the GPU profiling/benchmark scripts fit both models: one forward of each on CPU.
    import torch
    from bench_common import wan_anchor
    from bench_stage3_gpu import build_ours, forward_inputs

    from verl_omni.models.wnm import WNMConfig

    cfg = WNMConfig.from_size("tiny")
    anchor_args, ours_args = forward_inputs(cfg, 2, 8, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        video_v, action_v = build_ours(cfg, torch.device("cpu"), torch.float32)(*ours_args)
        (anchor_v,) = wan_anchor(cfg, torch.device("cpu"), torch.float32, text_dim=cfg.text_dim)(
            *anchor_args, return_dict=False
        )
    assert video_v.shape == ours_args[0].shape and action_v.shape == ours_args[1].shape
    assert anchor_v.shape == anchor_args[0].shape


def test_busy_time_is_the_union_of_kernel_intervals_by_hand(profile_dit):
    # Microseconds: [0, 10) and [5, 12) overlap (two streams) -> 12; [20, 25) -> 5; [21, 23) inside it -> 0;
    # [30, 30) empty. Busy 17 us = 0.017 ms.
    intervals = [(5.0, 12.0), (0.0, 10.0), (21.0, 23.0), (20.0, 25.0), (30.0, 30.0)]
    assert profile_dit.busy_ms(intervals) == pytest.approx(0.017)
    assert profile_dit.busy_ms([]) == 0.0


def test_flash_attention4_kernels_from_an_h200_training_profile_are_attention(profile_dit):
    # docs/bench/h200_train_fa4_profile_session40.txt
    for name in (
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor0000o11101213_te",
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensor0000o11101213_ten",
    ):
        assert profile_dit.kind_of(name) == "attention", name


def test_kernel_rows_divide_by_calls_and_drop_host_only_events(profile_dit):
    from types import SimpleNamespace as Event

    class Profile:  # what kernel_rows reads of a finished torch.profiler run
        @staticmethod
        def key_averages():
            return [
                Event(key="nvjet_gemm", device_time_total=6000.0, count=20),  # 6 ms, 20 launches over 2 calls
                Event(key="ProfilerStep#1", device_time_total=9000.0, count=2),
                Event(key="aten::copy_", device_time_total=0.0, count=4),  # host-side only
                Event(key="flash_fprop", device_time_total=8000.0, count=4),
            ]

    assert profile_dit.kernel_rows(Profile(), 2) == [("flash_fprop", 4.0, 2), ("nvjet_gemm", 3.0, 10)]


def test_attention_option_names_the_known_backends(profile_dit, capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        profile_dit.main(["--attention", "flash9"])
    assert exc.value.code == 2
    assert "--attention must be one of default, cudnn, fa4, got 'flash9'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs a CUDA device"):  # a known backend passes on to the device check
        profile_dit.main(["--attention", "fa4"])
