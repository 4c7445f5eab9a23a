"""The locked reward set ranks behaviour like the closed-loop evaluator, on real (synthesized) query states.

A small GN0 collection is synthesized with the user command's code; its recorded query states are scored with
the real reward registry and the recipe's locked reward set. The evaluator prefers following the expert, then
imitating it badly (it still makes progress and may still arrive), then standing still (no progress, but the
episode goes on), then stopping at once (the episode is over and failed); the mean summed reward must agree.
"""

import numpy as np
import pytest
import yaml
from reward_helpers import (
    REPO,
    centre,
    make_batch,
    make_reward_set,
    straight_actions,
    synthesize_collection,
    walled_room,
)

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.utils.reward_score import build_reward_set
from verl_omni.utils.reward_score.ranking import (
    POLICIES,
    WINDOW_METRICS,
    load_query_states,
    policy_actions,
    rank_policies,
    short_stop_preference,
    window_metrics,
)
from verl_omni.utils.reward_score.trajectory import compute_geometry

LOCKED = REPO / "recipes" / "wnm_3d" / "stage3" / "config" / "locked.yaml"


@pytest.fixture(scope="module")
def locked_cfg_and_states(tmp_path_factory):
    """The locked reward-set config (pointing at the collection's scenes) and the collection's query states."""
    collection, occupancy = synthesize_collection(
        tmp_path_factory.mktemp("ranking"), num_scenes=3, episodes_per_scene=3
    )
    cfg = dict(yaml.safe_load(LOCKED.read_text())["reward"]["reward_set"])
    cfg["occupancy_root"] = str(occupancy)
    return cfg, load_query_states(collection)


@pytest.fixture(scope="module")
def scored(locked_cfg_and_states):
    cfg, states = locked_cfg_and_states
    return build_reward_set(cfg), states


def test_mean_summed_reward_orders_expert_noisy_still_stop(scored):
    reward_set, states = scored
    assert states.size >= 40  # real query states, all four events among them
    assert {e for ev in states.events for e in ev} >= {"collision_precursor", "required_stop"}
    for seed in (0, 1):
        table = rank_policies(reward_set, states, POLICIES, heading_noise_rad=0.25, seed=seed)
        totals = [table[p]["total"] for p in POLICIES]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, (seed, totals)
    # The evaluator's metrics of the same windows come beside the reward: the expert arrives more often than its noisy
    # imitator, standing still neither moves nor stops early, and every STOP at once outside the radius is premature.
    assert set(WINDOW_METRICS) <= set(table["expert"])
    assert table["expert"]["SR"] > table["noisy_imitator"]["SR"] and table["expert"]["collided"] < 0.05
    assert table["stand_still"]["path_length"] == 0 and table["stand_still"]["premature_stop"] == 0
    stop = table["stop_at_once"]
    assert stop["path_length"] == 0 and stop["SR"] + stop["premature_stop"] == pytest.approx(1.0)


def test_expert_pays_no_guard_for_its_own_motion(scored):
    # The expert's turns (up to 30 degrees a step, some in place) trip neither the rate nor the reference-heading
    # guard, and it makes exactly the progress it is compared with.
    reward_set, states = scored
    out = reward_set.score(_batch(states, policy_actions(states, "expert")))
    assert np.all(out.diagnostics["yaw/rate"] == 0) and np.all(out.diagnostics["yaw/reference"] == 0)
    active = out.diagnostics["navigation/missed"] != 0
    np.testing.assert_allclose(
        out.diagnostics["navigation/progress"][active], out.diagnostics["navigation/missed"][active], atol=1e-5
    )


def test_stop_at_once_lands_everything_on_stop_1_and_masks_the_rest(scored):
    reward_set, states = scored
    out = reward_set.score(_batch(states, policy_actions(states, "stop_at_once")))
    live = out.layer_valid
    np.testing.assert_array_equal(live, np.tile([1, 0, 0, 0, 0, 1, 0, 0, 0], (states.size, 1)).astype(bool))
    for layer in LAYER_NAMES:
        if layer not in ("visual", "stop_1"):
            assert np.all(out.scores[layer] == 0), layer
    # What a premature STOP at step 0 forfeits is exactly what standing still is charged as missed progress (the
    # expert's whole gain over the horizon), so the two differ by the STOP terms alone.
    still = reward_set.score(_batch(states, policy_actions(states, "stand_still")))
    premature = out.diagnostics["stop/premature"][:, 0] > 0
    assert premature.sum() > 10
    forfeit = out.diagnostics["navigation/forfeit"].sum(axis=1)
    missed = still.diagnostics["navigation/missed"].sum(axis=1)
    np.testing.assert_allclose(forfeit[premature], np.maximum(missed[premature], 0.0), atol=1e-5)
    assert np.all(out.diagnostics["navigation/forfeit"][~premature] == 0)


def _batch(states, actions):
    from verl_omni.utils.reward_score import RewardBatch

    return RewardBatch(
        actions=actions,
        start_pose=states.reference_poses[:, 0],
        reference_poses=states.reference_poses,
        goal=states.goal,
        success_radius=states.success_radius,
        events=states.events,
        scene_id=states.scene_id,
        rollout_id=states.query_id,
    )


def test_window_metrics_read_a_window_as_the_evaluator_reads_an_episode():
    # Corridor row 5 of an 11 x 60 room (0.1 m cells), start at column 10, goal at column 42: l = 3.2 m, rho = 0.5.
    #   0 drives 30 steps of 0.1 m and STOPs at column 40 (G = 0.2): SR 1, OSR 1, p = 3.0,
    #     SPL = 3.2 / max(3.0, 3.2) = 1.
    #   1 drives 10 steps and STOPs at column 20 (G = 2.2 > rho): premature, OSR 0, p = 1.0.
    #   2 stands still and never STOPs: nothing, p = 0.
    #   3 drives 32 steps without a STOP and ends on the goal (G = 0 at column 42): OSR 1 but SR 0, p = 3.2.
    #   4 (a second room with a wall in column 30, rows 1..8, open at row 9) drives 32 steps: step 17 (column 27 -> 28,
    #     clearance 0.15 < R = 0.2) collides, so the window ends at pose 17: collided, p = 1.7.
    room = walled_room(11, 60)
    wall = room.copy()
    wall[1:9, 30] = True
    rs = make_reward_set({"room": room, "wall": wall}, {"stop": {}})
    actions = np.concatenate(
        [
            straight_actions(30, dx=0.1, stop_at=30),
            straight_actions(10, dx=0.1, stop_at=10),
            straight_actions(0),
            straight_actions(32, dx=0.1),
            straight_actions(32, dx=0.1),
        ]
    )
    start = (*centre(5, 10), 0.0)
    batch = make_batch(actions, start, centre(5, 42), scene_id=["room"] * 4 + ["wall"])
    geometry = compute_geometry(batch, rs.scene_cache, rs.geometry_config)
    got = window_metrics(geometry, batch.success_radius)
    np.testing.assert_array_equal(got["SR"], [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(got["OSR"], [1, 0, 0, 1, 0])
    np.testing.assert_array_equal(got["premature_stop"], [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(got["collided"], [0, 0, 0, 0, 1])
    np.testing.assert_allclose(got["path_length"], [3.0, 1.0, 0.0, 3.2, 1.7], atol=1e-9)
    np.testing.assert_allclose(got["SPL"], [1.0, 0, 0, 0, 0], atol=1e-6)


def test_charge_stop_chunk_stops_crediting_a_short_stops_motion_on_real_query_states(scored):
    # On the recorded query states whose expert drives on for at least 12 steps: the noisy imitator STOPping at step
    # 3 (motion zeroed after it, as the SFT data pads it) against the same imitator driving on. Without the option
    # nav_1 credits the STOP-er's 3 steps against its sibling's 8 and prefers it in most states; with it, the
    # STOP-er stands still for steps 3..7 and is preferred in a minority only (the sibling's collisions in
    # chunk 1 remain worse than standing still, as the evaluator's order says).
    reward_set, states = scored
    keep = states.reference_stop[:, :12].sum(axis=1) == 0
    assert keep.sum() >= 20
    drive = policy_actions(states, "noisy_imitator", heading_noise_rad=0.25, seed=0)
    short = drive.copy()
    short[:, 3:, :3] = 0.0
    short[:, 3:, 3] = 1.0
    cfg = dict(yaml.safe_load(LOCKED.read_text())["reward"]["reward_set"])
    fractions = {}
    for charge in (False, True):
        rewards = dict(cfg["rewards"])
        rewards["navigation"] = dict(rewards["navigation"], charge_stop_chunk=charge)
        rs = build_reward_set({**cfg, "rewards": rewards}, scene_cache=reward_set.scene_cache)
        nav_drive = rs.score(_batch(states, drive)).scores["nav_1"][keep]
        nav_short = rs.score(_batch(states, short)).scores["nav_1"][keep]
        fractions[charge] = float(np.mean(nav_short > nav_drive + 1e-9))
        # The report's helper (scripts/reward_ranking.py) builds the same pair; this construction checks it.
        helper = short_stop_preference(rs, states, 3, heading_noise_rad=0.25, seed=0)
        assert helper["states"] == keep.sum() and helper["fraction"] == fractions[charge]
        assert helper["mean_gap"] == pytest.approx(float(np.mean(nav_short - nav_drive)), rel=1e-9)
    assert fractions[False] > 0.5 > fractions[True], fractions


def test_order_by_distance_near_the_goal(locked_cfg_and_states):
    """Band by band, where STOP at once is premature. The STOP's own layer always ranks it below standing still.
    In the summed reward, near the goal the recipe lets a STOP out-score standing still in many states (the
    evaluator: in none); charging every premature STOP the missed-STOP penalty first (premature_base) cuts that
    share in every band and restores the evaluator's order of the band means wherever a band holds enough states."""
    from verl_omni.utils.reward_score.ranking import PREMATURE_BANDS, order_by_distance

    cfg, states = locked_cfg_and_states
    recipe = order_by_distance(build_reward_set(cfg), states)
    assert [(r["lo"], r["hi"]) for r in recipe] == list(PREMATURE_BANDS)
    assert all(r["states"] > 0 for r in recipe) and sum(r["states"] for r in recipe) <= states.size
    assert all(r["stop_1_over_stand_still"] == 0.0 for r in recipe)
    stop = {**cfg["rewards"]["stop"], "premature_base": 1.0, "premature_cap": 3.0}
    based = order_by_distance(build_reward_set({**cfg, "rewards": {**cfg["rewards"], "stop": stop}}), states)

    def near_share(rows):  # STOP over stand still, pooled over the bands within 1.5 m of the radius
        near = [r for r in rows if r["hi"] <= 1.5]
        return sum(r["stop_over_stand_still"] * r["states"] for r in near) / sum(r["states"] for r in near)

    assert near_share(recipe) > 0.3  # the recipe's near-goal misranking shows on these states too
    assert near_share(based) < near_share(recipe) / 2
    for a, b in zip(recipe, based, strict=True):
        assert b["stop_over_stand_still"] <= a["stop_over_stand_still"]
        if b["states"] >= 15:
            means = [b[p] for p in POLICIES]
            assert means == sorted(means, reverse=True), b


def test_short_stop_against_missed_on_real_query_states(locked_cfg_and_states):
    """Where the expert STOPs inside the window, its path STOPped 2 steps early ends outside the radius. In sum the
    recipe ranks that short STOP below never STOPping in most states (the nav layers charge what it forfeits); on
    the STOP layers alone it can rank it above: there the short STOP pays 0.5 x G (+0.5 at a near-goal state) and
    no STOP pays the missed-STOP 1.0. With premature_base 1.0 the short STOP pays at least 1.0 + 0.5 x G > 1.0, so
    by hand it can never out-score no STOP on the STOP layers."""
    from verl_omni.utils.reward_score.ranking import short_stop_against_missed

    cfg, states = locked_cfg_and_states
    recipe = short_stop_against_missed(build_reward_set(cfg), states, early_steps=2)
    near = recipe[0]
    assert (near["lo"], near["hi"]) == (0.0, 0.5) and near["states"] >= 5
    assert near["expert"] > near["no_stop"] > near["short"]  # the band means in the evaluator's order
    assert near["short_over_no_stop"] < 0.5  # in most states (121 states, 40 scenes: 96%; docs/results.md)
    stop = {**cfg["rewards"]["stop"], "premature_base": 1.0, "premature_cap": 3.0}
    based = short_stop_against_missed(
        build_reward_set({**cfg, "rewards": {**cfg["rewards"], "stop": stop}}), states, early_steps=2
    )
    assert [r["states"] for r in based] == [r["states"] for r in recipe]
    for r in based:
        if r["states"]:
            assert r["short_over_no_stop_stop_layers"] == 0.0 and r["short_over_no_stop"] == 0.0
    with pytest.raises(ValueError, match="early_steps"):
        short_stop_against_missed(build_reward_set(cfg), states, early_steps=0)


def test_report_refuses_bad_flags_before_any_work():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "reward_ranking.py"
    for flags, needle in ((["--early-steps", "0"], "--early-steps"), (["--num-scenes", "0"], "--num-scenes"),
                          (["--collection", "c"], "--occupancy-root")):  # fmt: skip
        proc = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
