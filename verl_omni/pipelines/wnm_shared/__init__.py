"""Rollout mechanics shared by the WNM variants: layers, schedule, SDE, RNG, sampling plan, backends."""

from verl_omni.pipelines.wnm_shared.backend import RolloutBackend, RolloutResults, decode_actions
from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.factory import BACKENDS, build_rollout_backend
from verl_omni.pipelines.wnm_shared.layers import (
    LAYER_NAMES,
    NUM_LAYERS,
    JointLayout,
    LayerLayoutError,
    LayerTable,
    check_layer_names,
)
from verl_omni.pipelines.wnm_shared.native import NativeRolloutBackend
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest, stratified_requests
from verl_omni.pipelines.wnm_shared.rng import initial_noise, sde_noise, stable_seed
from verl_omni.pipelines.wnm_shared.schedule import shifted_sigmas, sigmas_to_timesteps
from verl_omni.pipelines.wnm_shared.sde import (
    euler_step,
    gaussian_logdensity,
    noise_coefficient,
    sde_mean,
    sde_step,
    transition_layer_logprob,
)
from verl_omni.pipelines.wnm_shared.velocity import NonFiniteError, joint_velocity
from verl_omni.pipelines.wnm_shared.window import window_steps

__all__ = [
    "BACKENDS",
    "LAYER_NAMES",
    "NUM_LAYERS",
    "JointLayout",
    "LayerLayoutError",
    "LayerTable",
    "NativeBackendConfig",
    "NativeRolloutBackend",
    "NonFiniteError",
    "RolloutBackend",
    "RolloutRequest",
    "RolloutResults",
    "SamplerConfig",
    "build_rollout_backend",
    "check_layer_names",
    "decode_actions",
    "euler_step",
    "gaussian_logdensity",
    "initial_noise",
    "joint_velocity",
    "noise_coefficient",
    "sde_mean",
    "sde_noise",
    "sde_step",
    "shifted_sigmas",
    "sigmas_to_timesteps",
    "stable_seed",
    "stratified_requests",
    "transition_layer_logprob",
    "window_steps",
]
