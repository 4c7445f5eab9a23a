"""Rectified-flow math for the joint video/action model (pure functions).

Convention (shared with the rollout's :mod:`verl_omni.pipelines.wnm_shared.sde`): ``x_s = (1 - s) x0 + s eps``
with ``s`` in [0, 1]; the model predicts the velocity ``v = d x_s / d s = eps - x0``.
Video and actions of a sample share ``s``, except in Stage-II training with independent action noise, where
the actions get their own level (``action_sigma``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expand(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma.view(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def interpolate(x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x_s = (1 - s) x0 + s eps`` with per-sample ``sigma [B]``."""
    s = _expand(sigma, x0)
    return (1 - s) * x0 + s * eps


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``v = eps - x0``."""
    return eps - x0


def joint_flow_matching_loss(
    transformer,
    context,
    video_x0: torch.Tensor,
    action_x0: torch.Tensor,
    sigma: torch.Tensor,
    video_eps: torch.Tensor,
    action_eps: torch.Tensor,
    action_weight: float = 1.0,
    action_sigma: torch.Tensor | None = None,
    as_tensors: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean-squared velocity error on video latents plus ``action_weight`` times that on actions.

    Args:
        transformer: A ``WNMTransformer``.
        context: ``WNMContext`` of the B samples.
        video_x0: ``[B, C, T', h, w]`` clean target latents.
        action_x0: ``[B, 32, 4]`` clean normalized actions.
        sigma: ``[B]`` noise levels.
        video_eps / action_eps: Gaussian noise like the clean inputs.
        action_weight: Weight of the action term.
        action_sigma: ``[B]`` noise levels of the actions when they differ from the video's; None = ``sigma``.
        as_tensors: Give the parts as detached 0-d tensors instead of floats: a training loop that reads them only
            now and then does not wait for the device at every step.

    Returns:
        ``(loss, {"video": float, "action": float})`` (tensors with ``as_tensors``).
    """
    if action_sigma is None:  # the ordinary call (positional, as every caller and the compiled forward expect)
        v_video, v_action = transformer(
            interpolate(video_x0, video_eps, sigma), interpolate(action_x0, action_eps, sigma), sigma, context
        )
    else:
        v_video, v_action = transformer(
            interpolate(video_x0, video_eps, sigma), interpolate(action_x0, action_eps, action_sigma), sigma, context,
            action_sigma=action_sigma,
        )  # fmt: skip
    video = F.mse_loss(v_video.float(), velocity_target(video_x0, video_eps).float())
    action = F.mse_loss(v_action.float(), velocity_target(action_x0, action_eps).float())
    loss = video + action_weight * action
    if as_tensors:
        return loss, {"video": video.detach(), "action": action.detach()}
    return loss, {"video": video.item(), "action": action.item()}
