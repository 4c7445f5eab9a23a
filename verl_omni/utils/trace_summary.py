"""Per-step time tables from a ``torch.profiler`` Chrome trace.

``torch.profiler.profile.key_averages()`` builds its tables by walking every recorded event in Python; for 20 SFT
steps of the Stage-II model on an H100 host that took several minutes (more than the steps themselves), so the
tables here are summed from the exported trace in one pass instead.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Microseconds by name of device work, of top-level host operators, and of device work by launching operator.

    Args:
        events: ``traceEvents`` of a trace; complete events (``"ph": "X"``) with ``name``, ``cat``, ``ts`` and
            ``dur`` (microseconds) count, others are ignored.

    Returns:
        ``(device, host, launched)``: device kernels, copies and memsets summed by name; host ``cpu_op`` events
        that are not nested inside another ``cpu_op`` of the same thread (so a ``linear`` is not counted again as
        the ``addmm`` it calls), summed by name; and device time summed by the operator that launched it, named
        ``"<top-level op> > <innermost op> <input dims>"``. The profiler gives a kernel the ``External id`` of the
        innermost operator around its launch; kernels without one count as ``"(unattributed)"``.
    """
    device: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    launched: collections.Counter = collections.Counter()
    threads: dict[tuple, list[tuple[float, float, str, object]]] = collections.defaultdict(list)
    kernels = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat", ""), str(e.get("name", "?")), float(e.get("dur", 0.0))
        args = e.get("args") or {}
        if cat in DEVICE_CATEGORIES:
            device[name] += dur
            kernels.append((args.get("External id"), dur))
        elif cat == "cpu_op":
            start = float(e["ts"])
            threads[(e.get("pid"), e.get("tid"))].append((start, start + dur, name, args))
    by_id: dict = {}  # External id of every host operator -> "<top-level op> > <op> <dims>"
    for ops in threads.values():
        ops.sort(key=lambda op: (op[0], -op[1]))  # an enclosing op before the ops it starts with
        end, top = float("-inf"), ""
        for start, stop, name, args in ops:
            dims = args.get("Input Dims")
            label = name if not dims else f"{name} {_dims(dims)}"
            if start >= end:  # a top-level operator
                host[name] += stop - start
                end, top = stop, name
                by_id[args.get("External id")] = label
            else:
                by_id[args.get("External id")] = f"{top} > {label}"
    for ext, dur in kernels:
        launched[by_id.get(ext, "(unattributed)") if ext is not None else "(unattributed)"] += dur
    return device, host, launched


def _dims(dims) -> str:
    """Input dims of a profiled operator, without the empty entries of non-tensor arguments."""
    return str([d for d in dims if d not in ([], None, "")]).replace(" ", "")


def chrome_trace_summary(trace: Path, steps: int, rows: int = 25, width: int = 100) -> str:
    """Markdown-ish text: milliseconds per step of the top ``rows`` device and host entries of ``trace``.

    Args:
        trace: A Chrome trace written by ``torch.profiler.profile.export_chrome_trace``.
        steps: Steps the trace covers (the sums are divided by it).
        rows: Entries listed per table.
        width: Names are cut to this many characters.
    """
    if steps < 1:
        raise ValueError(f"chrome_trace_summary: steps must be >= 1, got {steps}")
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    device, host, launched = trace_times(events)

    def per_step(us: float) -> float:
        return us / 1e3 / steps

    lines = [f"device busy {per_step(sum(device.values())):.1f} ms/step; top-level host operators "
             f"{per_step(sum(host.values())):.1f} ms/step", "", "## device (ms/step)"]  # fmt: skip
    lines += [f"{per_step(v):9.2f}  {k[:width]}" for k, v in device.most_common(rows)]
    lines += ["", "## host, top-level operators (ms/step)"]
    lines += [f"{per_step(v):9.2f}  {k[:width]}" for k, v in host.most_common(rows)]
    if device:
        lines += ["", "## device time by the operator that launched it: top-level > innermost [input dims] (ms/step)"]
        lines += [f"{per_step(v):9.2f}  {k[: 2 * width]}" for k, v in launched.most_common(rows)]
    return "\n".join(lines) + "\n"


def clean_profile_window(steps: int, eval_every: int, active: int, min_wait: int = 20) -> tuple[int, int, bool]:
    """``(wait, active, clean)`` for :func:`step_profiler` over a loop of ``steps`` steps that evaluates at every
    multiple of ``eval_every`` and at its last step, so that no evaluation falls inside the profiled steps.

    The profiled steps are ``wait + 2 .. wait + 1 + active`` (1-based; one warm-up step follows a non-zero wait,
    none follows a zero one). ``active`` is cut to ``eval_every - 1`` (more steps cannot fit between two
    evaluations); the first clean window after ``wait >= min_wait`` is taken, else the latest one before it.
    Where none exists (a loop that evaluates every step), the window is as long as asked and ends at the last
    step after at most ``min_wait`` steps, and ``clean`` is False: its tables then include an evaluation.

    Args:
        steps: Steps of the loop (>= 2).
        eval_every: Steps between evaluations (>= 1).
        active: Steps asked to be profiled (>= 1).
        min_wait: Steps to let pass first (one-time costs of the first steps).
    """
    if steps < 2 or eval_every < 1 or active < 1 or min_wait < 0:
        raise ValueError(f"clean_profile_window: needs steps >= 2, eval_every >= 1, active >= 1, min_wait >= 0; got "
                         f"{steps}, {eval_every}, {active}, {min_wait}")  # fmt: skip
    fit = min(active, eval_every - 1, steps - 1)
    later, earlier = range(min_wait, steps), range(min(min_wait, steps) - 1, -1, -1)
    for wait in [*later, *earlier] if fit >= 1 else ():
        first = wait + 2 if wait else 1
        last = first + fit - 1
        if last < steps and all(step % eval_every for step in range(first, last + 1)):
            return wait, fit, True
    active = min(active, steps - 1)
    return min(min_wait, steps - 1 - active), active, False


@contextlib.contextmanager
def step_profiler(trace: Path, wait: int, active: int) -> Iterator[Callable[[int], None]]:
    """``torch.profiler`` over ``active`` steps of a loop after ``wait`` (+1 warm-up) steps, written to ``trace``.

    Yields the loop's step hook (call it once after every step, e.g. ``train_sft(step_hook=...)``). The trace is
    exported (CPU and, where there is one, CUDA activity, with input shapes) when the window closes; a loop that
    stops earlier writes nothing. Summarise it with :func:`chrome_trace_summary`.

    Args:
        trace: Chrome-trace path to write.
        wait: Steps before the window (0: no warm-up step either).
        active: Profiled steps (>= 1).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    if active < 1 or wait < 0:
        raise ValueError(f"step_profiler: active must be >= 1 and wait >= 0, got {active} and {wait}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    plan = schedule(wait=wait, warmup=1 if wait else 0, active=active, repeat=1)
    # Input shapes let the summary name the tensors each expensive kernel worked on.
    with profile(activities=activities, schedule=plan, record_shapes=True,
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace))) as prof:  # fmt: skip
        yield lambda _step: prof.step()
