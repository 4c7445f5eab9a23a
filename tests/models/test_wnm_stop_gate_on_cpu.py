"""The STOP gate: its fitted distance, its rule, its choice of chunk, and its place in a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import CheckpointError, WNMConfig, WNMModel, load_wnm_checkpoint, save_wnm_checkpoint
from verl_omni.models.wnm.checkpoint import derive_checkpoint
from verl_omni.models.wnm.goal_probe import ObjectViewProbe
from verl_omni.models.wnm.stop_gate import (
    FIT_LABELS,
    FIT_PREDICTIONS,
    StopGate,
    calibrate_stop_distance,
    fit_stop_distance,
    gate_stop,
    load_stop_gate,
    stop_allowed,
)


def _rows(stop_now, visible, distance_m):
    """Expert chunks ``[N, 4, 4]`` (stop channel at step 0 as given) and their view targets ``[N, 4]``."""
    n = len(stop_now)
    actions = torch.zeros(n, 4, 4)
    actions[:, 0, 3] = torch.tensor(stop_now, dtype=torch.float32)
    view = torch.zeros(n, 4)
    view[:, 0] = torch.tensor(visible, dtype=torch.float32)
    view[:, 3] = torch.tensor(distance_m, dtype=torch.float32) / 4.0  # the head regresses d / 4 m
    return actions, view


def test_fit_stop_distance_is_a_quantile_over_visible_stop_states():
    # STOP now with the object in view at 0.4, 0.8, 1.2 m; a STOP out of view (3 m) and a visible non-STOP
    # (0.2 m) do not count. Median 0.8 m, maximum 1.2 m; the 0.25 quantile interpolates 0.4 .. 0.8 -> 0.6 m.
    actions, view = _rows([1, 1, 1, 1, 0], [1, 1, 1, 0, 1], [0.8, 0.4, 1.2, 3.0, 0.2])
    assert fit_stop_distance(actions, view, 0.5) == pytest.approx(0.8, abs=1e-6)
    assert fit_stop_distance(actions, view, 1.0) == pytest.approx(1.2, abs=1e-6)
    assert fit_stop_distance(actions, view, 0.25) == pytest.approx(0.6, abs=1e-6)
    # A chunk that stops at step 3 counts within 4 steps, not within 2.
    late, view_late = _rows([0, 0], [1, 1], [0.5, 0.7])
    late[1, 3, 3] = 1.0
    assert fit_stop_distance(late, view_late, 1.0, within_steps=4) == pytest.approx(0.7, abs=1e-6)
    with pytest.raises(ValueError):
        fit_stop_distance(late, view_late, 1.0, within_steps=2)
    no_visible_stop, view2 = _rows([1, 0], [0, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="face-goal-object"):
        fit_stop_distance(no_visible_stop, view2)


def test_calibrated_distance_is_a_quantile_of_predictions_at_the_goal_by_hand():
    # Six states: geodesic 0.3 / 0.5 / 0.45 m are within the 0.5 m radius (0.5 counts), 0.6 and 2.0 m are not;
    # the 0.45 m state does not see the object (logit -1). Counted predictions: 0.9, 1.3 (and not 1.0, 2.5, 0.2).
    predicted = [0.9, 1.3, 1.0, 2.5, 0.2]
    logit = [2.0, 0.5, -1.0, 3.0, 1.0]
    geodesic = [0.3, 0.5, 0.45, 0.6, 2.0]
    assert calibrate_stop_distance(predicted, logit, geodesic, 0.5, 1.0) == pytest.approx(1.3)
    assert calibrate_stop_distance(predicted, logit, geodesic, 0.5, 0.5) == pytest.approx(1.1)  # midway 0.9..1.3
    # A per-state radius: with 0.7 m for the fourth state its 2.5 m prediction counts too -> max 2.5.
    assert calibrate_stop_distance(predicted, logit, geodesic, [0.5, 0.5, 0.5, 0.7, 0.5], 1.0) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="no state within the success radius"):
        calibrate_stop_distance(predicted, logit, geodesic, 0.1)
    with pytest.raises(ValueError, match="quantile"):
        calibrate_stop_distance(predicted, logit, geodesic, 0.5, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        calibrate_stop_distance(predicted[:2], logit, geodesic, 0.5)


def test_derived_checkpoint_replaces_named_files_and_copies_the_rest_bit_for_bit(tmp_path):
    model = _tiny_model()
    gate = StopGate(ObjectViewProbe(model.config.dim), stop_distance_m=1.9)
    src = save_wnm_checkpoint(model, tmp_path / "src", {"round": 0}, readme="card\n", stop_gate=gate)
    config = json.loads((src / "stop_gate" / "config.json").read_text())
    assert config["fitted_on"] == FIT_LABELS
    config.update(stop_distance_m=1.25, fitted_on=FIT_PREDICTIONS)
    new = {"stop_gate/config.json": json.dumps(config).encode(), "README.md": b"card\nmore\n"}
    out = derive_checkpoint(src, tmp_path / "out", new, {"stop_gate_calibration": {"quantile": 0.9}})
    loaded = load_stop_gate(out)
    assert loaded.stop_distance_m == 1.25 and loaded.fitted_on == FIT_PREDICTIONS
    assert (out / "README.md").read_text() == "card\nmore\n"
    src_files = json.loads((src / "checkpoint_manifest.json").read_text())["files"]
    manifest = json.loads((out / "checkpoint_manifest.json").read_text())
    assert set(manifest["files"]) == set(src_files)
    for name, entry in src_files.items():
        assert (manifest["files"][name] == entry) == (name not in new), name
        if name not in new:
            assert (out / name).read_bytes() == (src / name).read_bytes()
    prov = manifest["provenance"]
    assert prov["round"] == 0 and prov["stop_gate_calibration"] == {"quantile": 0.9}
    assert len(prov["derived_from"]["manifest_sha256"]) == 64
    load_wnm_checkpoint(out)  # every file verifies against the new manifest
    # Never overwrites, never adds files, and refuses a source that fails its sha256.
    with pytest.raises(FileExistsError):
        derive_checkpoint(src, out, {}, {})
    with pytest.raises(CheckpointError, match="not files of this checkpoint"):
        derive_checkpoint(src, tmp_path / "o2", {"extra.json": b"{}"}, {})
    (src / "README.md").write_text("tampered")
    with pytest.raises(CheckpointError, match="sha256"):
        derive_checkpoint(src, tmp_path / "o3", {}, {})
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_stop_allowed_by_hand():
    # (logit, cos, sin, d / 4): seen at 0.4 m, seen at 2 m, unseen at 0.4 m, seen exactly at the limit 0.8 m.
    pred = torch.tensor([[2.0, 1, 0, 0.1], [2.0, 1, 0, 0.5], [-1.0, 1, 0, 0.1], [0.5, 1, 0, 0.2]])
    assert stop_allowed(pred, 0.8).tolist() == [True, False, False, True]


def test_gate_stop_keeps_allowed_stops_and_drives_on_otherwise():
    # 3 samples x 4 queries x 2 steps. Motion channel 0 tells the samples apart (sample v has value 10 * v + b).
    actions = np.zeros((3, 4, 2, 4))
    for v in range(3):
        for b in range(4):
            actions[v, b, :, 0] = 10 * v + b
    actions[0, :3, 1, 3] = 1.0  # sample 0 stops at step 1 for queries 0, 1, 2
    actions[1, 1, 0, 3] = 1.0  # query 1: sample 1 stops too, sample 2 does not
    actions[1:, 2, :, 3] = 0.8  # query 2: every sample stops
    allowed = np.array([True, False, False, False])
    out = gate_stop(actions, allowed)
    np.testing.assert_array_equal(out[0], actions[0, 0])  # allowed: unchanged, STOP kept
    np.testing.assert_array_equal(out[1], actions[2, 1])  # vetoed: the first non-stopping sample (2) drives on
    np.testing.assert_array_equal(out[2, :, 0], [2.0, 2.0])  # vetoed, none drives: sample 0's motion ...
    np.testing.assert_array_equal(out[2, :, 3], [0.0, 0.0])  # ... without its STOP
    np.testing.assert_array_equal(out[3], actions[0, 3])  # no STOP asked for: unchanged
    # Only the executed steps count: with a window of 1 step, sample 0's STOPs (at step 1) are not asked for, and
    # query 1's sample 1 (STOP at step 0) is no fallback; nothing changes.
    np.testing.assert_array_equal(gate_stop(actions, allowed, within_steps=1), actions[0])
    single = gate_stop(actions[:1], allowed)  # one sample: a vetoed STOP is only cleared
    np.testing.assert_array_equal(single[1, :, 3], [0.0, 0.0])
    np.testing.assert_array_equal(single[0], actions[0, 0])


def _tiny_model() -> WNMModel:
    torch.manual_seed(0)
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, 0.5), std=(0.02, 0.02, 0.05, 1.0))
    return WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)


def test_checkpoint_round_trip_of_the_gate(tmp_path):
    model = _tiny_model()
    head = ObjectViewProbe(model.config.dim)
    gate = StopGate(head, stop_distance_m=0.73, quantile=0.9, within_steps=6)
    ckpt = save_wnm_checkpoint(model, tmp_path / "with_gate", {"test": "gate"}, stop_gate=gate)
    manifest = json.loads((ckpt / "checkpoint_manifest.json").read_text())
    assert {"stop_gate/config.json", "stop_gate/model.safetensors"} <= set(manifest["files"])
    loaded = load_stop_gate(ckpt)
    assert loaded.stop_distance_m == pytest.approx(0.73) and loaded.quantile == pytest.approx(0.9)
    assert loaded.within_steps == 6
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.head.state_dict()[k], v, rtol=0, atol=0)
    load_wnm_checkpoint(ckpt)  # the model loads as before: the gate is one more verified folder
    # A checkpoint without the gate has none, and asking the policy for one names the folder and the flag.
    plain = save_wnm_checkpoint(model, tmp_path / "plain", {"test": "plain"})
    assert load_stop_gate(plain) is None
    from verl_omni.sim.wnm_policy import WNMPolicy

    with pytest.raises(CheckpointError, match="stop_gate.*--view-aux-weight"):
        WNMPolicy.from_checkpoint(plain, stop_gate=True)
    # The fitted distance can be replaced at evaluation time (the saved one stays).
    assert WNMPolicy.from_checkpoint(ckpt, stop_gate=True, stop_gate_distance_m=1.5).stop_gate.stop_distance_m == 1.5
    with pytest.raises(ValueError, match="stop_gate_distance_m"):
        WNMPolicy.from_checkpoint(ckpt, stop_gate=True, stop_gate_distance_m=0.0)
    # Tampered weights fail their sha256 before anything is read.
    weights = ckpt / "stop_gate" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(CheckpointError, match="sha256"):
        load_stop_gate(ckpt)


def test_gate_prediction_is_one_forward_at_pure_noise_per_query_seed():
    model = _tiny_model().eval()
    gate = StopGate(ObjectViewProbe(model.config.dim).eval(), stop_distance_m=1.0)
    frames = torch.randint(0, 255, (2, 33, 32, 32, 3), dtype=torch.uint8)
    ctx = model.encode_context(frames, ["go to the chair", "go to the bed"])
    both = gate.predict(model.transformer, ctx, [7, 8])
    assert both.shape == (2, 4)
    # Query 1 alone with its seed gives its batched answer: the noise is per query, not per batch.
    ctx1 = model.encode_context(frames[1:], ["go to the bed"])
    torch.testing.assert_close(gate.predict(model.transformer, ctx1, [8])[0], both[1], rtol=1e-4, atol=1e-5)
    # Independent recomputation: the head on the action tokens of one transformer call at sigma = 1.
    g = torch.Generator().manual_seed(8)
    video = torch.randn(model.config.target_latent_shape, generator=g)[None]
    action = torch.randn((32, 4), generator=g)[None]
    with gate.head.attached(model.transformer):
        model.transformer(video, action, torch.ones(1), ctx1)
        expected = gate.head.net(gate.head._hidden.float().mean(1))
    torch.testing.assert_close(both[1:], expected, rtol=1e-4, atol=1e-5)
