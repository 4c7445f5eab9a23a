"""MP4 writing and random frame access (verl_omni.data.video)."""

import numpy as np
import pytest

from verl_omni.data.video import VideoError, count_frames, read_frames, write_video


def _frames(t: int, h: int = 32, w: int = 48) -> np.ndarray:
    """Smooth moving gradients (what a renderer produces), distinct per frame."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.empty((t, h, w, 3), np.uint8)
    for i in range(t):
        out[i, ..., 0] = 40 + 3 * xx + 2 * i
        out[i, ..., 1] = 30 + 4 * yy
        out[i, ..., 2] = 128 + 60 * np.sin((xx + yy + 2 * i) / 9.0)
    return out


def test_round_trip_frame_count_and_error(tmp_path):
    frames = _frames(40)
    path = tmp_path / "v.mp4"
    write_video(path, frames, fps=4)
    assert count_frames(path) == 40
    back = read_frames(path, range(40))
    assert back.shape == frames.shape and back.dtype == np.uint8
    err = np.abs(back.astype(np.int16) - frames.astype(np.int16))
    assert err.mean() < 1.5, err.mean()
    # Frames are told apart: each decoded frame is closest to its own source frame.
    dist = np.abs(back[:, None].astype(np.int16) - frames[None].astype(np.int16)).mean(axis=(2, 3, 4))
    assert (dist.argmin(axis=1) == np.arange(40)).all()
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]  # no temporary file left


def test_any_order_duplicates_and_seeking(tmp_path):
    frames = _frames(120, 16, 16)
    path = tmp_path / "long.mp4"
    write_video(path, frames, fps=10, gop=8)
    full = read_frames(path, range(120))
    idx = [117, 3, 3, 64, 0, 117, 119]
    stats = {}
    got = read_frames(path, idx, stats=stats)
    np.testing.assert_array_equal(got, full[idx])
    # A late frame costs about one keyframe interval of decoding, not the 118 frames before it.
    late = {}
    np.testing.assert_array_equal(read_frames(path, [118], stats=late)[0], full[118])
    assert late["seeks"] == 1 and late["decoded"] <= 2 * 8, late
    assert read_frames(path, []).shape == (0, 16, 16, 3)


def test_decoder_threads_do_not_change_the_frames(tmp_path):
    frames = _frames(24, 64, 64)
    path = tmp_path / "v.mp4"
    write_video(path, frames, fps=4)
    one = read_frames(path, range(24))  # the default: one decoder thread
    for threads in (0, 4):  # FFmpeg's own count, and several
        np.testing.assert_array_equal(read_frames(path, range(24), threads=threads), one)


@pytest.mark.parametrize("pix_fmt", ["yuv444p", "yuv420p"])
def test_frames_equal_pyav_per_frame_conversion(tmp_path, pix_fmt):
    """read_frames reuses one RGB converter a clip; the bytes are those of PyAV's own per-frame conversion, decoded
    here independently, in any order and across seeks."""
    import av

    frames = _frames(40, 64, 64)
    path = tmp_path / "v.mp4"
    write_video(path, frames, fps=4, gop=8, pix_fmt=pix_fmt)
    with av.open(str(path)) as container:
        reference = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert reference.shape == (40, 64, 64, 3)
    np.testing.assert_array_equal(read_frames(path, range(40)), reference)
    idx = [37, 2, 2, 30, 0, 39]
    np.testing.assert_array_equal(read_frames(path, idx), reference[idx])


def test_errors(tmp_path):
    frames = _frames(5, 16, 16)
    path = tmp_path / "v.mp4"
    write_video(path, frames, fps=4)
    with pytest.raises(VideoError, match="frame 5 not found"):
        read_frames(path, [1, 5])
    with pytest.raises(VideoError, match="negative"):
        read_frames(path, [-1])
    with pytest.raises(VideoError, match="not found"):
        read_frames(tmp_path / "missing.mp4", [0])
    with pytest.raises(ValueError, match="even"):
        write_video(tmp_path / "odd.mp4", np.zeros((2, 15, 16, 3), np.uint8), fps=4)
    with pytest.raises(ValueError, match="uint8"):
        write_video(tmp_path / "f.mp4", np.zeros((2, 16, 16, 3), np.float32), fps=4)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    with pytest.raises(VideoError):
        count_frames(bad)
