"""Per-step tables from a Chrome trace: device work by name, host operators counted once at their top level."""

import json

import pytest

from verl_omni.utils.trace_summary import chrome_trace_summary, clean_profile_window, trace_times


def _op(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def test_nested_host_ops_count_once_and_device_work_sums_by_name():
    events = [
        _op("aten::linear", 0, 100),  # encloses the addmm below: 100 us, not 100 + 80
        _op("aten::addmm", 10, 80),
        _op("aten::randn", 100, 30),  # starts where linear ends: top level
        _op("aten::linear", 200, 50, tid=2),  # another thread: top level there
        _op("aten::add", 210, 5, tid=2),
        _op("gemm", 0, 40, cat="kernel"),
        _op("gemm", 60, 20, cat="kernel"),
        _op("Memcpy HtoD", 5, 7, cat="gpu_memcpy"),
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 1},  # not a complete event
        _op("ProfilerStep#3", 0, 400, cat="user_annotation"),  # annotations are not operators
    ]
    device, host, launched = trace_times(events)
    assert dict(device) == {"gemm": 60.0, "Memcpy HtoD": 7.0}
    assert dict(host) == {"aten::linear": 150.0, "aten::randn": 30.0}
    assert dict(launched) == {"(unattributed)": 67.0}  # these kernels carry no External id


def test_device_time_goes_to_the_operator_that_launched_it():
    events = [
        _op("aten::linear", 0, 100, **{"External id": 1, "Input Dims": [[4, 8], [16, 8], [16]]}),
        _op("aten::addmm", 10, 80, **{"External id": 2, "Input Dims": [[16], [4, 8], [8, 16], [], []]}),
        _op("aten::copy_", 200, 10, tid=2, **{"External id": 3, "Input Dims": [[4, 16], [4, 16], []]}),
        _op("gemm", 20, 40, cat="kernel", **{"External id": 2, "correlation": 9}),
        _op("gemm", 70, 20, cat="kernel", **{"External id": 2, "correlation": 10}),
        _op("copy", 205, 5, cat="kernel", **{"External id": 3}),  # launched by a top-level op of another thread
        _op("orphan", 300, 1, cat="kernel", **{"External id": 99}),  # its op fell outside the profiled window
    ]
    _, _, launched = trace_times(events)
    # 40 + 20 us of gemm inside addmm inside linear; empty dims of non-tensor arguments are left out.
    assert dict(launched) == {"aten::linear > aten::addmm [[16],[4,8],[8,16]]": 60.0,
                              "aten::copy_ [[4,16],[4,16]]": 5.0, "(unattributed)": 1.0}  # fmt: skip


def test_summary_divides_by_steps(tmp_path):
    trace = tmp_path / "t.json"
    events = [_op("gemm", 0, 3000, cat="kernel", **{"External id": 5}), _op("aten::mm", 0, 5000, **{"External id": 5})]
    trace.write_text(json.dumps({"traceEvents": events}))
    text = chrome_trace_summary(trace, steps=2)
    # 3000 us of kernels over 2 steps = 1.5 ms/step; 5000 us of host ops = 2.5 ms/step.
    assert text.startswith("device busy 1.5 ms/step; top-level host operators 2.5 ms/step")
    assert "     1.50  gemm" in text and "     2.50  aten::mm" in text
    assert text.rstrip().endswith("     1.50  aten::mm")  # the launching operator's table comes last
    with pytest.raises(ValueError, match="steps"):
        chrome_trace_summary(trace, steps=0)


def test_step_profiler_writes_the_window_only_when_it_closes(tmp_path):
    import torch

    from verl_omni.utils.trace_summary import step_profiler

    trace = tmp_path / "t.json"
    with step_profiler(trace, wait=2, active=2) as hook:
        for step in range(1, 6):  # 2 waited, 1 warm-up, 2 profiled
            torch.ones(4).add_(step)
            hook(step)
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::add_" in names and "device busy 0.0 ms/step" in chrome_trace_summary(trace, 2)
    short = tmp_path / "short.json"
    with step_profiler(short, wait=5, active=2) as hook:
        hook(1)  # the loop ends before the window
    assert not short.exists()
    with pytest.raises(ValueError, match="active"), step_profiler(tmp_path / "x.json", wait=0, active=0):
        pass


@pytest.mark.parametrize(
    ("steps", "eval_every", "active", "expected"),
    [
        # session 26's round: 300 steps, evaluations every 30; 10 steps after 20 would be 22-31, holding step 30.
        # The first clean 10 are 31-40 (wait 29, then one warm-up step).
        (300, 30, 10, (29, 10, True)),
        # 100 steps with evaluations every 10: at most 9 steps fit between two; 31-39.
        (100, 10, 10, (29, 9, True)),
        # evaluations far apart: the usual 22-31
        (2000, 200, 10, (20, 10, True)),
        # too short for a window after 20 (it would reach the last step, 25, which evaluates): 15-24 instead
        (25, 100, 10, (13, 10, True)),
        # every step evaluates: no clean window; the old one (the last step, after none)
        (2, 1, 1, (0, 1, False)),
    ],
)
def test_clean_profile_window_by_hand(steps, eval_every, active, expected):
    wait, n, clean = clean_profile_window(steps, eval_every, active)
    assert (wait, n, clean) == expected
    first = wait + 2 if wait else 1
    profiled = range(first, first + n)
    assert profiled[-1] <= steps
    if clean:  # no evaluation step (a multiple of eval_every, or the last step) among the profiled steps
        assert all(s % eval_every and s != steps for s in profiled)


def test_clean_profile_window_refuses_bad_arguments():
    with pytest.raises(ValueError, match="steps >= 2"):
        clean_profile_window(1, 10, 5)
