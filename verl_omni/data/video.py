"""MP4 video files (H.264 through PyAV): atomic writing and random frame access.

Writing uses libx264 with full-resolution chroma (``yuv444p``) and a low CRF so that decoded frames stay
close to the rendered ones, and a short keyframe interval (``gop``) so that reading a late frame only has
to decode from the keyframe before it.

Reading (``read_frames``) visits the requested indices in ascending order and decodes forward. When the
next wanted frame lies more than ``seek_threshold`` frames ahead of the decoder position (or behind it),
it seeks the demuxer to the wanted timestamp (``container.seek(..., backward=True)`` lands on the keyframe
at or before it) and decodes forward from there, so a late index costs at most one GOP of decoding, not
the whole file. A frame's index is derived from its presentation timestamp (constant frame rate, which is
what ``write_video`` writes). Requests may come in any order and repeat indices; the output follows the
request order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

DEFAULT_CODEC = "libx264"
DEFAULT_PIX_FMT = "yuv444p"
DEFAULT_CRF = 10
DEFAULT_GOP = 16
# Decoder threads of read_frames when the caller names none; scripts/bench_decode.py changes it to time others.
DECODE_THREADS = 1
# read_frames converts a clip's frames to RGB with one reused swscale context; False converts each frame with a
# context of its own (PyAV's ``to_ndarray(format=...)``, same bytes), which scripts/bench_decode.py times beside it.
REUSE_RGB_CONVERTER = True


class VideoError(ValueError):
    """A video file is missing, unreadable, or a requested frame does not exist."""


def write_video(
    path: str | Path,
    frames: np.ndarray,
    fps: int,
    *,
    crf: int = DEFAULT_CRF,
    pix_fmt: str = DEFAULT_PIX_FMT,
    gop: int = DEFAULT_GOP,
) -> None:
    """Encodes frames to an H.264 MP4, written to a temporary name in the same folder and renamed.

    Args:
        path: Destination ``.mp4`` path. Its folder must exist.
        frames: ``uint8 [T, H, W, 3]`` RGB frames, T >= 1; H and W must be even (H.264 4:2:0/4:4:4 macroblocks
            handle odd sizes poorly across decoders, so we refuse them instead of padding silently).
        fps: Frames per second (positive integer).
        crf: x264 constant rate factor; 0 is lossless in YUV, 10 is visually lossless and small.
        pix_fmt: Encoder pixel format (``yuv444p`` keeps full chroma; ``yuv420p`` for wide compatibility).
        gop: Keyframe interval in frames; bounds the decoding work of a seek.

    Raises:
        ValueError: bad frame array or parameters.
    """
    import av  # PyAV is a base dependency; imported here to keep `import verl_omni.data` light

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(
            f"write_video({path}): frames must be uint8 [T>=1, H, W, 3], got {frames.dtype} {frames.shape}"
        )
    t, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"write_video({path}): frame height and width must be even for H.264, got {h}x{w}")
    if int(fps) != fps or fps <= 0:
        raise ValueError(f"write_video({path}): fps must be a positive integer, got {fps!r}")
    if gop < 1:
        raise ValueError(f"write_video({path}): gop must be >= 1, got {gop}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream(DEFAULT_CODEC, rate=int(fps))
            stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
            stream.time_base = Fraction(1, int(fps))
            # Single-threaded encoding: collections are written by a process pool already.
            stream.codec_context.thread_count = 1
            stream.options = {
                "crf": str(int(crf)),
                "g": str(int(gop)),
                "keyint_min": str(int(gop)),
                "preset": "veryfast",
            }
            for i in range(t):
                frame = av.VideoFrame.from_ndarray(frames[i], format="rgb24")
                frame.pts = i
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _open(path: Path):
    import av

    if not path.is_file():
        raise VideoError(f"{path}: video file not found")
    try:
        container = av.open(str(path), mode="r")
    except (av.error.FFmpegError, OSError) as e:
        raise VideoError(f"{path}: cannot open video ({e})") from e
    if not container.streams.video:
        container.close()
        raise VideoError(f"{path}: no video stream")
    return container


def _have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _cv2_capture(path: Path):
    """OpenCV capture, used only where PyAV is not installed (e.g. GPU images that ship OpenCV).

    Both libraries decode through FFmpeg; PyAV stays the default because it exposes timestamps and exact
    keyframe seeks. OpenCV's seek (``CAP_PROP_POS_FRAMES``) is frame-accurate for the constant-rate H.264
    files ``write_video`` produces.
    """
    import cv2

    if not path.is_file():
        raise VideoError(f"{path}: video file not found")
    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        raise VideoError(f"{path}: cannot open video (OpenCV)")
    return cap


def _read_frames_cv2(path: Path, idx: np.ndarray) -> np.ndarray:
    import cv2

    cap = _cv2_capture(path)
    try:
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        got: dict[int, np.ndarray] = {}
        pos = -1
        for target in np.unique(idx).tolist():
            if target < 0 or target >= n:
                raise VideoError(f"{path}: frame index {target} outside [0, {n})")
            if target != pos + 1:
                cap.set(cv2.CAP_PROP_POS_FRAMES, target)
            ok, frame = cap.read()
            if not ok:
                raise VideoError(f"{path}: cannot decode frame {target} (OpenCV)")
            got[target] = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            pos = target
    finally:
        cap.release()
    return np.stack([got[int(i)] for i in idx])


def count_frames(path: str | Path) -> int:
    """Number of frames in the first video stream.

    Uses the container's frame count when the header has one; otherwise counts demuxed packets (no
    decoding).
    """
    if not _have_pyav():
        import cv2

        cap = _cv2_capture(Path(path))
        try:
            return int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        finally:
            cap.release()
    import av

    path = Path(path)
    with _open(path) as container:
        stream = container.streams.video[0]
        if stream.frames > 0:
            return int(stream.frames)
        try:
            return sum(1 for p in container.demux(stream) if p.size > 0)
        except av.error.FFmpegError as e:
            raise VideoError(f"{path}: cannot demux video ({e})") from e


def read_frames(
    path: str | Path,
    indices: Sequence[int] | np.ndarray,
    *,
    seek_threshold: int = DEFAULT_GOP,
    stats: dict | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Decodes the requested frames (0-based indices) of a video.

    Args:
        path: Video file.
        indices: Frame indices, any order, repeats allowed.
        seek_threshold: Seek instead of decoding forward when the next wanted frame is more than this many
            frames ahead of the decoder.
        stats: When given, receives ``{"decoded": frames decoded, "seeks": seeks made}`` (for profiling and
            for tests that check that late frames do not cost a full decode).
        threads: Decoder slice threads (default :data:`DECODE_THREADS`, 1; 0 = FFmpeg's choice, one per core).
            One, because our clips are small and decoded by process pools already: with FFmpeg's choice every
            process starts a thread per core for each clip it opens (``scripts/bench_decode.py`` measures both).
            The frames are the same either way.

    Returns:
        ``uint8 [len(indices), H, W, 3]`` RGB frames in request order.

    Raises:
        VideoError: missing/unreadable file, or an index outside ``[0, count)``.
    """
    path = Path(path)
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not _have_pyav() and idx.size:
        return _read_frames_cv2(path, idx)
    import av
    from av.video.reformatter import VideoReformatter

    with _open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "SLICE"
        stream.codec_context.thread_count = DECODE_THREADS if threads is None else threads
        h, w = stream.codec_context.height, stream.codec_context.width
        if idx.size == 0:
            return np.zeros((0, h, w, 3), np.uint8)
        if idx.min() < 0:
            raise VideoError(f"{path}: negative frame index {int(idx.min())}")
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise VideoError(f"{path}: stream has no frame rate; cannot map timestamps to frame indices")
        tb = stream.time_base
        start = stream.start_time or 0
        wanted = np.unique(idx)
        got: dict[int, np.ndarray] = {}
        # One converter for the whole clip: ``VideoFrame.to_ndarray(format=...)`` builds a new swscale context for
        # every frame, which cost 4x the decode itself on 64 x 64 clips (``scripts/bench_decode.py``).
        to_rgb = VideoReformatter() if REUSE_RGB_CONVERTER else None
        pos = -1  # index of the last decoded frame; -1 = nothing decoded yet
        frames_iter = None
        decoded = seeks = 0
        try:
            for target in wanted.tolist():
                if frames_iter is None or target <= pos or target - pos > seek_threshold:
                    # Timestamp of the target in stream units; backward seek lands on the keyframe before it.
                    ts = start + int(round(Fraction(target) / Fraction(rate) / tb))
                    container.seek(ts, backward=True, any_frame=False, stream=stream)
                    frames_iter = container.decode(stream)
                    pos = -1
                    seeks += 1
                found = False
                for frame in frames_iter:
                    decoded += 1
                    if frame.pts is None:
                        raise VideoError(f"{path}: decoded frame without a timestamp")
                    pos = int(round(float((frame.pts - start) * tb * rate)))
                    if pos == target:
                        if to_rgb is None:
                            got[target] = frame.to_ndarray(format="rgb24")
                        else:
                            got[target] = to_rgb.reformat(frame, format="rgb24").to_ndarray()
                        found = True
                        break
                    if pos > target:
                        break
                if not found:
                    raise VideoError(f"{path}: frame {target} not found (video has {count_frames(path)} frames)")
        except av.error.FFmpegError as e:
            raise VideoError(f"{path}: cannot decode video ({e})") from e
    if stats is not None:
        stats.update(decoded=decoded, seeks=seeks)
    return np.stack([got[i] for i in idx.tolist()], axis=0)
