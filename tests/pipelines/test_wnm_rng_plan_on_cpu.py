"""Request RNG, SDE windows, the stratified plan and sampler config validation."""

import os
import subprocess
import sys

import pytest
import torch

from verl_omni.pipelines.wnm_shared.config import NativeBackendConfig, SamplerConfig
from verl_omni.pipelines.wnm_shared.layers import LayerLayoutError
from verl_omni.pipelines.wnm_shared.requests import RolloutRequest, stratified_requests
from verl_omni.pipelines.wnm_shared.rng import initial_noise, sde_noise, stable_seed
from verl_omni.pipelines.wnm_shared.window import window_steps


def test_stable_seed_is_stable_across_processes_and_separates_keys():
    here = stable_seed("init", 7, 3, "s0001_e002_q12_i0", 2)
    code = (
        "from verl_omni.pipelines.wnm_shared.rng import stable_seed; "
        "print(stable_seed('init', 7, 3, 's0001_e002_q12_i0', 2))"
    )
    for hashseed in ("12345",):  # a different str-hash salt than this process
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == here
    assert 0 <= here < 2**63
    assert stable_seed("1", 2) != stable_seed("12")
    assert stable_seed(1) != stable_seed("1")
    assert stable_seed("sde", 0, 0, "a", 0, 0, 1) != stable_seed("sde", 0, 0, "a", 0, 1, 0)
    with pytest.raises(TypeError, match="int or str"):
        stable_seed(1.5)


def test_noise_draws_keyed_by_request_not_global_state():
    a = initial_noise(1, 2, "p", 0, 64)
    torch.manual_seed(123)  # the global generator must not matter
    torch.randn(10)
    assert torch.equal(a, initial_noise(1, 2, "p", 0, 64))
    assert not torch.equal(a, initial_noise(1, 2, "p", 1, 64))  # strata differ
    assert not torch.equal(a, initial_noise(1, 3, "p", 0, 64))  # training steps differ
    b0 = sde_noise(1, 2, "p", 0, 0, 3, 64)
    assert torch.equal(b0, sde_noise(1, 2, "p", 0, 0, 3, 64))
    assert not torch.equal(b0, sde_noise(1, 2, "p", 0, 1, 3, 64))  # branches differ
    assert not torch.equal(b0, sde_noise(1, 2, "p", 0, 0, 4, 64))  # denoising steps differ
    assert a.dtype == torch.float32 and a.device.type == "cpu"


def test_windows_by_hand():
    assert window_steps("fixed", 3, (0, 9), 0, 5, window_start=2) == (2, 3, 4)
    # progressive over range [0, 5) with size 2: valid starts 0..3, one shift every 2 steps
    starts = [window_steps("progressive", 2, (0, 5), 0, t, progressive_interval=2)[0] for t in range(10)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    rand = [window_steps("random", 2, (1, 6), 9, t) for t in range(60)]
    assert rand == [window_steps("random", 2, (1, 6), 9, t) for t in range(60)]
    assert {w[0] for w in rand} == {1, 2, 3, 4}  # every valid start is reachable, none outside
    assert all(w[1] == w[0] + 1 for w in rand)
    with pytest.raises(ValueError, match="does not fit"):
        window_steps("fixed", 6, (0, 5), 0, 0)
    with pytest.raises(ValueError, match="strategy"):
        window_steps("sliding", 2, (0, 5), 0, 0)


def test_stratified_plan_shape():
    reqs = stratified_requests(["a", "b"], run_seed=5, step=7)
    assert len(reqs) == 32
    assert len({r.request_id for r in reqs}) == 32
    assert [(r.sample_id, r.stratum, r.branch, r.context_row) for r in reqs[14:18]] == [
        ("a", 3, 2, 0),
        ("a", 3, 3, 0),
        ("b", 0, 0, 1),
        ("b", 0, 1, 1),
    ]
    assert all(r.seed == 5 and r.step == 7 for r in reqs)
    with pytest.raises(ValueError, match="unique"):
        stratified_requests(["a", "a"], 0, 0)


def test_request_validation():
    with pytest.raises(ValueError, match="stratum"):
        RolloutRequest(sample_id="a", stratum=-1, branch=0, step=0, seed=0)
    with pytest.raises(LayerLayoutError, match="unknown layer layout"):
        RolloutRequest(sample_id="a", stratum=0, branch=0, step=0, seed=0, layer_names=("visual",))


def test_sampler_config_validation():
    cfg = SamplerConfig()
    assert cfg.window_range == (0, 9) and cfg.rollouts_per_prompt == 16
    assert SamplerConfig(window_strategy="fixed", window_start=3, window_size=2).window(0, 0) == (3, 4)
    with pytest.raises(ValueError, match="SamplerConfig.sde_type"):
        SamplerConfig(sde_type="ddpm")
    with pytest.raises(ValueError, match="SamplerConfig.window_range"):
        SamplerConfig(window_range=(0, 10))  # the last step must stay Euler
    with pytest.raises(ValueError, match="SamplerConfig.window_start"):
        SamplerConfig(window_strategy="fixed", window_start=8, window_size=2)
    with pytest.raises(ValueError, match="SamplerConfig.eta"):
        SamplerConfig(eta=0.0)
    with pytest.raises(ValueError, match="SamplerConfig.num_steps"):
        SamplerConfig(num_steps=0)
    with pytest.raises(ValueError, match="NativeBackendConfig.dtype"):
        NativeBackendConfig(dtype="int8")
    assert NativeBackendConfig().deterministic is True
    assert NativeBackendConfig(device="cuda").deterministic is False
