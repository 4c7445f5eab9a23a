"""Reward registry: construction-time validation, bad-input handling and the scene/goal cache."""

import numpy as np
import pytest
import scipy.ndimage
import scipy.sparse.csgraph
from reward_helpers import RES, centre, make_batch, make_reward_set, straight_actions, walled_room

from verl_omni.data.occupancy import OccupancyMap
from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.utils.reward_score import build_reward_set, registered_rewards

ALL = {"navigation": {}, "collision": {}, "yaw": {}, "stop": {}, "vision": {}, "flow": {"weight": 0.0}}


def test_builtin_rewards_are_registered_and_default_recipe_builds():
    rs = build_reward_set({"rewards": ALL})
    assert {"navigation", "collision", "yaw", "stop", "vision", "flow"} <= set(registered_rewards())
    assert [m.name for m in rs.active_modules] == ["navigation", "collision", "yaw", "stop", "vision"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rewards": {"navigaton": {}}}, "unknown reward name(s) ['navigaton']"),
        ({"robot_radius": -0.1, "rewards": {"stop": {}}}, "robot_radius must be a finite number > 0"),
        ({"rewards": {"stop": {"premature_cap": -1.0}}}, "premature_cap must be a finite number >= 0"),
        ({"rewards": {"stop": {"weight": -1.0}}}, "weight must be a finite number >= 0"),
        ({"rewards": {"stop": {"premature_scal": 1.0}}}, "unknown option(s) ['premature_scal']"),
        ({"rewards": {"vision": {"metric": "lpips"}}}, "vision.metric must be one of"),
        ({"robot_radius": 0.5, "rewards": {"collision": {"safety_clearance_m": 0.4}}}, "must exceed robot_radius"),
        ({"rewards": {}}, "'rewards' must be a non-empty mapping"),
        ({"rewards": {"stop": {}}, "invalid_penalty": 1.0}, "invalid_penalty must be a finite number <= 0"),
        ({"rewards": {"stop": {}}, "robot_radios": 0.2}, "unknown option(s) ['robot_radios']"),
    ],
)
def test_misconfiguration_fails_at_construction_with_clear_message(config, message):
    with pytest.raises(ValueError) as err:
        build_reward_set(config)
    assert message in str(err.value)


def test_flow_with_weight_needs_opencv_at_construction():
    try:
        import cv2  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="OpenCV is not installed"):
            build_reward_set({"rewards": {"flow": {"weight": 0.1}}})
    else:
        assert build_reward_set({"rewards": {"flow": {"weight": 0.1}}}).active_modules[0].name == "flow"


def test_bad_inputs_get_finite_penalties_and_named_warnings():
    occ = walled_room(11, 60)
    rs = make_reward_set({"room": occ}, ALL, invalid_penalty=-7.0)
    x0, y0 = centre(5, 10)
    actions = np.repeat(straight_actions(10, dx=0.1), 6, axis=0)
    actions[1, 3, 0] = np.nan
    actions[2, 5, 2] = np.inf
    starts = np.tile([x0, y0, 0.0], (6, 1))
    starts[4] = [-3.0, -3.0, 0.0]  # outside the map
    # Rollout 5 drives off the map's +y edge: its first step is already a contact (the border counts as blocked).
    starts[5] = [*centre(9, 30), np.pi / 2]
    actions[5, :, 0] = 0.3
    ids = ["ok", "nan_action", "inf_action", "unknown_scene", "off_map_start", "drives_off"]
    latents = np.zeros((6, 2, 3, 4), np.float32)
    bad_latents = latents.copy()
    bad_latents[0, 0, 0, 0] = np.nan
    batch = make_batch(
        actions,
        starts,
        centre(5, 40),
        scene_id=["room", "room", "room", "nowhere", "room", "room"],
        ids=ids,
        generated_latents=bad_latents,
        target_latents=latents,
    )
    out = rs.score(batch)
    assert out.as_matrix().shape == (6, len(LAYER_NAMES)) and np.isfinite(out.as_matrix()).all()
    for i in (1, 2, 3, 4):
        for layer in LAYER_NAMES[1:]:
            assert out.scores[layer][i] == -7.0, (ids[i], layer)
        assert any(w.startswith(f"rollout {ids[i]}: invalid") for w in out.warnings), ids[i]
    assert "unknown scene id 'nowhere'" in " ".join(out.warnings)
    assert out.diagnostics["geometry/valid"].tolist() == [1, 0, 0, 0, 0, 1]
    # Driving off the map is a hard collision in chunk 1, with a warning naming the rollout.
    assert out.diagnostics["collision/hard"][5].tolist() == [1, 0, 0, 0]
    assert out.diagnostics["geometry/collision_step"][5] == 0
    # Rollout "ok" is scored normally; its non-finite latent makes only its visual score invalid.
    assert out.scores["nav_1"][0] > 0
    assert out.scores["visual"][0] == -7.0 and any(w.startswith("rollout ok: non-finite visual") for w in out.warnings)


def test_scene_and_geodesic_fields_are_computed_once_for_1024_rollouts(tmp_path, monkeypatch):
    # Two scenes on disk, 64 prompts (32 per scene, each with its own goal) x 16 rollouts = 1024 rollouts.
    for name in ("sa", "sb"):
        OccupancyMap.from_grid(walled_room(21, 70), RES, (0.0, 0.0), scene_id=name).save(tmp_path / name)
    calls = {"dijkstra": 0, "edt": 0, "load": 0}
    real_dijkstra, real_edt, real_load = (
        scipy.sparse.csgraph.dijkstra,
        scipy.ndimage.distance_transform_edt,
        OccupancyMap.load.__func__,
    )

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(scipy.sparse.csgraph, "dijkstra", counting("dijkstra", real_dijkstra))
    monkeypatch.setattr(scipy.ndimage, "distance_transform_edt", counting("edt", real_edt))
    monkeypatch.setattr(OccupancyMap, "load", classmethod(counting("load", real_load)))
    rs = build_reward_set({"occupancy_root": str(tmp_path), "rewards": ALL})
    n = 1024
    prompt = np.arange(n) // 16
    rng = np.random.default_rng(0)
    actions = np.zeros((n, 32, 4))
    actions[..., 0] = rng.uniform(0.0, 0.08, (n, 32))
    actions[..., 2] = rng.normal(0.0, 0.05, (n, 32))
    goals = np.stack([np.array([centre(10, 30 + p % 32)]) for p in prompt])[:, 0]
    batch = make_batch(
        actions, np.tile([*centre(10, 5), 0.0], (n, 1)), goals, scene_id=["sa" if p < 32 else "sb" for p in prompt]
    )
    first = rs.score(batch)
    second = rs.score(batch)
    assert calls == {"dijkstra": 64, "edt": 2, "load": 2}
    for layer in LAYER_NAMES:
        np.testing.assert_array_equal(first.scores[layer], second.scores[layer])
    assert [w for w in first.warnings if w.startswith("rollout")] == []
