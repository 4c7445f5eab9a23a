"""Data-pipeline scale study: wall time and peak memory of the data tools against collection size.

    python scripts/bench_data_scale.py --workdir /tmp/wnm_scale [--sizes 24 240 2400] [--image-size 32]

For each size N (episodes; 24 is the quickstart's collection) it synthesizes a GN0 collection at a small
frame size (2 worker processes), then runs and measures, each as its own process under ``/usr/bin/time``:

- converter     tools/data/convert_interiorgs_dagger_to_rlhf.py (2 workers, 10% held out)
- sampler       tools/data/sample_stage3_train.py (train size N/6, one row per episode)
- event val     tools/data/build_vggt_stage3_event_val.py (N/100 rows per event, at least 1)
- validate.sh   recipes/wnm_3d/stage3/validate.sh on the resulting workspace
- dataset load  the trainer's Stage3Dataset.open of the training subset and the converted set, plus one
                epoch of row access (what the driver does per step, without frame decoding)

and prints one table (wall seconds, peak RSS in MiB, and rows) in Markdown. Peak RSS includes the Python
and PyTorch import (~250-400 MiB), which is why it barely moves at small sizes. Workspaces already present
under --workdir (``c<N>``/``s<N>``) are reused, so a second run re-measures the tools only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOAD_SNIPPET = """
import sys, time
from verl_omni.data.dataset import EpochSampler, Stage3Dataset
t = time.perf_counter()
n = 0
for path in sys.argv[1:]:
    ds = Stage3Dataset.open(path)
    sampler = EpochSampler(ds.sample_ids, 42)
    for i in sampler.next_indices(len(ds)):
        ds[int(i)]
    n += len(ds)
print(f"rows {n} in {time.perf_counter() - t:.2f} s")
"""


def timed(cmd: list[str], env: dict | None = None, log: Path | None = None) -> tuple[float, float, str]:
    """Runs ``cmd`` under /usr/bin/time; returns (wall s, peak RSS MiB, stdout+stderr)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        full = ["/usr/bin/time", "-f", "%e %M", "-o", tf.name, *cmd]
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **(env or {})}
        proc = subprocess.run(full, cwd=REPO, env=run_env, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        if log is not None:
            log.write_text(text)
        if proc.returncode != 0:
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
        wall, rss_kb = tf.read().split()[-2:]
    return float(wall), float(rss_kb) / 1024.0, text


def layout(n: int) -> tuple[int, int]:
    """(scenes, episodes per scene) for N episodes: the quickstart's 6 x 4 at 24, 40 per scene above."""
    if n <= 24:
        return 6, max(1, n // 6)
    return max(1, n // 40), 40


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="where collections and outputs go")
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 240, 2400], help="episodes per collection")
    parser.add_argument("--image-size", type=int, default=32, help="frame size in pixels (square)")
    args = parser.parse_args()
    py = sys.executable
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"ckpt{args.image_size}"
    if not ckpt.is_dir():
        timed(
            [py, "tools/checkpoint/make_tiny_wnm_checkpoint.py", "--output-dir", str(ckpt), "--size", "tiny",
             "--set", f"image_size=[{args.image_size},{args.image_size}]"]
        )  # fmt: skip
    rows = []
    for n in args.sizes:
        scenes, per_scene = layout(n)
        col, occ = work / f"c{n}", work / f"s{n}"
        if not (col / "collection.json").is_file():
            wall, mem, _ = timed(
                [py, "tools/data/synthesize_gn0_collection.py", "--output-dir", str(col), "--occupancy-dir", str(occ),
                 "--num-scenes", str(scenes), "--episodes-per-scene", str(per_scene), "--image-size",
                 str(args.image_size), "--seed", "11", "--workers", "2"]
            )  # fmt: skip
            rows.append((n, "synthesize (2 workers)", wall, mem, n))
        run = work / f"run{n}"
        if run.exists():
            import shutil

            shutil.rmtree(run)
        run.mkdir()
        conv, train, val = run / "converted", run / "train", run / "eventval"
        wall, mem, _ = timed(
            [py, "tools/data/convert_interiorgs_dagger_to_rlhf.py", "--input-root", str(col), "--output-dir",
             str(conv), "--checkpoint", str(ckpt), "--occupancy-root", str(occ), "--shard-size", "4096",
             "--val-fraction", "0.1", "--split-seed", "42", "--workers", "2", "--worker-prefetch", "4"]
        )  # fmt: skip
        conv_rows = json.loads((conv / "manifest.json").read_text())["counts"]["rows"]
        rows.append((n, "converter (2 workers)", wall, mem, conv_rows))
        train_size = max(4, n // 6)
        wall, mem, _ = timed(
            [py, "tools/data/sample_stage3_train.py", "--source-manifest", str(conv / "manifest.json"),
             "--output-dir", str(train), "--train-size", str(train_size), "--shard-size", "4096", "--seed", "42"]
        )  # fmt: skip
        rows.append((n, "sampler", wall, mem, train_size))
        per_event = max(1, n // 100)
        wall, mem, _ = timed(
            [py, "tools/data/build_vggt_stage3_event_val.py", "--input-root", str(col), "--output-dir", str(val),
             "--checkpoint", str(ckpt), "--exclude-parquet-dir", str(train), "--occupancy-root", str(occ),
             "--per-event", str(per_event), "--workers", "2", "--allow-short"]
        )  # fmt: skip
        val_rows = json.loads((val / "manifest.json").read_text())["counts"]["rows"]
        rows.append((n, "event-val builder (2 workers)", wall, mem, val_rows))
        env_file = run / "paths.env"
        values = {
            "WNM3D_INITIAL_CHECKPOINT": ckpt,
            "WAM_DATA_CONTRACT_CHECKPOINT": ckpt,
            "WAM_DATA_ROOT": train,
            "WAM_EVENT_VAL_FILE": val / "event_val.parquet",
            "WAM_EXPECTED_TRAIN_SIZE": train_size,
            "WAM_VAL_MAX_SAMPLES": 1,
            "WAM_OUTPUT_DIR": run / "out",
            "WAM_GPUS_PER_NODE": 0,
            "WAM_CPU_WORKERS": 2,
        }
        env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("WAM_", "WNM"))}
        clean.update({"WAM_PATHS_ENV": str(env_file), "WNM_PYTHON": py})
        wall, mem, text = timed(["bash", "recipes/wnm_3d/stage3/validate.sh"], env=clean, log=run / "validate.log")
        if "STAGE3_CONFIG_CONTRACT_OK" not in text:
            raise SystemExit(f"validate.sh did not pass on {run}:\n{text[-3000:]}")
        rows.append((n, "validate.sh", wall, mem, train_size + val_rows))
        wall, mem, _ = timed([py, "-c", LOAD_SNIPPET, str(train), str(conv)])
        rows.append((n, "trainer dataset load + 1 epoch (subset + converted)", wall, mem, train_size + conv_rows))
    print("| episodes | stage | wall s | peak RSS MiB | rows |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n, stage, wall, mem, count in rows:
        print(f"| {n} | {stage} | {wall:.1f} | {mem:.0f} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
