"""Layer table: every joint-latent dimension in exactly one layer, at the indices the contract names."""

import pytest
import torch

from verl_omni.pipelines.wnm_shared.layers import (
    LAYER_NAMES,
    JointLayout,
    LayerLayoutError,
    LayerTable,
    check_layer_names,
)

VIDEO_SHAPE = (2, 3, 4, 5)  # 120 video dims
DV = 120


def test_layer_names_match_contract():
    assert LAYER_NAMES == ("visual", "nav_1", "nav_2", "nav_3", "nav_4", "stop_1", "stop_2", "stop_3", "stop_4")


def test_partition_and_indices_by_hand():
    table = LayerTable(JointLayout(VIDEO_SHAPE))
    d = DV + 32 * 4
    assert table.layout.numel == d
    all_idx = torch.cat([table.indices(n) for n in LAYER_NAMES])
    assert sorted(all_idx.tolist()) == list(range(d))  # each dim exactly once
    assert table.indices("visual").tolist() == list(range(DV))
    # nav_2: steps 8..15, channels dx, dy, dyaw -> DV + 4 * step + channel
    assert table.indices("nav_2").tolist() == [DV + 4 * s + c for s in range(8, 16) for c in range(3)]
    assert table.indices("stop_4").tolist() == [DV + 4 * s + 3 for s in range(24, 32)]
    assert table.counts.tolist() == [DV, 24, 24, 24, 24, 8, 8, 8, 8]
    with pytest.raises(LayerLayoutError, match="unknown layer"):
        table.indices("nav_5")


def test_split_join_roundtrip_and_action_positions():
    layout = JointLayout(VIDEO_SHAPE)
    video = torch.randn(3, *VIDEO_SHAPE)
    actions = torch.randn(3, 32, 4)
    joint = layout.join(video, actions)
    v2, a2 = layout.split(joint)
    assert torch.equal(v2, video) and torch.equal(a2, actions)
    assert joint[1, DV + 4 * 9 + 3] == actions[1, 9, 3]


def test_reduce_mean_matches_float64_reference_and_is_batch_invariant():
    layout = JointLayout((4, 9, 32, 32))  # 36864 video dims: long enough for torch to split sums across threads
    table = LayerTable(layout)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, layout.numel, generator=gen)
    got = table.reduce_mean(values)
    ref = torch.stack([values.double()[:, table.indices(n)].mean(dim=1) for n in LAYER_NAMES], dim=1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    alone = torch.cat([table.reduce_mean(values[i : i + 1]) for i in range(6)])
    assert torch.equal(alone, got)


def test_layer_layout_refusals():
    check_layer_names(list(LAYER_NAMES), "ok")
    with pytest.raises(LayerLayoutError, match="request x"):
        check_layer_names(("visual", "nav_1"), "request x")
    from verl_omni.data.actions import ActionLayout

    with pytest.raises(LayerLayoutError, match="chunks"):
        JointLayout(VIDEO_SHAPE, ActionLayout(steps=32, chunks=8))
    with pytest.raises(ValueError, match="video_shape"):
        JointLayout((2, 3, 4))
