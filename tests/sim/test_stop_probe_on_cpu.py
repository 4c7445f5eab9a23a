"""The STOP probe: the expert drives, checkpoints answer in its states; rates and intervals checked by hand."""

import numpy as np
import pytest
import torch

from verl_omni.sim.closed_loop import ClosedLoopConfig, EpisodeSpec, run_closed_loop
from verl_omni.sim.floorplan import FREE, WALL, FloorPlan, Room
from verl_omni.sim.stop_probe import (
    DISTANCE_BANDS,
    ProbeCall,
    ShadowPolicy,
    format_summary,
    paired_episode_bootstrap,
    rate_interval,
    summarise,
)

RES, ROW_Y = 0.05, 1.125


def empty_room() -> FloorPlan:
    """4 m x 2 m of free floor inside 0.1 m walls (free cells x in [0.1, 4.1), y in [0.1, 2.1))."""
    rows, cols = 44, 84
    material = np.full((rows, cols), WALL, np.uint8)
    material[2:-2, 2:-2] = FREE
    room_id = np.where(material == FREE, 0, -1).astype(np.int16)
    room = Room(index=0, kind="living room", rect=(2, rows - 2, 2, cols - 2), floor_rgb=(150, 140, 120))
    return FloorPlan(material, room_id, [room], [], [], RES, (0.0, 0.0), scene_id="empty")


class StraightDriver:
    """Drives +x at 0.25 m per step and STOPs once the goal is within 0.1 m (privileged pose and goal)."""

    image_size = (32, 32)
    history_frames = 1

    def act(self, history, queries):
        out = np.zeros((len(queries), 32, 4))
        for i, q in enumerate(queries):
            left = float(q.goal[0] - q.pose[0])
            steps = int(round(left / 0.25))
            out[i, :steps, 0] = 0.25
            out[i, steps:, 3] = 1.0
        return out


def tiny_policy(gate_logit: float | None):
    """The real tiny WNM model; its stop channel is centred one std below the threshold, so some chunks ask for STOP.
    With ``gate_logit``, a STOP gate whose head answers the same everywhere (object at 0 m, that visibility)."""
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMModel
    from verl_omni.models.wnm.goal_probe import ObjectViewProbe
    from verl_omni.models.wnm.stop_gate import StopGate
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig
    from verl_omni.sim.wnm_policy import WNMPolicy

    torch.manual_seed(0)
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, -0.5), std=(0.02, 0.02, 0.05, 1.0))
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)
    gate = None
    if gate_logit is not None:
        head = ObjectViewProbe(model.config.dim)
        with torch.no_grad():
            head.net[-1].weight.zero_()
            head.net[-1].bias.copy_(torch.tensor([gate_logit, 1.0, 0.0, 0.0]))
        gate = StopGate(head, stop_distance_m=0.5)
    sampler, backend = SamplerConfig(num_steps=2, window_size=1), NativeBackendConfig(deterministic=False)
    return WNMPolicy(model, sampler, backend, stop_gate=gate)


def test_shadows_never_move_the_robot_and_answer_every_call():
    plan = empty_room()
    specs = [
        EpisodeSpec(
            f"ep{k}", "empty", (0.525, ROW_Y, 0.0), (0.525 + 0.25 * n, ROW_Y), "go to the chair", 0.5, 0.25 * n, seed=k
        )  # fmt: skip
        for k, n in enumerate((10, 6))
    ]
    cfg = ClosedLoopConfig(max_steps=16, execute_steps=3)
    plain = run_closed_loop(StraightDriver(), {"empty": plan}, specs, cfg, progress=False)
    shadows = {"open": tiny_policy(10.0), "shut": tiny_policy(-10.0)}
    probe = ShadowPolicy(StraightDriver(), shadows, {"empty": plan.occupancy()}, {s.episode_id: 0.5 for s in specs}, 3)
    probed = run_closed_loop(probe, {"empty": plan}, specs, cfg, progress=False)
    for a, b in zip(plain, probed, strict=True):  # the same trajectories: answers are never executed
        np.testing.assert_array_equal(a.poses, b.poses)
        assert a.end_reason == b.end_reason == "stop"
    calls = probe.calls
    assert len(calls) == 2 * sum(r.policy_calls for r in plain)
    # Calls come at steps 0, 3, 6, ...; the state's geodesic distance is the evaluator's at that step: along the
    # free row it is the straight-line distance to the goal, a whole number of 0.25 m steps.
    for c in calls:
        r = plain[int(c.episode_id[2:])]
        step = 3 * c.call
        assert c.geodesic_m == pytest.approx(r.geodesic[step])
        assert c.geodesic_m == pytest.approx(0.25 * ((10, 6)[int(c.episode_id[2:])] - step), abs=RES)
        # The STOP comes after the remaining 0.25 m steps: inside this call's 3 executed steps when 2 or fewer are left.
        assert c.expert_stops == (c.geodesic_m < 0.5 + 1e-6)
    # A constant gate: open lets every asked STOP end the episode, shut none; the chunks are the same model's.
    open_calls = [c for c in calls if c.checkpoint == "open"]
    shut_calls = [c for c in calls if c.checkpoint == "shut"]
    assert [c.asked for c in open_calls] == [c.asked for c in shut_calls]
    assert any(c.asked for c in open_calls) and not all(c.asked for c in open_calls)
    assert all(c.gate_allows and c.ends_here == c.asked for c in open_calls)
    assert all(c.gate_allows is False and not c.ends_here for c in shut_calls)
    assert all(c.gate_distance_m == pytest.approx(0.0) for c in calls)


def test_rate_interval_is_wilson_by_hand():
    # 1 of 2: centre (0.5 + z^2/4) / (1 + z^2/2) = 0.5, half-width z sqrt(1/8 + z^2/16) / (1 + z^2/2) = 0.40551.
    lo, hi = rate_interval(1, 2)
    assert (lo, hi) == (pytest.approx(0.09453, abs=1e-5), pytest.approx(0.90547, abs=1e-5))
    # 0 of 10: from 0 to z^2 / (n + z^2) = 3.84146 / 13.84146.
    lo, hi = rate_interval(0, 10)
    assert (lo, hi) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.277533, abs=1e-6))
    assert all(np.isnan(rate_interval(0, 0)))


def test_paired_bootstrap_resamples_episodes():
    # One episode: every resample is that episode, so the interval is the point.
    assert paired_episode_bootstrap([1, 1, 0], [0, 1, 0], ["e", "e", "e"]) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    # Two episodes with differences 1 (2 calls) and 0 (2 calls): mean 0.5; resamples give 0, 0.5 or 1.
    d, lo, hi = paired_episode_bootstrap([1, 1, 0, 0], [0, 0, 0, 0], ["a", "a", "b", "b"], resamples=4000)
    assert d == 0.5 and lo == 0.0 and hi == 1.0


def test_summarise_by_hand():
    def call(ckpt, eid, k, geo, asked, allows):
        return ProbeCall(ckpt, eid, k, geo, 0.5, geo <= 0.5, asked, allows, 1.0 if allows is not None else None)

    # Bands beyond the 0.5 m radius: (-inf, 0], (0, 0.5], (0.5, 1.5], (1.5, inf).
    calls = [
        call("R1", "e1", 0, 3.0, False, False), call("R1", "e1", 1, 1.2, True, False),
        call("R1", "e1", 2, 0.8, False, True), call("R1", "e1", 3, 0.4, True, True),
        call("S3", "e1", 0, 3.0, False, False), call("S3", "e1", 1, 1.2, True, True),
        call("S3", "e1", 2, 0.8, True, True), call("S3", "e1", 3, 0.4, True, True),
        call("R1", "e2", 0, 0.9, True, True), call("S3", "e2", 0, 0.9, True, True),
    ]  # fmt: skip
    s = summarise(calls, ("S3", "R1"))
    assert len(s["bands"]) == len(DISTANCE_BANDS) == 4
    r1 = s["checkpoints"]["R1"]
    assert [row["calls"] for row in r1] == [1, 2, 1, 1]
    assert r1[0]["expert_stops"] == 1.0 and r1[1]["expert_stops"] == 0.0
    # rho+0..0.5 m holds 0.8 (e1) and 0.9 (e2): R1 asks in 1 of 2, its gate allows both, one would end.
    assert (r1[1]["asked"], r1[1]["gate_allows"], r1[1]["ends_here"]) == (0.5, 1.0, 0.5)
    assert r1[1]["asked_ci"] == [pytest.approx(0.09453, abs=1e-5), pytest.approx(0.90547, abs=1e-5)]
    assert r1[2]["ends_here"] == 0.0 and s["checkpoints"]["S3"][2]["ends_here"] == 1.0
    assert r1[1]["geodesic_m_mean"] == pytest.approx(0.85)
    paired = s["paired"]
    assert (paired["a"], paired["b"]) == ("S3", "R1")
    # rho+0..0.5 m: S3 - R1 asked = (1 - 0) in e1 and (1 - 1) in e2 -> +0.5 over 2 calls.
    assert paired["asked"][1]["difference"] == 0.5 and paired["asked"][1]["calls"] == 2
    assert paired["ends_here"][2]["difference"] == 1.0  # 1.2 m: R1's gate refused, S3's let it through
    text = format_summary(s)
    assert "paired, S3 - R1" in text and "| rho+0..0.5 m | 2 |" in text


class ScriptedShadow:
    """A shadow whose chosen chunk is fixed: ``(dx, 0, 0, 0)`` every step (robot frame), never a STOP."""

    image_size = (32, 32)
    history_frames = 1

    def __init__(self, dx: float):
        self.dx = dx
        self._chosen = None

    def act(self, history, queries):
        self._chosen = np.zeros((len(queries), 32, 4))
        self._chosen[:, :, 0] = self.dx
        return self._chosen

    def last_chosen(self):
        return self._chosen


def test_motion_of_the_answers_by_hand():
    # The expert drives +x along the free row from x = 0.525 to 3.025 (10 steps of 0.25 m, 3 executed per call).
    plan = empty_room()
    spec = EpisodeSpec("ep0", "empty", (0.525, ROW_Y, 0.0), (3.025, ROW_Y), "go to the chair", 0.5, 2.5, seed=0)
    shadows = {"back": ScriptedShadow(-0.25), "ahead": ScriptedShadow(0.25)}
    probe = ShadowPolicy(StraightDriver(), shadows, {"empty": plan.occupancy()}, {"ep0": 0.5}, 3, robot_radius=0.2)
    run_closed_loop(probe, {"empty": plan}, [spec], ClosedLoopConfig(max_steps=16, execute_steps=3), progress=False)
    back = [c for c in probe.calls if c.checkpoint == "back"]
    ahead = [c for c in probe.calls if c.checkpoint == "ahead"]
    # Call 0 at x = 0.525: backing up 0.25 m puts the disc's edge at 0.075 m, inside the wall (free from 0.1 m), so
    # the first step is refused, and so are the next two: nothing travelled, no progress, a collision.
    assert back[0].collides is True and back[0].moved_m == 0.0 and back[0].progress_m == pytest.approx(0.0)
    # Call 1 at x = 1.275: three steps back reach 0.525, all free: 0.75 m travelled, 0.75 m further from the goal.
    assert back[1].collides is False and back[1].moved_m == pytest.approx(0.75)
    assert back[1].progress_m == pytest.approx(-0.75, abs=RES)
    # Driving ahead from the same states makes the expert's progress, 0.75 m a call, until the goal's far side:
    # from x = 2.775 (call 3) the 3 steps end at 3.525, 0.5 m past the goal, so progress is 0.25 - 0.5 = -0.25,
    # while the expert takes the one 0.25 m step left and STOPs.
    for c in ahead[:3]:
        assert c.collides is False and c.moved_m == pytest.approx(0.75)
        assert c.progress_m == pytest.approx(0.75, abs=RES) and c.expert_progress_m == pytest.approx(0.75, abs=RES)
    assert ahead[3].progress_m == pytest.approx(-0.25, abs=RES) and ahead[3].expert_progress_m == pytest.approx(
        0.25, abs=RES
    )
    s = summarise(probe.calls, ("ahead", "back"))
    # Bands beyond the 0.5 m radius: call 3 (0.25 m left) is at the goal; call 0 (2.5 m) is 2.0 m beyond, the far
    # band, alone; calls 1 and 2 (1.25 and 0.5 m beyond) fall in the two bands between.
    rows = s["checkpoints"]["back"]
    assert rows[0]["calls"] == rows[3]["calls"] == 1 and rows[1]["calls"] + rows[2]["calls"] == 2
    assert s["checkpoints"]["back"][3]["collides"] == 1.0 and s["checkpoints"]["ahead"][3]["collides"] == 0.0
    assert s["paired"]["collides"][3]["difference"] == -1.0
    assert s["paired"]["moved_m"][3]["difference"] == pytest.approx(0.75)
    assert "wall hit" in format_summary(s)
