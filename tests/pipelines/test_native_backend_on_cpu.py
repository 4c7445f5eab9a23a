"""Native rollout backend with a small deterministic linear velocity function (a test fixture with the DiT's
signature): determinism across batch compositions, stratum noise sharing, agreement with an independent
float64 sampler, decoding, NaN reporting, refusals and the weight/sleep interface."""

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMContext
from verl_omni.pipelines.wnm_shared import (
    LAYER_NAMES,
    NativeBackendConfig,
    NativeRolloutBackend,
    NonFiniteError,
    RolloutRequest,
    SamplerConfig,
    stratified_requests,
)
from verl_omni.pipelines.wnm_shared.rng import initial_noise, sde_noise

VIDEO = (2, 3, 4, 4)  # 96 video dims
HIST = (2, 2, 4, 4)
D = 96 + 128
NORM = ActionNormalization(mean=(0.1, -0.05, 0.0, 0.2), std=(0.3, 0.2, 0.8, 0.5))


class LinearVelocity(nn.Module):
    """v = M x + C mean(tokens) + H history + sigma * b, split back into video and actions."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.mix = nn.Parameter(0.1 * torch.randn(D, D, generator=gen) / math.sqrt(D))
        self.ctx = nn.Parameter(torch.randn(8, D, generator=gen) / math.sqrt(8))
        self.hist = nn.Parameter(0.1 * torch.randn(math.prod(HIST), D, generator=gen))
        self.sig = nn.Parameter(torch.randn(D, generator=gen))

    def forward(self, video, actions, sigma, context):
        b = video.shape[0]
        x = torch.cat([video.reshape(b, -1), actions.reshape(b, -1)], 1)
        v = (
            x @ self.mix
            + context.encoder_tokens.mean(1) @ self.ctx
            + context.history_latents.reshape(b, -1) @ self.hist
            + sigma[:, None].to(x.dtype) * self.sig
        )
        return v[:, :96].reshape(b, *VIDEO), v[:, 96:].reshape(b, 32, 4)


def make_contexts(seeds):
    rows = [torch.Generator().manual_seed(s) for s in seeds]
    return WNMContext(
        history_latents=torch.stack([torch.randn(*HIST, generator=g) for g in rows]),
        encoder_tokens=torch.stack([torch.randn(5, 8, generator=g) for g in rows]),
    )


def make_backend(sampler=None, **cfg):
    sampler = sampler or SamplerConfig(num_steps=6, window_strategy="fixed", window_start=1, window_size=2)
    return NativeRolloutBackend(LinearVelocity(), VIDEO, NORM, sampler, NativeBackendConfig(**cfg))


def pick(results, request_id):
    i = results.request_ids.index(request_id)
    return (
        results.actions[i],
        results.video_latents[i],
        results.window_states[i],
        results.logprobs[i],
        results.actions_normalized[i],
    )


def test_bit_identical_alone_batched_and_shuffled():
    backend = make_backend()
    ctx_a = make_contexts([11])
    reqs_a = stratified_requests(["A"], run_seed=3, step=4)
    batch = backend.generate(reqs_a, ctx_a)
    assert batch.logprobs.shape == (16, 2, 9) and batch.window_states.shape == (16, 3, D)
    # A at context row 2 among other prompts' requests, shuffled
    ctx_mix = make_contexts([21, 22, 11])
    mixed = [r for r in stratified_requests(["B", "C", "A"], run_seed=3, step=4)]
    random.Random(0).shuffle(mixed)
    shuffled = backend.generate(mixed, ctx_mix)
    for r in reqs_a[::5]:
        alone = backend.generate([r], ctx_a)
        for x, y, z in zip(pick(alone, r.request_id), pick(batch, r.request_id), pick(shuffled, r.request_id)):
            assert torch.equal(x, y) and torch.equal(x, z)
    for r in reqs_a:
        for y, z in zip(pick(batch, r.request_id), pick(shuffled, r.request_id)):
            assert torch.equal(y, z)


def test_branches_share_initial_noise_strata_differ():
    backend = make_backend(SamplerConfig(num_steps=6, window_strategy="fixed", window_start=2, window_size=2))
    res = backend.generate(stratified_requests(["A"], 0, 0), make_contexts([1]))
    entry = res.window_states[:, 0].reshape(4, 4, D)  # before the window: Euler from the stratum's x_0
    for s in range(4):
        for b in range(1, 4):
            assert torch.equal(entry[s, b], entry[s, 0])
    assert not torch.equal(entry[0, 0], entry[1, 0])
    final = res.actions_normalized.reshape(4, 4, -1)
    assert not torch.equal(final[0, 0], final[0, 1])  # branches differ through their SDE noise


@pytest.mark.parametrize("sde_type", ["dance", "flow_grpo"])
def test_matches_independent_float64_sampler(sde_type):
    sampler = SamplerConfig(
        num_steps=5, shift=2.0, eta=0.4, sde_type=sde_type, window_strategy="fixed", window_start=0, window_size=3
    )
    backend = make_backend(sampler)
    ctx = make_contexts([5])
    req = RolloutRequest(sample_id="P", stratum=1, branch=2, step=9, seed=4)
    res = backend.generate([req], ctx)
    vel = LinearVelocity().double()
    c64 = WNMContext(history_latents=ctx.history_latents.double(), encoder_tokens=ctx.encoder_tokens.double())
    u = np.linspace(1.0, 0.0, 6)
    sig = 2.0 * u / (1.0 + u)  # shifted schedule written out, shift = 2
    x = initial_noise(4, 9, "P", 1, D).double()[None]
    ref_logp = []
    for i in range(5):
        s, sn = sig[i], sig[i + 1]
        with torch.no_grad():
            vv, va = vel(x[:, :96].reshape(1, *VIDEO), x[:, 96:].reshape(1, 32, 4), torch.tensor([s]), c64)
        v = torch.cat([vv.reshape(1, -1), va.reshape(1, -1)], 1)
        h = s - sn
        if i < 3:
            g = 0.4 if sde_type == "dance" else 0.4 * math.sqrt(s / (1 - (sig[1] if s == 1 else s)))
            mu = x - h * v - h * g**2 / (2 * s) * (x + (1 - s) * v)
            x = mu + g * math.sqrt(h) * sde_noise(4, 9, "P", 1, 2, i, D).double()[None]
            dens = torch.distributions.Normal(mu, g * math.sqrt(h)).log_prob(x)
            ref_logp.append(
                [float(dens[0, :96].mean())]
                + [float(dens[0, 96:].reshape(4, 8, 4)[k, :, :3].mean()) for k in range(4)]
                + [float(dens[0, 96:].reshape(4, 8, 4)[k, :, 3].mean()) for k in range(4)]
            )
        else:
            x = x - h * v
    torch.testing.assert_close(
        res.logprobs[0].double(), torch.tensor(ref_logp, dtype=torch.float64), rtol=1e-4, atol=1e-3
    )
    torch.testing.assert_close(res.video_latents[0].double().reshape(-1), x[0, :96], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res.actions_normalized[0].double().reshape(-1), x[0, 96:], rtol=1e-4, atol=1e-4)
    assert res.window_steps[0].tolist() == [0, 1, 2]
    assert res.timesteps.tolist() == pytest.approx((1000 * sig[:-1]).tolist())


def test_decoded_actions_are_denormalized_and_wrapped():
    res = make_backend().generate(stratified_requests(["A"], 0, 0)[:3], make_contexts([1]))
    raw = res.actions_normalized.double().numpy() * np.array(NORM.std) + np.array(NORM.mean)
    np.testing.assert_allclose(res.actions[..., :2].numpy(), raw[..., :2], rtol=1e-6, atol=1e-6)
    wrapped = np.arctan2(np.sin(raw[..., 2]), np.cos(raw[..., 2]))
    np.testing.assert_allclose(res.actions[..., 2].numpy(), wrapped, rtol=1e-5, atol=1e-5)
    assert np.array_equal(res.actions[..., 3].numpy(), (raw[..., 3] > 0.5).astype(np.float32))


def test_nan_is_reported_with_request_ids():
    ctx = make_contexts([1, 2])
    ctx.encoder_tokens[1, 0, 0] = float("nan")
    reqs = stratified_requests(["A", "B"], 0, 0)
    with pytest.raises(NonFiniteError) as err:
        make_backend(deterministic=False).generate(reqs, ctx)
    assert sorted(err.value.request_ids) == sorted(r.request_id for r in reqs if r.sample_id == "B")
    assert err.value.denoising_step == 0 and "B/t0/s0/b0" in str(err.value)


def test_refusals():
    backend = make_backend()
    ctx = make_contexts([1])
    with pytest.raises(ValueError, match="asks for 10 denoising steps"):
        backend.generate([RolloutRequest("A", 0, 0, 0, 0, num_steps=10)], ctx)
    with pytest.raises(IndexError, match="context_row 3"):
        backend.generate([RolloutRequest("A", 0, 0, 0, 0, context_row=3)], ctx)
    with pytest.raises(ValueError, match="duplicate"):
        backend.generate([RolloutRequest("A", 0, 0, 0, 0)] * 2, ctx)


def test_update_weights_sleep_wake():
    backend = make_backend()
    ctx = make_contexts([1])
    req = [RolloutRequest("A", 0, 0, 0, 0)]
    before = backend.generate(req, ctx)
    assert before.weight_version == 0
    new = {k: v * 0.5 for k, v in LinearVelocity(seed=1).state_dict().items()}
    backend.update_weights(new, version=3)
    after = backend.generate(req, ctx)
    assert after.weight_version == 3 and not torch.equal(after.video_latents, before.video_latents)
    assert torch.equal(backend.transformer.mix, new["mix"])
    with pytest.raises(KeyError, match="missing names"):
        backend.update_weights({"mix": new["mix"]}, version=4)
    backend.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        backend.generate(req, ctx)
    backend.wake_up()
    assert torch.equal(backend.generate(req, ctx).video_latents, after.video_latents)


def test_batched_mode_agrees_with_deterministic_mode():
    reqs = stratified_requests(["A", "B"], 1, 2)
    ctx = make_contexts([1, 2])
    det = make_backend().generate(reqs, ctx)
    bat = make_backend(deterministic=False, chunk_size=5).generate(reqs, ctx)
    torch.testing.assert_close(bat.logprobs, det.logprobs, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bat.window_states, det.window_states, rtol=1e-5, atol=1e-5)
    assert bat.request_ids == det.request_ids and list(LAYER_NAMES) == list(det.layer_names)


def _euler_reference(backend, x0, ctx_row, sigmas):
    """float64 Euler integration of the linear fixture from x0: the independent ODE reference."""
    model = backend.transformer.double()
    ctx = make_contexts([ctx_row]).to("cpu", torch.float64)
    x = x0.double()[None]
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        video, actions = x[:, :96].reshape(1, *VIDEO), x[:, 96:].reshape(1, 32, 4)
        vv, va = model(video, actions, torch.tensor([s], dtype=torch.float64), ctx)
        v = torch.cat([vv.reshape(1, -1), va.reshape(1, -1)], 1)
        x = x + (s_next - s) * v
    backend.transformer.float()
    return x[0]


def test_ode_mode_is_plain_euler_from_the_stratum_noise():
    backend = make_backend()
    req = RolloutRequest(sample_id="p", stratum=2, branch=3, step=5, seed=11)
    res = backend.generate([req], make_contexts([0]), ode=True)
    assert res.window_states.shape == (1, 0, D) and res.logprobs.shape == (1, 0, 9)
    x0 = initial_noise(11, 5, "p", 2, D)
    expected = _euler_reference(backend, x0, 0, backend.sampler.sigmas())
    got = torch.cat([res.video_latents.reshape(1, -1), res.actions_normalized.reshape(1, -1)], 1)[0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    # The ODE ignores the branch: every branch of a stratum gives the same sample.
    other = backend.generate(
        [RolloutRequest(sample_id="p", stratum=2, branch=0, step=5, seed=11)], make_contexts([0]), ode=True
    )
    assert torch.equal(other.video_latents, res.video_latents)


def test_independent_initial_noise_ablation_breaks_stratum_sharing():
    sampler = SamplerConfig(
        num_steps=6, window_strategy="fixed", window_start=1, window_size=2, shared_initial_noise=False
    )
    backend = make_backend(sampler)
    reqs = stratified_requests(["p"], run_seed=3, step=1, num_strata=1, num_branches=2)
    res = backend.generate(reqs, make_contexts([0]))
    x0_first = res.window_states[:, 0]  # x at the first window step differs already before any SDE noise
    assert not torch.equal(x0_first[0], x0_first[1])
    shared = make_backend().generate(reqs, make_contexts([0]))
    assert torch.equal(shared.window_states[0, 0], shared.window_states[1, 0])


class CountingVelocity(LinearVelocity):
    """LinearVelocity that counts the rows it evaluates."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def forward(self, video, actions, sigma, context):
        self.rows += video.shape[0]
        return super().forward(video, actions, sigma, context)


@pytest.mark.parametrize("deterministic", [True, False])
def test_shared_prefix_is_exact_and_saves_the_branch_copies(deterministic):
    # 2 prompts x 4 strata x 4 branches, K = 6, window {3, 4}: before step 3 only the 2 x 4 strata differ.
    sampler = SamplerConfig(num_steps=6, window_strategy="fixed", window_start=3, window_size=2)
    reqs = stratified_requests(["A", "B"], 5, 2)
    ctx = make_contexts([1, 2])
    runs = {}
    for share in (True, False):
        vel = CountingVelocity()
        backend = NativeRolloutBackend(
            vel, VIDEO, NORM, sampler, NativeBackendConfig(deterministic=deterministic, share_prefix=share)
        )
        runs[share] = (backend.generate(reqs, ctx), vel.rows)
    (shared, rows_shared), (plain, rows_plain) = runs[True], runs[False]
    # Hand count: without sharing 32 rollouts x 6 steps; with it 8 prefixes x 3 steps + 32 x 3 steps.
    assert rows_plain == 32 * 6
    assert rows_shared == 8 * 3 + 32 * 3
    for name in ("actions_normalized", "video_latents", "window_states", "logprobs"):
        a, b = getattr(shared, name), getattr(plain, name)
        if deterministic:
            assert torch.equal(a, b), name
        else:  # batched: a batch of 8 vs 32 may round differently in the last bit
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ode_mode_shares_whole_trajectories_of_a_stratum():
    sampler = SamplerConfig(num_steps=6, window_strategy="fixed", window_start=1, window_size=2)
    vel = CountingVelocity()
    backend = NativeRolloutBackend(vel, VIDEO, NORM, sampler, NativeBackendConfig())
    res = backend.generate(stratified_requests(["A"], 0, 0), make_contexts([1]), ode=True)
    assert vel.rows == 4 * 6  # 4 strata x 6 Euler steps; the 4 branches of a stratum are the same sample
    for s in range(4):
        rows = [i for i, r in enumerate(res.requests) if r.stratum == s]
        assert all(torch.equal(res.actions_normalized[rows[0]], res.actions_normalized[i]) for i in rows)
