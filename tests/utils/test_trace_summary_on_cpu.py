"""Per-step tables from a Chrome trace: device work by name, host operators counted once at their top level."""

import json

import pytest

from verl_omni.utils.trace_summary import chrome_trace_summary, trace_times


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


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
    device, host = trace_times(events)
    assert dict(device) == {"gemm": 60.0, "Memcpy HtoD": 7.0}
    assert dict(host) == {"aten::linear": 150.0, "aten::randn": 30.0}


def test_summary_divides_by_steps(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [_op("gemm", 0, 3000, cat="kernel"), _op("aten::mm", 0, 5000)]}))
    text = chrome_trace_summary(trace, steps=2)
    # 3000 us of kernels over 2 steps = 1.5 ms/step; 5000 us of host ops = 2.5 ms/step.
    assert text.startswith("device busy 1.5 ms/step; top-level host operators 2.5 ms/step")
    assert "     1.50  gemm" in text and "     2.50  aten::mm" in text
    with pytest.raises(ValueError, match="steps"):
        chrome_trace_summary(trace, steps=0)
