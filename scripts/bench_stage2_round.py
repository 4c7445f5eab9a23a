"""The SFT step where the curriculum runs it: real ``train_stage2.py`` rounds, eager against compiled DiT blocks.

``bench_stage2_sft.py`` times ``train_sft`` in its own process; this one runs each variant as one
``train_stage2.py --rounds 1`` process on the same synthesized collection, with the model and SFT settings of
``scripts/stage2_curriculum.sh`` (8 layers x 256, the three built-in encoders trained, view head, independent
action noise 0.5), so whatever a round's process adds (its data on the device, its probes, its other threads)
is in the number. Variants: ``eager-bf16``, ``compiled-bf16``, ``eager-fp32``, ``compiled-fp32`` (TF32 matmuls in
float32). Each round decodes and encodes the collection again (about 25-45 s for 40 scenes on a 16-core GPU
host); only its SFT is timed. Prints, per variant, the steady ms a step (after the first 20 steps, which carry
compiling, cuDNN plan selection and the allocator's growth), those first steps' seconds, the held-out loss after
the round and the peak of the CUDA allocator, and writes them to ``WORKDIR/bench_stage2_round.json``.

    python scripts/bench_stage2_round.py --workdir RUN --device cuda --workers 16 --steps 300

No closed-loop evaluation runs (``--eval-rounds`` with no round), so ``--eval-scenes`` is kept small, and the
open-loop probes after the round read 16 states (they are not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--set", "num_layers=8", "--set", "num_heads=8", "--set", "ffn_dim=1024", "--set", "text_max_length=64"]
TASK = ["--level", "two_rooms", "--episodes-per-scene", "4", "--goal-variants", "3", "--face-goal-object",
        "--goal-point", "nearest"]  # fmt: skip
SFT = ["--view-aux-weight", "1", "--independent-action-noise", "0.5", "--lr", "5e-4", "--rounds", "1",
       "--skip-baselines", "--eval-rounds", "--eval-scenes", "2", "--eval-episodes", "4", "--probe-states", "16",
       "--no-progress"]  # fmt: skip
VARIANTS = {
    "eager-bf16": ["--sft-autocast", "bfloat16"],
    "compiled-bf16": ["--sft-autocast", "bfloat16", "--compile-blocks"],
    "eager-fp32": ["--sft-autocast", "none"],
    "compiled-fp32": ["--sft-autocast", "none", "--compile-blocks"],
}


def _link_tree(src: Path, dst: Path) -> None:
    """A copy of ``src`` made of hard links (each round gets its own folder; the collection is not copied)."""
    shutil.copytree(src, dst, copy_function=os.link)


def _round_result(work: Path) -> dict:
    """The SFT timings and the held-out loss of the round in ``work`` (from its summary and checkpoint)."""
    timings = json.loads((work / "summary.json").read_text())["timings"]
    manifest = json.loads((work / "ckpt" / "stage2_r0" / "checkpoint_manifest.json").read_text())
    return {
        "steps": int(timings["r0_sft_steps"]),
        "steady_ms_per_step": timings["r0_sft_steady_ms_per_step"],
        "warmup_steps": int(timings["r0_sft_warmup_steps"]),
        "warmup_s": timings["r0_sft_warmup_s"],
        "steps_s": timings["r0_sft_steps_s"],
        "heldout_loss": manifest["provenance"]["final_heldout_loss"]["loss"],
    }


def _peak_gib(log: str) -> str:
    """The CUDA allocator's peak from the round's "SFT time" line (absent on the CPU)."""
    for line in log.splitlines():
        if "SFT time" in line and "peak " in line:
            return line.split("peak ", 1)[1].split(" GiB", 1)[0]
    return "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True, help="new folder for the collection and the rounds")
    p.add_argument("--device", default="cuda", help="torch device of the rounds (default cuda)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU processes (default: all cores)")
    p.add_argument("--scenes", type=int, default=40, help="two_rooms scenes of the collection (default 40)")
    p.add_argument("--steps", type=int, default=300, help="SFT steps of every round (default 300; > 40 to split off "
                   "the first 20)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=256, help="SFT rows per step (default 256, the curriculum's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="WNMConfig override after the curriculum's model (num_layers=1: a quick CPU run)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the collection and of SFT (default 0)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.scenes < 1 or args.workers < 1:
        p.error("--steps, --batch-size, --scenes and --workers must be >= 1")
    work = args.workdir.resolve()
    if work.exists() and any(work.iterdir()):
        p.error(f"--workdir {work} is not empty: its rounds would be reused instead of timed; pick a new folder")
    model = MODEL + [x for kv in args.set for x in ("--set", kv)]
    common = [*TASK, "--scenes", str(args.scenes), "--seed", str(args.seed), *model, "--device", args.device,
              "--workers", str(args.workers)]  # fmt: skip
    train = [sys.executable, str(REPO / "scripts" / "train_stage2.py")]

    source = work / "collection"
    t0 = time.perf_counter()
    syn = subprocess.run([*train, "--workdir", str(source), *common, "--synthesize-only"], capture_output=True,
                         text=True)  # fmt: skip
    if syn.returncode != 0:  # e.g. a bad --set: say what train_stage2.py said, not a traceback of this script
        print(f"[bench] synthesizing the collection failed (train_stage2.py exit {syn.returncode}):\n"
              f"{syn.stderr[-2000:]}", file=sys.stderr)  # fmt: skip
        return 2
    print(f"[bench] collection of {args.scenes} scenes in {time.perf_counter() - t0:.0f}s: {source / 'data'}",
          flush=True)  # fmt: skip

    results = {}
    for name in args.variants:
        run = work / name
        (run / "data").mkdir(parents=True)
        for part in ("r0", "r0_occ"):
            _link_tree(source / "data" / part, run / "data" / part)
        cmd = [*train, "--workdir", str(run), *common, *SFT, "--sft-steps", str(args.steps),
               "--batch-size", str(args.batch_size), *VARIANTS[name]]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (run / "round.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"[bench] {name}: train_stage2.py failed (exit {proc.returncode}); log {run / 'round.log'}:\n"
                  f"{proc.stderr[-2000:]}", flush=True)  # fmt: skip
            continue
        results[name] = {**_round_result(run), "peak_gib": _peak_gib(proc.stdout + proc.stderr),
                         "round_s": time.perf_counter() - t0}  # fmt: skip
        r = results[name]
        print(f"[bench] {name}: {r['steady_ms_per_step']:.1f} ms/step after the first {r['warmup_steps']} steps "
              f"({r['warmup_s']:.1f}s); held-out loss {r['heldout_loss']:.3f}", flush=True)  # fmt: skip

    out = work / "bench_stage2_round.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"arguments": {k: str(v) for k, v in vars(args).items()}, "results": results},
                              indent=1) + "\n")  # fmt: skip
    tmp.replace(out)
    ref = results.get("eager-bf16", {}).get("steady_ms_per_step")
    print(f"\n| round SFT step, batch {args.batch_size}, {args.steps} steps | steady ms/step | vs eager-bf16 | first "
          f"steps (s) | held-out loss | peak GiB |\n| --- | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    for name, r in results.items():
        ms = r["steady_ms_per_step"]
        ratio = f"{ref / ms:.2f}x" if ref and ms else "-"
        print(f"| {name} | {ms:.1f} | {ratio} | {r['warmup_s']:.1f} ({r['warmup_steps']} steps) | "
              f"{r['heldout_loss']:.3f} | {r['peak_gib']} |")  # fmt: skip
    return 0 if len(results) == len(args.variants) else 1


if __name__ == "__main__":
    raise SystemExit(main())
