"""Pose <-> action conversion and normalization, checked against hand-worked geometry."""

import math

import numpy as np
import pytest
import torch

from verl_omni.data.actions import ActionNormalization, integrate_actions, poses_to_actions, wrap_angle


def test_robot_frame_actions_by_hand():
    # Facing +y (yaw = pi/2) and moving to +y by 1 m is 1 m forward; moving to -x is 1 m to the left.
    poses = np.array([[0.0, 0.0, math.pi / 2], [0.0, 1.0, math.pi / 2], [-1.0, 1.0, math.pi]])
    a = poses_to_actions(poses, np.array([0, 1]))
    np.testing.assert_allclose(a, [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, math.pi / 2, 1.0]], atol=1e-12)


def test_integrate_inverts_poses_to_actions_and_stop_freezes():
    rng = np.random.default_rng(0)
    poses = np.cumsum(rng.normal(size=(5, 9, 3)) * 0.3, axis=1)
    poses[..., 2] = wrap_angle(poses[..., 2])
    a = poses_to_actions(poses)
    np.testing.assert_allclose(integrate_actions(poses[:, 0], a), poses, atol=1e-10)
    a[:, 3, 3] = 1.0  # STOP at step 3: poses 3.. stay at pose 3
    p = integrate_actions(poses[:, 0], a)
    np.testing.assert_allclose(p[:, :4], poses[:, :4], atol=1e-10)
    np.testing.assert_allclose(p[:, 4:], np.repeat(poses[:, 3:4], 5, axis=1), atol=1e-10)


def test_wrap_angle():
    np.testing.assert_allclose(wrap_angle([3 * math.pi, -math.pi, math.pi, 0.5]), [math.pi, math.pi, math.pi, 0.5])


def test_normalization_round_trip_numpy_and_torch(tmp_path):
    n = ActionNormalization(mean=(0.1, 0.0, 0.0, 0.0), std=(0.05, 0.02, 0.1, 1.0))
    x = np.array([[0.2, 0.02, -0.1, 1.0]])
    np.testing.assert_allclose(n.normalize(x), [[2.0, 1.0, -1.0, 1.0]])
    t = torch.tensor(x, dtype=torch.float64)
    torch.testing.assert_close(n.denormalize(n.normalize(t)), t)
    n.save(tmp_path / "a.json")
    assert ActionNormalization.load(tmp_path / "a.json") == n
    with pytest.raises(ValueError, match="std"):
        ActionNormalization(mean=(0, 0, 0, 0), std=(1, 0, 1, 1))
    with pytest.raises(ValueError, match="missing field"):
        ActionNormalization.from_dict({"mean": [0] * 4})


def test_fit_keeps_stop_channel_unnormalized():
    a = np.array([[0.1, 0.0, 0.2, 1.0], [0.3, 0.0, -0.2, 0.0]])
    n = ActionNormalization.from_actions(a)
    np.testing.assert_allclose(n.mean, [0.2, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(n.std, [0.1, 1e-3, 0.2, 1.0])
