"""Open-loop probe errors against hand-integrated trajectories."""

import math

import numpy as np
import pytest

from verl_omni.sim.probes import _ablate, format_probe_table, open_loop_errors


def test_endpoint_errors_of_straight_lines():
    fwd = np.zeros((1, 32, 4))
    fwd[..., 0] = 0.25  # 0.25 m per step straight ahead
    still = np.zeros((1, 32, 4))
    e = open_loop_errors(fwd, still)
    assert e["endpoint_chunk_m"][0] == pytest.approx(8 * 0.25)
    assert e["endpoint_all_m"][0] == pytest.approx(32 * 0.25)
    assert e["heading_chunk_deg"][0] == pytest.approx(0.0)


def test_heading_error_and_stop_freeze():
    turn = np.zeros((1, 32, 4))
    turn[..., 2] = math.pi / 6  # 30 degrees per step: after 8 steps 240 deg, wrapped to 120 deg
    e = open_loop_errors(turn, np.zeros((1, 32, 4)))
    assert e["heading_chunk_deg"][0] == pytest.approx(120.0)
    fwd_then_stop = np.zeros((1, 32, 4))
    fwd_then_stop[0, :, 0] = 0.25
    fwd_then_stop[0, 2:, 3] = 1.0  # STOP at step 2: only two steps are driven
    e = open_loop_errors(fwd_then_stop, np.zeros((1, 32, 4)))
    assert e["endpoint_all_m"][0] == pytest.approx(0.5)


def test_ablations_break_one_input_each():
    hist = np.arange(3 * 4).reshape(3, 4, 1, 1, 1).astype(np.uint8)
    instr = ["a", "b", "c"]
    h, i = _ablate("shuffled_instruction", hist, instr)
    assert (h == hist).all() and i == ["c", "a", "b"]
    h, i = _ablate("static_history", hist, instr)
    assert (h[:, :, 0, 0, 0] == hist[:, -1:, 0, 0, 0]).all() and i == instr
    h, i = _ablate("shuffled_views", hist, instr)
    assert (h == hist[[2, 0, 1]]).all() and i == instr
    with pytest.raises(ValueError):
        _ablate("nothing", hist, instr)
    table = format_probe_table({"full": {"endpoint_chunk_m": 1.0, "endpoint_all_m": 2.0, "heading_chunk_deg": 3.0}})
    assert "| full | 1.000 | 2.000 | 3.0 | nan | nan |" in table  # results saved before the STOP columns existed


def test_early_and_missed_stop_in_the_first_chunk():
    def stopping_at(k):
        a = np.zeros((1, 32, 4))
        a[0, k:, 3] = 1.0
        return a

    # Four states: policy STOP at step 3 / 20 / 5 / 30, expert STOP at 12 / 6 / 2 / 31.
    policy = np.concatenate([stopping_at(3), stopping_at(20), stopping_at(5), stopping_at(30)])
    expert = np.concatenate([stopping_at(12), stopping_at(6), stopping_at(2), stopping_at(31)])
    e = open_loop_errors(policy, expert)
    np.testing.assert_array_equal(e["early_stop_chunk"], [1.0, 0.0, 0.0, 0.0])  # only the first stops too soon
    np.testing.assert_array_equal(e["missed_stop_chunk"], [0.0, 1.0, 0.0, 0.0])  # the second drives past it
