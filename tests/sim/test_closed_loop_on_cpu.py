"""Closed-loop evaluator: hand-built rooms with scripted policies, held-out episodes, and the real tiny WNM model.

The empty room is 4 m x 2 m of free floor inside 0.1 m walls (grid 0.05 m, origin 0): free cells are
``x in [0.1, 4.1)``, ``y in [0.1, 2.1)``. Start and goal sit on cell centres of one row, so the geodesic distance
between them is an exact number of cells.
"""

import json
import math

import numpy as np
import pytest
import torch

from verl_omni.data.actions import wrap_angle
from verl_omni.sim.closed_loop import (
    ClosedLoopConfig,
    EpisodeResult,
    EpisodeSpec,
    execute_actions,
    run_closed_loop,
)
from verl_omni.sim.floorplan import FREE, WALL, FloorPlan, FloorPlanConfig, Room, generate_floor_plan
from verl_omni.sim.render import CameraConfig, Renderer

RES = 0.05
ROW_Y = 1.125  # centre of row 22


def empty_room(scene_id: str = "empty") -> FloorPlan:
    rows, cols = 44, 84  # 2.2 m x 4.2 m including two wall cells on every side
    material = np.full((rows, cols), WALL, np.uint8)
    material[2:-2, 2:-2] = FREE
    room_id = np.where(material == FREE, 0, -1).astype(np.int16)
    room = Room(index=0, kind="living room", rect=(2, rows - 2, 2, cols - 2), floor_rgb=(150, 140, 120))
    return FloorPlan(material, room_id, [room], [], [], RES, (0.0, 0.0), scene_id=scene_id)


def spec(start_x: float, goal_x: float, eid: str = "ep", shortest: float | None = None, seed: int = 0) -> EpisodeSpec:
    return EpisodeSpec(
        episode_id=eid,
        scene_id="empty",
        start_pose=(start_x, ROW_Y, 0.0),
        goal=(goal_x, ROW_Y),
        instruction="go to the goal",
        success_radius=0.5,
        shortest_path_m=abs(goal_x - start_x) if shortest is None else shortest,
        seed=seed,
    )


class Scripted:
    """Scripted reference policies (privileged pose and goal), recording what the evaluator hands them."""

    image_size = (16, 16)
    history_frames = 33

    def __init__(self, mode: str, horizon: int = 32):
        self.mode, self.horizon = mode, horizon
        self.calls: list[tuple[np.ndarray, list]] = []

    def act(self, history, queries):
        self.calls.append((history.copy(), list(queries)))
        return np.stack([self._plan(q.pose, q.goal) for q in queries])

    def _plan(self, pose, goal):
        out = np.zeros((self.horizon, 4))
        if self.mode == "stop":
            out[:, 3] = 1.0
        elif self.mode == "forward":
            out[:, 0] = 0.25
        elif self.mode == "straight":
            x, y, yaw = (float(v) for v in pose)
            for k in range(self.horizon):
                d = np.asarray(goal) - (x, y)
                dist = float(np.hypot(*d))
                if dist <= 1e-6:
                    out[k:, 3] = 1.0
                    break
                heading = math.atan2(d[1], d[0])
                step = min(0.25, dist)
                c, s = math.cos(yaw), math.sin(yaw)
                wx, wy = d / dist * step
                out[k, :3] = (c * wx + s * wy, -s * wx + c * wy, float(wrap_angle(heading - yaw)))
                x, y, yaw = x + wx, y + wy, heading
        return out


def run(policy, specs, **cfg):
    return run_closed_loop(policy, {"empty": empty_room()}, specs, ClosedLoopConfig(**cfg), progress=False)


def test_walks_straight_to_the_goal_and_stops_there_sr_1():
    policy = Scripted("straight")
    (r,) = run(policy, [spec(1.025, 3.025)])
    assert r.end_reason == "stop" and r.success and r.oracle_success
    # 2 m in 8 steps of 0.25 m; the STOP (9th action) falls outside the first chunk, so a second call issues it.
    assert r.steps == 8 and r.policy_calls == 2
    assert r.path_length == pytest.approx(2.0, abs=1e-9)
    assert r.spl == pytest.approx(1.0, abs=1e-6) and r.ne == pytest.approx(0.0, abs=1e-6)
    assert r.collisions == 0 and not r.collided
    np.testing.assert_allclose(r.poses[:, 0], 1.025 + 0.25 * np.arange(9), atol=1e-9)
    np.testing.assert_allclose(r.geodesic, 2.0 - 0.25 * np.arange(9), atol=1e-5)


def test_stops_at_once_sr_0():
    (r,) = run(Scripted("stop"), [spec(1.025, 3.025)])
    assert r.end_reason == "stop" and r.steps == 0 and r.policy_calls == 1
    assert not r.success and not r.oracle_success
    assert r.spl == 0.0 and r.ne == pytest.approx(2.0, abs=1e-5) and r.path_length == 0.0


def test_stop_near_but_outside_radius_is_oracle_success_only():
    # Drives through the goal's radius and stops 1.5 m beyond the goal.
    class Overshoot(Scripted):
        def _plan(self, pose, goal):
            out = np.zeros((self.horizon, 4))
            out[:, 0] = 0.25
            out[10:, 3] = 1.0  # 10 steps = 2.5 m from x=1.025: passes the goal at 2.025, stops at 3.525
            return out

    (r,) = run(Overshoot("x"), [spec(1.025, 2.025)], execute_steps=32)
    assert r.end_reason == "stop" and not r.success and r.oracle_success
    assert r.steps == 10 and r.collisions == 0
    assert r.ne == pytest.approx(1.5, abs=1e-5) and r.spl == 0.0


def test_collision_blocks_translation_and_counts_every_push():
    # Forward from x=3.01: 3.26, 3.51, 3.76 are free for a 0.2 m disc (cell 75 clearance 0.225 m); the sweep
    # toward 4.01 reaches cell 78 (clearance 0.175 m) and is refused, every remaining step.
    (r,) = run(Scripted("forward"), [spec(3.01, 1.025, shortest=2.0)], max_steps=16)
    assert r.end_reason == "max_steps" and r.steps == 16 and r.policy_calls == 2
    assert r.collisions == 13 and r.collided
    assert r.blocked.tolist() == [False] * 3 + [True] * 13
    np.testing.assert_allclose(r.poses[-1], [3.76, ROW_Y, 0.0], atol=1e-9)
    assert r.path_length == pytest.approx(0.75, abs=1e-9)
    assert r.ne == pytest.approx(2.75, abs=1e-5)  # cell 75 -> cell 20


def test_collision_can_end_the_episode():
    (r,) = run(Scripted("forward"), [spec(3.01, 1.025, shortest=2.0)], max_steps=16, collision="end")
    assert r.end_reason == "collision" and r.steps == 4 and r.collisions == 1 and r.policy_calls == 1


def test_step_limit_without_stop():
    class Still(Scripted):
        def _plan(self, pose, goal):
            return np.zeros((self.horizon, 4))

    (r,) = run(Still("x"), [spec(1.025, 3.025)], max_steps=20)
    assert r.end_reason == "max_steps" and r.steps == 20 and r.policy_calls == 3  # 8 + 8 + 4


def test_history_clamps_to_first_frame_and_batches_active_episodes():
    policy = Scripted("straight")
    # The second episode starts on its goal: the straight policy stops at once (shortest_path_m is unused there).
    specs = [spec(1.025, 3.025, "walker"), spec(1.025, 1.025, "at-goal", shortest=0.05)]
    walker, at_goal = run(policy, specs)
    assert at_goal.end_reason == "stop" and at_goal.success and at_goal.steps == 0
    # Every active episode shares a call; after the first one only the walker is left.
    assert [[q.episode_id for q in qs] for _, qs in policy.calls] == [["walker", "at-goal"], ["walker"]]
    assert [q.call_index for _, qs in policy.calls for q in qs] == [0, 0, 1]
    renderer = Renderer(empty_room(), CameraConfig(width=16, height=16))
    first = renderer.render(walker.poses[0])
    h0 = policy.calls[0][0][0]
    assert h0.shape == (33, 16, 16, 3) and h0.dtype == np.uint8
    assert all(np.array_equal(f, first) for f in h0)
    h1 = policy.calls[1][0][0]  # 9 frames exist: frame 0 repeated 25 times, then frames 1..8
    assert all(np.array_equal(f, first) for f in h1[:25])
    assert np.array_equal(h1[24:], renderer.render(walker.poses[:9]))


def test_execute_actions_turn_then_move_by_hand():
    occ = empty_room().occupancy()
    acts = np.array([[0.0, 0.0, math.pi / 2, 0], [0.25, 0.0, 0.0, 0], [0.1, 0.1, 0.0, 0], [5.0, 0, 0, 1]])
    out = execute_actions(occ, np.array([2.0, 1.0, 0.0]), acts, robot_radius=0.2)
    # After turning left the robot frame's +x is world +y and +y is world -x.
    np.testing.assert_allclose(out.poses, [[2.0, 1.0, math.pi / 2], [2.0, 1.25, math.pi / 2], [1.9, 1.35, math.pi / 2]])
    assert out.stopped and out.collisions == 0 and len(out.actions) == 3
    assert out.path_length == pytest.approx(0.25 + math.sqrt(0.02))
    with pytest.raises(ValueError, match="NaN"):
        execute_actions(occ, np.zeros(3), np.array([[math.nan, 0, 0, 0]]), 0.2)


def test_rejects_bad_policy_output_and_config():
    class Short(Scripted):
        def _plan(self, pose, goal):
            return np.zeros((4, 4))

    with pytest.raises(ValueError, match="fewer than execute_steps"):
        run(Short("x"), [spec(1.025, 3.025)])
    with pytest.raises(ValueError, match="ClosedLoopConfig.collision"):
        ClosedLoopConfig(collision="bounce")
    with pytest.raises(ValueError, match="ClosedLoopConfig.max_steps"):
        ClosedLoopConfig(max_steps=0)
    with pytest.raises(KeyError, match="scenes that were not given"):
        run_closed_loop(Scripted("stop"), {}, [spec(1.025, 3.025)], progress=False)
    with pytest.raises(ValueError, match="shortest_path_m"):
        spec(1.0, 1.0, shortest=0.0)


def test_episode_spec_round_trip():
    s = spec(1.025, 3.025, seed=7)
    assert EpisodeSpec.from_dict(s.to_dict()) == s


def test_episode_result_round_trip_through_json():
    # The walk of test_walks_straight_to_the_goal_and_stops_there_sr_1, written as a report.json episode and read back.
    (r,) = run(Scripted("straight"), [spec(1.025, 3.025)])
    back = EpisodeResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.metrics() == r.metrics()
    assert back.metrics()["progress"] == pytest.approx(2.0, abs=1e-5)  # 2 m walked straight at the goal
    for name in ("poses", "actions", "blocked", "geodesic"):
        np.testing.assert_array_equal(getattr(back, name), getattr(r, name))
    assert back.blocked.dtype == bool and back.poses.shape == (9, 3)


class Annotating(Scripted):
    """Walks straight at the goal and says something about every second call of each episode."""

    def call_notes(self):
        return [{"saw": q.call_index} if q.call_index % 2 == 0 else None for q in self.calls[-1][1]]


def test_policy_notes_are_kept_with_call_and_step_and_survive_json():
    # 2 m at 0.25 m a step, 3 steps a call: calls at steps 0, 3 and 6, the last one driving 2 steps and then STOPping
    # inside its 3 (3 calls); notes on calls 0 and 2 (steps 0 and 6). A policy without call_notes leaves the field
    # empty and out of the report.
    (r,) = run(Annotating("straight"), [spec(1.025, 3.025)], execute_steps=3)
    assert r.policy_calls == 3 and r.steps == 8
    assert r.policy_notes == [{"call": 0, "step": 0, "saw": 0}, {"call": 2, "step": 6, "saw": 2}]
    back = EpisodeResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.policy_notes == r.policy_notes
    (plain,) = run(Scripted("straight"), [spec(1.025, 3.025)], execute_steps=3)
    assert plain.policy_notes == [] and "policy_notes" not in plain.to_dict()


def test_stop_gate_summary_by_hand():
    from verl_omni.sim.eval_metrics import stop_gate_summary

    # Radius 0.5. Episode a: asked at step 1 (true 2.0 m, let through, gate said 1.0 m) and step 4 (true 0.4 m,
    # refused, gate said 0.9). Episode b: asked at step 0 (true 0.3 m, let through, gate said 0.2); one note that is
    # not a STOP request is ignored. Gate - true: (1.0 - 2.0 + 0.9 - 0.4 + 0.2 - 0.3) / 3 = -0.2.
    note = lambda step, allowed, gate: {"call": 0, "step": step, "stop_asked": True, "stop_allowed": allowed,  # noqa: E731
                                        "gate_visible_logit": 1.0, "gate_distance_m": gate}  # fmt: skip
    a = {"geodesic": [2.5, 2.0, 1.5, 1.0, 0.4], "policy_notes": [note(1, True, 1.0), note(4, False, 0.9)]}
    b = {"geodesic": [0.3], "policy_notes": [note(0, True, 0.2), {"call": 1, "step": 0, "saw": 1}]}
    got = stop_gate_summary([a, b, {"geodesic": [1.0]}], success_radius=0.5)
    assert got == {
        "stop_asked": 3,
        "allowed": 2,
        "allowed_outside_radius": 1,
        "blocked": 1,
        "blocked_inside_radius": 1,
        "allowed_true_m_median": pytest.approx(1.15),
        "allowed_gate_m_median": pytest.approx(0.6),
        "gate_minus_true_m_mean": pytest.approx(-0.2),
    }
    assert stop_gate_summary([{"geodesic": [1.0]}], 0.5) is None
    # With 3 steps executed a call, a STOP asked for at the chunk's step 5 would not have happened: left out.
    late = {"geodesic": [0.2], "policy_notes": [{**note(0, True, 0.1), "stop_step": 5}]}
    assert stop_gate_summary([a, b, late], 0.5, execute_steps=3)["stop_asked"] == 3
    assert stop_gate_summary([a, b, late], 0.5)["stop_asked"] == 4


# --------------------------------------------------------------------------------------------- held-out episodes
def test_heldout_scenes_and_episodes_are_deterministic_and_valid(tmp_path):
    from verl_omni.sim.collector import CollectorConfig
    from verl_omni.sim.heldout import load_scenes, sample_episode_specs, synthesize_heldout_scenes

    fp = FloorPlanConfig(size_m=(6.0, 5.0), max_rooms=3)
    plans = synthesize_heldout_scenes(2, seed=3, config=fp)
    again = synthesize_heldout_scenes(2, seed=3, config=fp)
    assert [p.scene_id for p in plans] == ["h0000", "h0001"]
    assert all(np.array_equal(a.material, b.material) for a, b in zip(plans, again))
    # A different stream than the training synthesizer's SeedSequence([seed, index]).
    train0 = generate_floor_plan(fp, np.random.default_rng(np.random.SeedSequence([3, 0])))
    assert not np.array_equal(train0.material, plans[0].material)

    cfg = CollectorConfig()
    specs = sample_episode_specs(plans, 3, seed=5, config=cfg)
    assert [s.scene_id for s in specs] == ["h0000", "h0001", "h0000"]
    assert specs == sample_episode_specs(plans, 3, seed=5, config=cfg)
    assert specs != sample_episode_specs(plans, 3, seed=6, config=cfg)
    by_id = {p.scene_id: p for p in plans}
    for s in specs:
        occ = by_id[s.scene_id].occupancy()
        assert s.shortest_path_m >= cfg.min_goal_distance_m
        assert float(occ.clearance_at(np.array(s.start_pose[:2]))) >= 0.2
        assert s.goal_object in s.instruction

    for p in plans:
        p.save(tmp_path / p.scene_id)
    loaded = load_scenes([tmp_path])  # a folder of scene folders
    assert list(loaded) == ["h0000", "h0001"]
    assert sample_episode_specs([pl for pl, _ in loaded.values()], 3, seed=5, config=cfg) == specs
    with pytest.raises(ValueError, match="appears twice"):
        load_scenes([tmp_path, tmp_path / "h0000"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a scene"):
        load_scenes([tmp_path / "empty"])


# --------------------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def walking_wnm():
    """The tiny WNM model through its real classes, with an action normalization under which the random DiT
    rarely issues STOP (stop mean -10) and moves about 0.1 m per step, so episodes last several calls."""
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMModel
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig
    from verl_omni.sim.wnm_policy import WNMPolicy

    torch.manual_seed(0)
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, -10.0), std=(0.02, 0.02, 0.05, 1.0))
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)
    return WNMPolicy(
        model, SamplerConfig(num_steps=2, window_size=1), NativeBackendConfig(deterministic=False), name="tiny"
    )


def test_wnm_policy_closed_loop_uses_history_and_episode_noise(walking_wnm):
    from verl_omni.data.convert import history_indices
    from verl_omni.pipelines.wnm_shared import RolloutRequest

    policy = walking_wnm
    plan = empty_room()
    s = spec(1.025, 3.025, "wnm-ep", seed=11)
    cfg = ClosedLoopConfig(max_steps=12)
    (r,) = run_closed_loop(policy, {"empty": plan}, [s], cfg, progress=False)
    assert r.end_reason == "max_steps" and r.steps == 12 and r.policy_calls == 2
    assert np.isfinite(r.ne) and r.path_length > 0
    # Independent replay of the second call: history rendered at the recorded poses (clamped at frame 0), the
    # episode's noise key (seed, call index 1, episode id); its first 4 actions are the ones executed.
    h, w = policy.image_size
    frames = Renderer(plan, CameraConfig(width=w, height=h)).render(r.poses[:9])
    history = torch.from_numpy(frames[history_indices(8, 33)][None])
    ctx = policy.model.encode_context(history, [s.instruction])
    req = RolloutRequest(sample_id="wnm-ep", stratum=0, branch=0, step=1, seed=11, context_row=0)
    replay = policy.backend.generate([req], ctx, ode=True).actions[0].double().numpy()
    np.testing.assert_allclose(r.actions[8:12], replay[:4], rtol=0, atol=1e-6)
    # Another episode seed is another noise stream, hence other actions for the same history.
    other = RolloutRequest(sample_id="wnm-ep", stratum=0, branch=0, step=1, seed=12, context_row=0)
    assert not np.allclose(policy.backend.generate([other], ctx, ode=True).actions[0].double().numpy(), replay)


def test_vote_stop_by_hand():
    from verl_omni.sim.wnm_policy import vote_stop

    # 3 samples, 1 query, 3 steps. Stop channels: step 0 stopped by 1 of 3 samples (no), step 1 by 2 of 3 (yes),
    # step 2 by all. The motion is the first sample's.
    actions = np.zeros((3, 1, 3, 4))
    actions[:, 0, :, 0] = [[0.1, 0.2, 0.3], [9.0, 9.0, 9.0], [8.0, 8.0, 8.0]]
    actions[:, 0, :, 3] = [[0.9, 0.2, 0.7], [0.1, 0.6, 0.8], [0.4, 0.51, 1.0]]
    out = vote_stop(actions)
    np.testing.assert_array_equal(out[0, :, 3], [0.0, 1.0, 1.0])
    np.testing.assert_array_equal(out[0, :, 0], [0.1, 0.2, 0.3])
    # Two samples that disagree: one half is no majority.
    np.testing.assert_array_equal(vote_stop(actions[:2])[0, :, 3], [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(vote_stop(actions[:1]), actions[0])  # one sample: unchanged


def test_wnm_policy_stop_votes_sample_more_strata():
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMModel
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, RolloutRequest, SamplerConfig
    from verl_omni.sim.closed_loop import PolicyQuery
    from verl_omni.sim.wnm_policy import WNMPolicy

    # A random tiny model whose stop channel is centred on the 0.5 threshold, so that samples disagree on STOP.
    torch.manual_seed(0)
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, 0.5), std=(0.02, 0.02, 0.05, 1.0))
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)
    sampler, backend = SamplerConfig(num_steps=2, window_size=1), NativeBackendConfig(deterministic=False)
    policy = WNMPolicy(model, sampler, backend)
    plan = empty_room()
    history = Renderer(plan, CameraConfig(width=32, height=32)).render(np.array([[1.0, 3.0, 0.0]]))
    history = np.repeat(history[None], 33, axis=1)
    query = PolicyQuery("ep", 11, 2, "go to the chair", np.zeros(3), np.zeros(2), "empty")
    single = policy.act(history, [query])
    voted = WNMPolicy(model, sampler, backend, stop_votes=3).act(history, [query])
    # The motion of vote 0 is the single sample's (batched with the other votes: equal up to float rounding).
    np.testing.assert_allclose(voted[..., :3], single[..., :3], rtol=0, atol=1e-5)
    # Independent recomputation of the three votes: strata 0, 1, 2 of the same call.
    ctx = model.encode_context(torch.from_numpy(history), [query.instruction])
    reqs = [RolloutRequest(sample_id="ep", stratum=v, branch=0, step=2, seed=11) for v in range(3)]
    stops = policy.backend.generate(reqs, ctx, ode=True).actions[..., 3].double().numpy() > 0.5  # [3, S]
    assert (stops.any(0) & ~stops.all(0)).any()  # the samples disagree on some steps: the vote decides there
    np.testing.assert_array_equal(voted[0, :, 3], (stops.sum(0) >= 2).astype(float))
    np.testing.assert_array_equal(single[0, :, 3] > 0.5, stops[0])  # one vote: the first sample's own flags
    with pytest.raises(ValueError, match="stop_votes"):
        WNMPolicy(model, stop_votes=0)


def test_wnm_policy_stop_gate_vetoes_or_passes_stop():
    from verl_omni.data.actions import ActionNormalization
    from verl_omni.models.wnm import WNMConfig, WNMModel
    from verl_omni.models.wnm.goal_probe import ObjectViewProbe
    from verl_omni.models.wnm.stop_gate import StopGate
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig
    from verl_omni.sim.closed_loop import PolicyQuery
    from verl_omni.sim.wnm_policy import WNMPolicy

    torch.manual_seed(0)
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, 0.5), std=(0.02, 0.02, 0.05, 1.0))
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)
    sampler, backend = SamplerConfig(num_steps=2, window_size=1), NativeBackendConfig(deterministic=False)

    def gate(logit: float) -> StopGate:
        """A head that answers the same for every input: the last layer's weights 0, its bias (logit, 1, 0, 0)."""
        head = ObjectViewProbe(model.config.dim)
        with torch.no_grad():
            head.net[-1].weight.zero_()
            head.net[-1].bias.copy_(torch.tensor([logit, 1.0, 0.0, 0.0]))
        return StopGate(head, stop_distance_m=0.5)

    history = Renderer(empty_room(), CameraConfig(width=32, height=32)).render(np.array([[1.0, 3.0, 0.0]]))
    history = np.repeat(history[None], 33, axis=1)
    queries = [PolicyQuery(f"ep{i}", 11 + i, 2, "go to the chair", np.zeros(3), np.zeros(2), "empty") for i in range(6)]
    plain = WNMPolicy(model, sampler, backend, stop_votes=3).act(np.repeat(history, 6, 0), queries)
    assert (plain[..., 3] > 0.5).any()  # some query's chunk stops: the gate has something to decide
    # Object seen at 0 m: every STOP passes, the chunks are the ungated ones.
    passed = WNMPolicy(model, sampler, backend, stop_votes=3, stop_gate=gate(10.0)).act(
        np.repeat(history, 6, 0), queries
    )
    np.testing.assert_array_equal(passed, plain)
    # Object never seen: no chunk stops; chunks without STOP are untouched.
    vetoed = WNMPolicy(model, sampler, backend, stop_votes=3, stop_gate=gate(-10.0)).act(
        np.repeat(history, 6, 0), queries
    )
    assert not (vetoed[..., 3] > 0.5).any()
    calm = ~(plain[..., 3] > 0.5).any(-1)
    np.testing.assert_array_equal(vetoed[calm], plain[calm])
    # The policy's notes name each query whose chunk asked for a STOP in the gate's window (8 steps) and what the
    # gate saw there: the head's constant answer (logit, distance 0 m) and its verdict.
    asked = (plain[:, :8, 3] > 0.5).any(-1)
    for logit in (10.0, -10.0):
        policy = WNMPolicy(model, sampler, backend, stop_votes=3, stop_gate=gate(logit))
        policy.act(np.repeat(history, 6, 0), queries)
        notes = policy.call_notes()
        assert [n is not None for n in notes] == asked.tolist()
        for row, n in enumerate(notes):
            if n is None:
                continue
            assert n.pop("stop_step") == int((plain[row, :8, 3] > 0.5).argmax())
            assert n == {"stop_asked": True, "stop_allowed": logit > 0, "gate_visible_logit": pytest.approx(logit),
                         "gate_distance_m": pytest.approx(0.0)}  # fmt: skip
    assert WNMPolicy(model, sampler, backend, stop_votes=3).call_notes() is None
