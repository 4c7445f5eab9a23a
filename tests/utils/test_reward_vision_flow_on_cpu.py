"""Vision metrics against hand values and an independent float64 SSIM (scipy), and the flow consistency math."""

import math

import numpy as np
import pytest
import torch
from reward_helpers import centre, make_batch, make_reward_set, straight_actions, walled_room
from scipy.signal import convolve2d

from verl_omni.utils.reward_score.flow import ego_motion, flow_motion_errors
from verl_omni.utils.reward_score.vision import latent_mse, psnr, ssim


def _batch(n=2, **extra):
    return make_batch(np.repeat(straight_actions(0), n, axis=0), (*centre(5, 5), 0.0), centre(5, 8), **extra)


def test_latent_mse_reward_is_negative_mse():
    gen = torch.zeros(2, 4, 3, 2, 2)
    gen[0] = 2.0  # every dimension off by 2 -> MSE 4
    gen[1, 0] = 1.0  # a quarter of the dimensions off by 1 -> MSE 0.25
    rs = make_reward_set({"room": walled_room(11, 11)}, {"vision": {}})
    out = rs.score(_batch(generated_latents=gen, target_latents=torch.zeros_like(gen)))
    np.testing.assert_allclose(out.scores["visual"], [-4.0, -0.25], rtol=1e-6)
    np.testing.assert_allclose(latent_mse(gen.numpy(), np.zeros(gen.shape)), [4.0, 0.25], rtol=1e-6)


def test_psnr_matches_hand_value_and_caps_identical_frames():
    tgt = np.full((2, 3, 16, 16, 3), 100, np.uint8)
    gen = tgt.copy()
    gen[0] += 10  # MSE 100 on every frame
    rs = make_reward_set({"room": walled_room(11, 11)}, {"vision": {"metric": "psnr", "psnr_cap_db": 60.0}})
    out = rs.score(_batch(generated_frames=gen, target_frames=tgt))
    np.testing.assert_allclose(out.scores["visual"], [10 * math.log10(255**2 / 100.0), 60.0], rtol=1e-6)
    # Float frames use data range 1.0: an error of 0.1 everywhere -> 20 dB.
    f = np.zeros((1, 2, 4, 4, 3))
    np.testing.assert_allclose(psnr(f + 0.1, f, 1.0, 100.0), [20.0], rtol=1e-9)


def _ssim_reference(a: np.ndarray, b: np.ndarray, data_range: float) -> float:
    """Float64 SSIM of two single-channel images: 11x11 Gaussian (sigma 1.5), valid region, Wang et al. constants."""
    x = np.arange(-5, 6)
    g = np.exp(-(x**2) / (2 * 1.5**2))
    k = np.outer(g, g) / np.outer(g, g).sum()

    def filt(img):
        return convolve2d(img, k, mode="valid")

    mu_a, mu_b = filt(a), filt(b)
    saa, sbb, sab = filt(a * a) - mu_a**2, filt(b * b) - mu_b**2, filt(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    return float(np.mean(((2 * mu_a * mu_b + c1) * (2 * sab + c2)) / ((mu_a**2 + mu_b**2 + c1) * (saa + sbb + c2))))


def test_ssim_matches_independent_float64_reference():
    rng = np.random.default_rng(0)
    tgt = rng.integers(0, 256, (2, 2, 20, 24, 3), dtype=np.uint8)
    noise = rng.integers(-40, 41, tgt.shape)
    gen = np.clip(tgt.astype(int) + noise * np.array([1, 0])[:, None, None, None, None], 0, 255).astype(np.uint8)
    expected = [
        np.mean(
            [
                _ssim_reference(gen[i, t, ..., c].astype(float), tgt[i, t, ..., c].astype(float), 255.0)
                for t in range(2)
                for c in range(3)
            ]
        )
        for i in range(2)
    ]
    np.testing.assert_allclose(ssim(gen, tgt, 255.0), expected, rtol=1e-9, atol=1e-12)
    assert expected[1] == pytest.approx(1.0) and expected[0] < 0.99
    rs = make_reward_set({"room": walled_room(11, 11)}, {"vision": {"metric": "ssim"}})
    out = rs.score(_batch(generated_frames=gen, target_frames=tgt))
    np.testing.assert_allclose(out.scores["visual"], expected, rtol=1e-6)


def test_missing_vision_inputs_score_zero_with_batch_warning():
    rs = make_reward_set({"room": walled_room(11, 11)}, {"vision": {"metric": "psnr"}})
    out = rs.score(_batch())
    assert np.all(out.scores["visual"] == 0)
    assert any(w.startswith("batch: vision metric 'psnr' needs generated_frames") for w in out.warnings)


def test_flow_consistency_terms_on_synthetic_flow_fields():
    h, w, hfov = 9, 16, math.radians(90.0)
    focal = 0.5 * w / math.tan(0.5 * hfov)  # = 8 pixels
    ys, xs = np.mgrid[0:h, 0:w].astype(float)
    rx, ry = xs - 7.5, ys - 4.0
    flow = np.zeros((1, 3, h, w, 2))
    flow[0, 0, ..., 0] = focal * math.tan(0.1)  # pure rotation matching dyaw = 0.1
    flow[0, 1, ..., 0], flow[0, 1, ..., 1] = 0.2 * rx, 0.2 * ry  # expansion (forward motion)
    flow[0, 2] = flow[0, 1]  # expansion while the action drives backward
    fwd = np.array([[0.0, 0.1, -0.1]])
    dyaw = np.array([[0.1, 0.0, 0.0]])
    rot, trans = flow_motion_errors(flow, fwd, dyaw, hfov, 0.02)
    # Rotation matches in step 0; steps 1-2 have median u = 0.2 * median(rx) = 0 and dyaw 0.
    np.testing.assert_allclose(rot, [[0.0, 0.0, 0.0]], atol=1e-12)
    # Radial component of (0.2 rx, 0.2 ry) is 0.2 |r|; the centre (7.5, 4.0) is not a pixel, so all pixels count.
    mean_radial = 0.2 * np.hypot(rx, ry).mean()
    np.testing.assert_allclose(trans, [[0.0, 0.0, mean_radial / w]], rtol=1e-12)
    # A rotation the flow does not show: |0 - 8 tan(0.2)| / 16.
    rot2, _ = flow_motion_errors(np.zeros((1, 1, h, w, 2)), np.zeros((1, 1)), np.array([[0.2]]), hfov, 0.02)
    np.testing.assert_allclose(rot2, [[focal * math.tan(0.2) / w]], rtol=1e-12)


def test_ego_motion_from_scored_poses():
    poses = np.zeros((1, 33, 3))
    poses[0, 1] = [0.0, 0.2, math.pi / 2]  # heading 0 at pose 0, moved sideways: no forward motion, turned 90 deg
    poses[0, 2:] = [0.0, 0.5, math.pi / 2]  # heading +y: 0.3 m forward, then standing still
    fwd, dyaw = ego_motion(poses)
    np.testing.assert_allclose(fwd[0, :3], [0.0, 0.3, 0.0], atol=1e-12)
    np.testing.assert_allclose(dyaw[0, :3], [math.pi / 2, 0.0, 0.0], atol=1e-12)
