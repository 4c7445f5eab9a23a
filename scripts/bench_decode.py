"""States per second out of ``iter_expert_examples`` (the decoding half of a Stage-II round's encoding) by RGB
converter, decoder threads and decoding processes.

    python scripts/bench_decode.py --collection RUN/two_rooms/data/r0 --workers 1 2 16 --threads 1 0

``--converter clip`` is what ``verl_omni.data.video.read_frames`` does (one swscale context a clip), ``frame`` what
it did before (PyAV's ``to_ndarray(format="rgb24")``, a context a frame); the frames are the same bytes.
``--threads 0`` is FFmpeg's own choice (a thread per core in every decoding process); 1 is what
``verl_omni.data.video.read_frames`` uses. The pool's processes are forked, so they see the setting of each row.
Each row decodes the same ``--states`` query states. Every file of the collection is read once before the first
row, so that no row pays for the page cache (the first used to: it read from disk what the others found in memory).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collection", type=Path, required=True, help="GN0 collection (e.g. train_stage2.py's data/r0)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="decoding processes per row")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="decoder threads per row (0 = FFmpeg's)")
    p.add_argument("--states", type=int, default=2000, help="query states decoded per row (default 2000)")
    p.add_argument("--history-frames", type=int, default=33, help="history frames per state (default 33)")
    p.add_argument("--converter", nargs="+", choices=("clip", "frame"), default=["clip", "frame"],
                   help="RGB conversion: one swscale context a clip (read_frames' default) or one a frame (PyAV's "
                        "to_ndarray(format=...)); default both")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.workers) < 1 or min(args.threads) < 0 or args.states < 1:
        p.error("--workers and --states must be >= 1 and --threads >= 0")
    import multiprocessing as mp

    if mp.get_start_method(allow_none=True) not in (None, "fork"):
        p.error("the decoding processes must be forked to see each row's thread setting")
    mp.set_start_method("fork", force=True)

    from verl_omni.data import video
    from verl_omni.data.gn0 import read_collection_info
    from verl_omni.models.wnm.expert_data import iter_expert_examples

    info = read_collection_info(args.collection)
    size = tuple(info.image_size)
    t0, n_files, n_bytes = time.perf_counter(), 0, 0
    for f in sorted(args.collection.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    n_bytes += len(chunk)
            n_files += 1
    print(f"# page cache warmed: {n_files} files, {n_bytes / 1e6:.0f} MB read in {time.perf_counter() - t0:.1f} s")
    print(f"# decoding {args.collection} ({size[0]} x {size[1]} frames), {args.states} states a row\n")
    print("| RGB converter | decoder threads | processes | states | seconds | states/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    defaults = video.DECODE_THREADS, video.REUSE_RGB_CONVERTER
    try:
        for converter, threads, workers in itertools.product(args.converter, args.threads, args.workers):
            video.DECODE_THREADS = threads
            video.REUSE_RGB_CONVERTER = converter == "clip"
            t0 = time.perf_counter()
            stream = iter_expert_examples(args.collection, args.history_frames, size, False, workers)
            n = sum(1 for _ in itertools.islice(stream, args.states))
            dt = time.perf_counter() - t0
            row = f"| one a {converter} | {threads or 'FFmpeg'} | {workers} | {n} | {dt:.1f} | {n / dt:.0f} |"
            print(row, flush=True)
    finally:  # the module's settings as they were (the script also runs inside test processes)
        video.DECODE_THREADS, video.REUSE_RGB_CONVERTER = defaults
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
