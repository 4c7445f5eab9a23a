"""The Ray-free actor (``WNMDiffusionActor``) on the tiny WNM model: log-probs, one update step checked by hand.

Expectations are written from the update's definition, not from the class: with plain SGD one step is
``p - lr * mult * g * min(1, clip / |g|)`` where ``g`` is the gradient of the clipped loss of the whole
mini-batch, micro-batching with weights (shares) must not change it, and a non-finite gradient must leave the
weights and the LR schedule untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, build_wnm_model
from verl_omni.pipelines.wnm_2d.actor import WNMDiffusionActor as Actor2D
from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch, WNMDiffusionActor, lr_multiplier
from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, RolloutRequest, SamplerConfig
from verl_omni.trainer.diffusion.config import LossConfig
from verl_omni.trainer.diffusion.loss import clipped_layer_loss
from verl_omni.trainer.diffusion.recompute import recompute_layer_logprobs

LR = 1e-2
CHUNK = 1  # rows per DiT call: the CPU backend's deterministic mode evaluates every row on its own


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    h, w = model.config.image_size
    gen = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (2, 33, h, w, 3), dtype=torch.uint8, generator=gen)
    with torch.no_grad():
        ctx = model.encode_context(frames, ["go to the door", "turn left and stop"])
    sampler = SamplerConfig(num_steps=3, window_strategy="fixed", window_start=0, window_size=2)
    backend = NativeRolloutBackend.from_model(model, sampler, NativeBackendConfig())
    assert backend.config.effective_chunk_size == CHUNK
    reqs = [RolloutRequest(f"p{r}", stratum=0, branch=b, step=1, seed=3, context_row=r) for r in (0, 1) for b in (0, 1)]
    results = backend.generate(reqs, ctx)
    adv = torch.randn(len(reqs), 9, generator=torch.Generator().manual_seed(2)).clamp(-2, 2)
    return model, backend, ctx, results, adv


def _actor(model, backend, lr_mult=None, grad_clip=1e9):
    module = copy.deepcopy(model.transformer)
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult) if lr_mult is not None else None
    actor = WNMDiffusionActor(
        module,
        backend.layout,
        opt,
        sched,
        loss_config=LossConfig(clip_eps=0.2),
        grad_clip=grad_clip,
        chunk_size=CHUNK,
    )
    return actor


def _micro_batches(results, ctx, adv, splits):
    n = len(results)
    return [UpdateMicroBatch.from_results(results, ctx, rows, advantages=adv, weight=len(rows) / n) for rows in splits]


def _manual_gradient(model, backend, results, ctx, adv):
    """Gradient of the clipped loss over all rollouts in one piece (no micro-batching)."""
    module = copy.deepcopy(model.transformer).train()
    params = [p for p in module.parameters() if p.requires_grad]
    logp = recompute_layer_logprobs(
        module,
        backend.layout,
        results.window_states,
        results.window_steps,
        results.noise_coefs,
        results.sigmas,
        ctx,
        results.context_rows,
        chunk_size=CHUNK,
    )
    loss = clipped_layer_loss(logp, results.logprobs, adv, LossConfig(clip_eps=0.2)).loss
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return params, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _trainable(module):
    return [p.detach() for p in module.parameters() if p.requires_grad]


def test_logprobs_at_unchanged_weights_equal_the_rollouts(rollout):
    model, backend, ctx, results, adv = rollout
    actor = _actor(model, backend)
    mbs = _micro_batches(results, ctx, adv, [[0, 1], [2, 3]])
    got = torch.cat(actor.compute_logprobs(mbs))
    assert torch.equal(got, results.logprobs)  # same weights, dtype and chunking: ratio exactly 1
    # The driver's dicts work too.
    as_dicts = [dict(vars(mb)) for mb in mbs]
    assert torch.equal(torch.cat(actor.compute_logprobs(as_dicts)), results.logprobs)


def test_one_step_equals_manual_sgd_step_and_micro_batching_does_not_change_it(rollout):
    model, backend, ctx, results, adv = rollout
    params0, grads = _manual_gradient(model, backend, results, ctx, adv)
    expected = [p.detach() - LR * g for p, g in zip(params0, grads, strict=True)]
    for splits in ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1, 2], [3]]):
        actor = _actor(model, backend)
        m = actor.update_policy([_micro_batches(results, ctx, adv, splits)])
        for p, e in zip(_trainable(actor.module), expected, strict=True):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-7)
        assert m["actor/logp_abs_diff_first_minibatch"] == 0.0  # first mini-batch: unchanged weights
        assert m["actor/skipped_nonfinite_updates"] == 0.0 and m["actor/lr"] == LR
        grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        assert m["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def test_grad_clip_and_lr_warmup_scale_the_step(rollout):
    model, backend, ctx, results, adv = rollout
    params0, grads = _manual_gradient(model, backend, results, ctx, adv)
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    clip = norm / 4  # the step is scaled by clip / |g| = 1/4
    mult = lr_multiplier(warmup_steps=2, schedule="constant", min_lr_ratio=0.0, total_steps=10)
    actor = _actor(model, backend, lr_mult=mult, grad_clip=clip)
    m = actor.update_policy([_micro_batches(results, ctx, adv, [[0, 1], [2, 3]])])
    # First optimizer step runs at warm-up multiplier f(0) = 1/2; the scheduler then moves to f(1) = 1.
    for p, p0, g in zip(_trainable(actor.module), params0, grads, strict=True):
        torch.testing.assert_close(p, p0.detach() - LR * 0.5 * 0.25 * g, rtol=1e-4, atol=1e-7)
    assert m["actor/lr"] == pytest.approx(LR) and m["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_nonfinite_gradient_skips_the_step_and_is_counted(rollout):
    model, backend, ctx, results, adv = rollout
    mult = lr_multiplier(warmup_steps=4, schedule="constant", min_lr_ratio=0.0, total_steps=10)
    actor = _actor(model, backend, lr_mult=mult)
    before = [p.clone() for p in _trainable(actor.module)]
    calls = []

    def poison_first_backward(grad):  # an overflowing gradient in the first mini-batch only
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad

    next(p for p in actor.module.parameters() if p.requires_grad).register_hook(poison_first_backward)
    mbs = _micro_batches(results, ctx, adv, [[0, 1], [2, 3]])
    m = actor.update_policy([mbs, mbs])
    assert m["actor/skipped_nonfinite_updates"] == 1.0 and actor.nonfinite_updates == 1
    assert m["actor/total_nonfinite_updates"] == 1.0
    # Only the second mini-batch stepped, at the warm-up multiplier f(0) = 1/4; one scheduler step followed.
    assert actor.scheduler.last_epoch == 1 and m["actor/lr"] == pytest.approx(LR * 2 / 4)
    params0, grads = _manual_gradient(model, backend, results, ctx, adv)
    for p, p0, g in zip(_trainable(actor.module), before, grads, strict=True):
        torch.testing.assert_close(p, p0 - LR * 0.25 * g, rtol=1e-5, atol=1e-7)


def test_lr_multiplier_cosine_by_hand():
    f = lr_multiplier(warmup_steps=0, schedule="cosine", min_lr_ratio=0.1, total_steps=4)
    assert f(0) == pytest.approx(1.0) and f(2) == pytest.approx(0.1 + 0.9 * 0.5) and f(4) == pytest.approx(0.1)
    assert f(9) == pytest.approx(0.1)
    g = lr_multiplier(warmup_steps=2, schedule="cosine", min_lr_ratio=0.0, total_steps=4)
    assert [g(0), g(1)] == [0.5, 1.0] and g(3) == pytest.approx(0.5)


def test_micro_batch_checks_and_2d_shares_the_class(rollout):
    _, _, ctx, results, adv = rollout
    mb = UpdateMicroBatch.from_results(results, ctx, [1, 3], advantages=adv, weight=0.5)
    assert len(mb) == 2 and mb.context.batch_size == 2 and mb.context_rows.tolist() == [0, 1]
    assert mb.request_ids == [results.request_ids[1], results.request_ids[3]]
    with pytest.raises(ValueError, match="unknown keys"):
        UpdateMicroBatch.from_dict({**vars(mb), "extra": 1})
    with pytest.raises(ValueError, match="advantages must be"):
        UpdateMicroBatch(**{**vars(mb), "advantages": adv})
    with pytest.raises(ValueError, match="weight"):
        UpdateMicroBatch(**{**vars(mb), "weight": 0.0})
    assert Actor2D is WNMDiffusionActor
