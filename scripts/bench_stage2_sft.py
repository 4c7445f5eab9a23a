"""Where a Stage-II round spends its time: decoding, encoding and the SFT step, and what the SFT options save.

Prints three tables for the model of ``scripts/stage2_curriculum.sh`` (8 layers x 256, the three built-in encoders
trained, the view head, independent action noise 0.5):

1. decoding: query states per second out of ``iter_expert_examples`` (``--workers`` processes), given
   ``--collection`` (a GN0 collection, e.g. from ``train_stage2.py --synthesize-only``);
2. encoding: states per second through ``encode_examples`` (VAE + frozen encoders, batch 64), decoding excluded;
3. the SFT step at ``--batch-size`` for each variant, each from the same initial weights and rows: ms per step
   from the difference of two runs of ``train_sft`` (``--steps`` and twice as many), so that the fixed costs
   (held-out losses, probes, compiling) cancel.

    python scripts/bench_stage2_sft.py --device cuda --collection RUN/two_rooms/data/r0 --workers 16

Without ``--collection`` the states are random frames (shapes as in a collection; fine for timing, not for loss).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from pathlib import Path

import numpy as np
import torch

MODEL = {"num_layers": 8, "num_heads": 8, "ffn_dim": 1024, "text_max_length": 64}  # stage2_curriculum.sh's model
VARIANTS = {
    "blocking": "blocking copies and a wait every step (the loop before this benchmark)",
    "default": "float32 weights, TF32 matmuls, no per-step wait",
    "bf16": "+ bfloat16 autocast",
    "compile": "+ compile_blocks()",
    "bf16+compile": "+ bfloat16 autocast + compile_blocks()",
}


def _random_examples(n: int, cfg, seed: int = 0):
    from verl_omni.models.wnm.expert_data import ExpertExample

    rng = np.random.default_rng(seed)
    h, w = cfg.image_size
    words = ["go", "to", "the", "red", "chair", "blue", "table", "lamp", "in", "kitchen", "bedroom", "stop", "near"]
    for i in range(n):
        yield ExpertExample(
            episode_id=f"e{i // 6:05d}",
            history=rng.integers(0, 256, (cfg.history_frames, h, w, 3), dtype=np.uint8),
            target=rng.integers(0, 256, (cfg.target_frames, h, w, 3), dtype=np.uint8),
            actions=rng.normal(size=(32, 4)),
            instructions=tuple(" ".join(rng.choice(words, 8)) for _ in range(3)),
            goal_polar=rng.normal(size=3).astype(np.float32),
            goal_view=np.array([rng.integers(0, 2), 1.0, 0.0, rng.random()], np.float32),
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _blocking(device: torch.device):
    """The SFT loop as it was: every host-to-device copy blocking and one wait for the device per step."""
    from verl_omni.models.wnm import sft

    real_to, real_loss = sft.to_device, sft.joint_flow_matching_loss

    def loss_then_wait(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        _sync(device)
        return out

    sft.to_device, sft.joint_flow_matching_loss = (lambda t, d: t.to(d)), loss_then_wait
    try:
        yield
    finally:
        sft.to_device, sft.joint_flow_matching_loss = real_to, real_loss


def _train_seconds(model, init, rows, held, cfg, device, variant: str) -> tuple[float, float, float]:
    """Seconds of ``train_sft(cfg)`` from ``init``, its peak GiB and its final held-out loss."""
    from verl_omni.models.wnm import sft

    model.load_state_dict(init)
    for block in model.transformer.blocks:  # undo an earlier variant's compile
        block.__dict__.pop("block_forward", None)
    model.transformer.compiled_blocks = False
    if "compile" in variant:
        model.transformer.compile_blocks()
        warm = sft.SFTConfig(**{**cfg.__dict__, "steps": 2, "eval_every": 2})
        sft.train_sft(model, rows, held, warm, progress=False)  # compiles the shapes here, not in the timed runs
        model.load_state_dict(init)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ctx = _blocking(device) if variant == "blocking" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        result = sft.train_sft(model, rows, held, cfg, progress=False)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")
    return time.perf_counter() - t0, peak, result["final_heldout"]["loss"]


def _profile(model, init, rows, held, base: dict, variant: str, args) -> str:
    """Where ``args.profile_steps`` SFT steps of ``variant`` spend device and host time (after 10 steps)."""
    import tempfile

    from verl_omni.models.wnm import sft
    from verl_omni.utils.trace_summary import chrome_trace_summary, step_profiler

    steps = 10 + 1 + args.profile_steps + 1  # the last step evaluates the held-out rows: outside the window
    cfg = sft.SFTConfig(steps=steps, eval_every=steps, autocast="bfloat16" if "bf16" in variant else "none", **base)
    model.load_state_dict(init)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with step_profiler(trace, 10, args.profile_steps) as hook:
            sft.train_sft(model, rows, held, cfg, progress=False, step_hook=hook)
        return chrome_trace_summary(trace, args.profile_steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--collection", type=Path, default=None, help="GN0 collection to decode (default: random frames)")
    p.add_argument("--states", type=int, default=2048, help="query states decoded and encoded (default 2048)")
    p.add_argument("--workers", type=int, default=1, help="decoding processes (default 1)")
    p.add_argument("--batch-size", type=int, default=256, help="SFT rows per step (default 256)")
    p.add_argument("--steps", type=int, default=20, help="SFT steps of the shorter timed run (default 20)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile this many SFT steps of every variant (after 10) and print where device and host time go, "
        "as train_stage2.py --profile-sft-steps does in a real round (default 0: off)",
    )
    p.add_argument(
        "--encode-batches",
        type=int,
        nargs="+",
        default=[64],
        help="examples per encoder call to time encoding at (default 64; train_stage2.py uses 256 on CUDA)",
    )
    args = p.parse_args(argv)
    if args.states < 8 or args.steps < 1 or args.batch_size < 1 or args.workers < 1 or args.profile_steps < 0:
        p.error("--states must be >= 8, --steps, --batch-size, --workers >= 1 and --profile-steps >= 0")
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")  # as train_stage2.py trains (--matmul-precision high)

    from verl_omni.models.wnm import WNMConfig, WNMModel, sft

    cfg = WNMConfig.from_size("tiny", **MODEL)
    if args.collection is not None:
        stream = sft.iter_expert_examples(args.collection, cfg.history_frames, cfg.image_size, False, args.workers)
        t0 = time.perf_counter()
        examples = list(itertools.islice(stream, args.states))
        decode_s = time.perf_counter() - t0
        source = f"{args.collection} ({args.workers} decoding processes)"
    else:
        examples, decode_s, source = list(_random_examples(args.states, cfg)), None, "random frames"
    torch.manual_seed(0)
    model = WNMModel(cfg).to(device)
    encode_s = {}
    for i, eb in enumerate(args.encode_batches):  # the first call calibrates; later ones time the same encoders
        _sync(device)
        t0 = time.perf_counter()
        rows = sft.encode_examples(model, examples, batch=eb, progress=False, calibrate=i == 0,
                                   fit_normalization=i == 0)  # fmt: skip
        _sync(device)
        encode_s[eb] = time.perf_counter() - t0
    held = sft.encode_examples(model, examples[:64], batch=64, progress=False)
    n = len(examples)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# Stage-II round costs on {name}, torch {torch.__version__}; {n} states from {source}\n")
    print("| stage | states/s | seconds |\n| --- | --- | --- |")
    if decode_s is not None:
        print(f"| decode (iter_expert_examples) | {n / decode_s:.0f} | {decode_s:.1f} |")
    for eb, seconds in encode_s.items():
        print(f"| encode (encode_examples, batch {eb}, decoding excluded) | {n / seconds:.0f} | {seconds:.1f} |")
    print()

    init = {k: v.clone() for k, v in model.state_dict().items()}
    base = dict(batch_size=args.batch_size, lr=5e-4, eval_rows=64, train_encoders=sft.TRAINABLE_ENCODERS,
                view_aux_weight=1.0, independent_action_noise=0.5)  # fmt: skip
    table = []
    for variant in args.variants:
        autocast = "bfloat16" if "bf16" in variant else "none"
        short = sft.SFTConfig(steps=args.steps, eval_every=args.steps, autocast=autocast, **base)
        long = sft.SFTConfig(steps=3 * args.steps, eval_every=3 * args.steps, autocast=autocast, **base)
        try:
            t_short, _, _ = _train_seconds(model, init, rows, held, short, device, variant)
            t_long, peak, loss = _train_seconds(model, init, rows, held, long, device, variant)
        except Exception as e:  # a variant that cannot run here (e.g. no compiler) is reported, not fatal
            print(f"  {variant}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        ms = 1000 * (t_long - t_short) / (2 * args.steps)
        table.append((variant, ms, peak, loss))
        print(f"  {variant}: {ms:.1f} ms/step ({t_short:.1f} s / {t_long:.1f} s)", flush=True)
    if device.type == "cuda":  # where the default loop still waits for the device (2 steps + the fixed evaluations)
        import collections
        import warnings

        cfg2 = sft.SFTConfig(steps=2, eval_every=2, **base)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _train_seconds(model, init, rows, held, cfg2, device, "default")  # the waits are what counts
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))  # fmt: skip
        print(
            f"\ndevice waits in a 2-step train_sft (incl. its held-out evaluations): {sum(where.values())}; "
            f"by line: {dict(where.most_common(12))}"
        )
    for variant in args.variants if args.profile_steps else ():
        summary = _profile(model, init, rows, held, base, variant, args)
        print(f"\n## profile of {args.profile_steps} steps, {variant}\n\n{summary}")
    ref = {v: ms for v, ms, _, _ in table}.get("default")
    print(f"\n| SFT step, batch {args.batch_size} | ms/step | rows/s | vs default | peak GiB | held-out loss after "
          f"{3 * args.steps} steps |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for variant, ms, peak, loss in table:
        ratio = f"{ref / ms:.2f}x" if ref else "-"
        print(f"| {variant}: {VARIANTS[variant]} | {ms:.1f} | {1000 * args.batch_size / ms:.0f} | {ratio} | "
              f"{peak:.2f} | {loss:.4f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
