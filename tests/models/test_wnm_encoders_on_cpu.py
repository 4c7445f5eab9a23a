"""The built-in image and geometry encoders tell their grid cells apart (context tokens carry no order)."""

import torch

from verl_omni.models.wnm.encoders import BuiltinGeometryEncoder, BuiltinImageEncoder

torch.manual_seed(0)


def test_image_tokens_of_a_uniform_frame_differ_by_their_cell_embedding():
    enc = BuiltinImageEncoder(dim=32, tokens=16)
    frame = torch.full((1, 64, 64, 3), 120, dtype=torch.uint8)
    out = enc(frame)[0]  # [16, 32]
    # 64 px -> 16 -> 8 -> 8 feature map, pooled 2 x 2 into a 4 x 4 grid. Zero padding reaches feature rows and
    # columns 0, 1 and 7 only, so the inner cells (1,1), (1,2), (2,1), (2,2) = tokens 5, 6, 9, 10 pool the same
    # conv output and differ by their cell embeddings alone.
    for i, j in ((5, 6), (5, 10), (9, 6)):
        torch.testing.assert_close(out[i] - out[j], (enc.cell_embed[i] - enc.cell_embed[j]).detach())
    assert not torch.allclose(out[5], out[6])


def test_geometry_tokens_carry_view_and_cell_embeddings():
    enc = BuiltinGeometryEncoder(dim=32, tokens=32, frames=2, history_frames=33)  # 2 views x 4 x 4 cells
    assert enc.frame_indices == [0, 32]
    history = torch.full((1, 33, 64, 64, 3), 80, dtype=torch.uint8)
    out = enc(history)[0].view(2, 16, 32)
    ve, ce = enc.view_embed.detach(), enc.cell_embed.detach()
    torch.testing.assert_close(out[1, 5] - out[0, 5], ve[1] - ve[0])  # same frame content, other view
    torch.testing.assert_close(out[0, 5] - out[0, 10], ce[5] - ce[10])  # same view, other inner cell
    torch.testing.assert_close(enc.encode_views(history[:, [0, 32]]), enc(history))
