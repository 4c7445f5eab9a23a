"""The WNM diffusion actor: log-probs of stored SDE-window transitions and the clipped GRPO update.

A plain class, in the style of verl's ``DataParallelPPOActor``: it owns no process group, no Ray handle and no
rollout engine, only the (possibly FSDP2-sharded) DiT, its optimizer and LR scheduler. The Ray worker
(:class:`verl_omni.workers.actor_rollout.ActorRolloutWorker`) builds one and forwards ``compute_logprobs`` and
``update`` to it; the GPU benchmark and a CPU test call it directly. The WNM-2D baseline uses the same class
(:mod:`verl_omni.pipelines.wnm_2d` re-exports it): the variants differ in their context tokens only.

One update (:meth:`WNMDiffusionActor.update_policy`) is, for every mini-batch of whole prompt groups:

1. zero the gradients;
2. for every micro-batch: recompute the per-layer log-probs with grad, clipped layer loss, backward of
   ``loss * weight`` (``weight`` = the micro-batch's share of the mini-batch). Under FSDP2 the gradients of
   all but the last micro-batch stay unsharded on the rank (no reduce-scatter until the last one);
3. clip the global gradient norm; a non-finite norm skips the optimizer step (counted, never applied);
4. optimizer step, then one LR-scheduler step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verl_omni.trainer.diffusion.config import LossConfig


@dataclass
class UpdateMicroBatch:
    """One micro-batch of stored window transitions: what one forward/backward of the update consumes.

    Attributes:
        window_states: ``[R, W + 1, D]`` fp32 joint latents (``x_i`` of each window step, then the last ``x_{i+1}``).
        window_steps: ``[R, W]`` int64 denoising steps of each row's window.
        noise_coefs: ``[R, W]`` float64 ``g_i`` the rollout used.
        sigmas: ``[K + 1]`` float64 schedule.
        context: ``WNMContext`` holding the rows these rollouts condition on (``C`` prompts).
        context_rows: ``[R]`` int64 row of ``context`` of each rollout.
        request_ids: ``R`` names (for error messages).
        old_logprobs: ``[R, W, 9]`` fp32 log-probs the ratio is taken against (None for log-prob-only calls).
        advantages: ``[R, 9]`` fp32 per-layer advantages (None for log-prob-only calls).
        weight: This micro-batch's share of its mini-batch's loss (rollouts here / rollouts in the mini-batch).
    """

    window_states: torch.Tensor
    window_steps: torch.Tensor
    noise_coefs: torch.Tensor
    sigmas: torch.Tensor
    context: object
    context_rows: torch.Tensor
    request_ids: list[str]
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    # [R, 9] bool, False for the chunks after a rollout's STOP or collision (left out of the loss); None: all live.
    loss_mask: torch.Tensor | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        r = self.window_states.shape[0]
        if self.window_states.ndim != 3:
            got = list(self.window_states.shape)
            raise ValueError(f"UpdateMicroBatch.window_states must be [R, W+1, D], got {got}")
        w = self.window_states.shape[1] - 1
        shapes = {"window_steps": (r, w), "noise_coefs": (r, w), "context_rows": (r,)}
        if self.old_logprobs is not None:
            shapes["old_logprobs"] = (r, w, self.old_logprobs.shape[-1])
        if self.advantages is not None:
            shapes["advantages"] = (r, self.advantages.shape[-1])
        for name, shape in shapes.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"UpdateMicroBatch.{name} must be {list(shape)}, got {list(got)}")
        if len(self.request_ids) != r:
            raise ValueError(f"UpdateMicroBatch.request_ids has {len(self.request_ids)} entries for {r} rows")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"UpdateMicroBatch.weight must be a positive finite share, got {self.weight}")

    def __len__(self) -> int:
        return self.window_states.shape[0]

    @classmethod
    def from_dict(cls, d: dict) -> UpdateMicroBatch:
        """From the driver's plain-dict micro-batch (keys = this class's field names)."""
        if isinstance(d, cls):
            return d
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"update micro-batch: unknown keys {sorted(unknown)}")
        return cls(**{**d, "weight": float(d.get("weight", 1.0))})

    @classmethod
    def from_results(
        cls,
        results,
        contexts,
        rows: Sequence[int],
        old_logprobs: torch.Tensor | None = None,
        advantages: torch.Tensor | None = None,
        weight: float = 1.0,
        loss_mask: torch.Tensor | None = None,
    ) -> UpdateMicroBatch:
        """Rows ``rows`` of a ``RolloutResults`` with only the context rows they use.

        Args:
            results: ``RolloutResults`` of R rollouts.
            contexts: ``WNMContext`` the results' ``context_rows`` index.
            rows: Rollouts to take.
            old_logprobs: ``[R, W, 9]`` for all R rollouts (default: the rollout's own ``results.logprobs``).
            advantages: ``[R, 9]`` for all R rollouts, or None.
            weight: Loss share of this micro-batch.
            loss_mask: ``[R, 9]`` bool live layers for all R rollouts, or None (all live).
        """
        sel = torch.as_tensor(list(rows), dtype=torch.long)
        uniq, inverse = torch.unique(results.context_rows[sel], return_inverse=True)
        old = results.logprobs if old_logprobs is None else old_logprobs
        return cls(
            window_states=results.window_states[sel],
            window_steps=results.window_steps[sel],
            noise_coefs=results.noise_coefs[sel],
            sigmas=results.sigmas,
            context=contexts.select(uniq),
            context_rows=inverse,
            request_ids=[results.request_ids[i] for i in sel.tolist()],
            old_logprobs=old[sel],
            advantages=None if advantages is None else advantages[sel].float(),
            loss_mask=None if loss_mask is None else loss_mask[sel],
            weight=weight,
        )


def lr_multiplier(warmup_steps: int, schedule: str, min_lr_ratio: float, total_steps: int) -> Callable[[int], float]:
    """LR multiplier per optimizer step: linear warm-up, then constant or cosine down to ``min_lr_ratio``.

    Args:
        warmup_steps: Optimizer steps of linear warm-up (0 = none).
        schedule: ``constant`` or ``cosine``.
        min_lr_ratio: Final multiplier of the cosine schedule.
        total_steps: Optimizer steps of the whole run (the cosine's length).
    """
    total = max(total_steps, 1)

    def f(i: int) -> float:
        if warmup_steps and i < warmup_steps:
            return (i + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warmup_steps) / max(1, total - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _full_norm(norm: torch.Tensor) -> float:
    # clip_grad_norm_ over FSDP2 (DTensor) parameters returns a DTensor; the global norm is its full value.
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class WNMDiffusionActor:
    """Per-rank actor: log-probs and the clipped per-layer GRPO update of the WNM DiT.

    Args:
        module: The trainable DiT (``WNMTransformer``, plain or FSDP2-sharded): the velocity function.
        layout: ``JointLayout`` of the joint latents the transitions were sampled in.
        optimizer: Optimizer over ``module``'s trainable parameters (None: log-probs only).
        scheduler: LR scheduler stepped once per applied optimizer step, or None.
        loss_config: Clip epsilon, layer weights, KL weight.
        grad_clip: Global gradient-norm clip.
        device: Where the DiT runs.
        chunk_size: Rows per DiT call when recomputing log-probs; the rollout's value makes bf16 ratios exact.
        reference: Frozen reference DiT for the KL term (needed iff ``loss_config.kl_beta > 0``).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        layout,
        optimizer: torch.optim.Optimizer | None,
        scheduler=None,
        *,
        loss_config: LossConfig | None = None,
        grad_clip: float = 1.0,
        device: str | torch.device = "cpu",
        chunk_size: int | None = None,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.module = module
        self.layout = layout
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_config = loss_config if loss_config is not None else LossConfig()
        self.grad_clip = float(grad_clip)
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        self.reference = reference
        if self.loss_config.kl_beta > 0 and reference is None:
            raise ValueError("WNMDiffusionActor: loss_config.kl_beta > 0 needs a reference module")
        self.nonfinite_updates = 0  # skipped optimizer steps over the actor's life (checkpointed by the worker)

    # ------------------------------------------------------------------------------------------- log-probs
    def _logprobs(self, mb: UpdateMicroBatch, module: torch.nn.Module, grad: bool) -> torch.Tensor:
        from verl_omni.trainer.diffusion.recompute import recompute_layer_logprobs

        with torch.set_grad_enabled(grad):
            return recompute_layer_logprobs(
                module,
                self.layout,
                mb.window_states.to(self.device),
                mb.window_steps,
                mb.noise_coefs,
                mb.sigmas,
                mb.context.to(self.device, torch.float32),
                mb.context_rows,
                dtype=torch.float32,
                device=self.device,
                chunk_size=self.chunk_size,
                request_ids=mb.request_ids,
            )

    def compute_logprobs(self, micro_batches: Sequence[UpdateMicroBatch | dict]) -> list[torch.Tensor]:
        """Per-layer log-probs of stored transitions under the current weights, without grad.

        Args:
            micro_batches: Micro-batches (or the driver's dicts of them).

        Returns:
            One ``[R, W, 9]`` fp32 CPU tensor per micro-batch.
        """
        self.module.eval()
        out = []
        for mb in micro_batches:
            out.append(self._logprobs(UpdateMicroBatch.from_dict(mb), self.module, grad=False).cpu())
        return out

    # ------------------------------------------------------------------------------------------- update
    def update_policy(self, mini_batches: Sequence[Sequence[UpdateMicroBatch | dict]]) -> dict[str, float]:
        """One optimizer step per mini-batch over its micro-batches (see the module docstring).

        Every rank must call this with the same number of mini-batches and micro-batches: FSDP2's gradient
        reduce-scatter after a mini-batch's last micro-batch is a collective.

        Args:
            mini_batches: For each mini-batch its micro-batches; each needs ``old_logprobs`` and ``advantages``.

        Returns:
            Metrics averaged over mini-batches: the loss's own (ratio stats, clip fraction, approx KL, ...),
            ``actor/grad_norm``, ``actor/lr``, ``actor/skipped_nonfinite_updates`` (this call),
            ``actor/total_nonfinite_updates``, ``actor/logp_abs_diff_first_minibatch`` (largest
            ``|logp - logp_old|`` of the first mini-batch: 0 when rollout and update kernels agree) and
            ``timing/update_s``.
        """
        from verl_omni.trainer.diffusion.loss import clipped_layer_loss

        if self.optimizer is None:
            raise RuntimeError("WNMDiffusionActor.update_policy needs an optimizer")
        t0 = time.perf_counter()
        module = self.module
        can_defer_sync = hasattr(module, "set_requires_gradient_sync")  # FSDP2-sharded module
        module.train()
        metrics: dict[str, list[float]] = {}
        skipped = 0
        first_dev = None
        for mb_index, mini in enumerate(mini_batches):
            mini = [UpdateMicroBatch.from_dict(mb) for mb in mini]
            self.optimizer.zero_grad(set_to_none=True)
            mini_metrics: dict[str, list[float]] = {}
            for pos, mb in enumerate(mini):
                if mb.old_logprobs is None or mb.advantages is None:
                    raise ValueError("update micro-batches need old_logprobs and advantages")
                if can_defer_sync:
                    # Gradients accumulate unsharded on each rank and are reduce-scattered once, after the last
                    # micro-batch of the mini-batch, instead of once per micro-batch (FSDP2 no-sync accumulation).
                    module.set_requires_gradient_sync(pos == len(mini) - 1)
                logp = self._logprobs(mb, module, grad=True)
                old = mb.old_logprobs.to(logp.device)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self._logprobs(mb, self.reference, grad=False)
                mask = None if mb.loss_mask is None else mb.loss_mask.to(logp.device)
                out = clipped_layer_loss(
                    logp, old, mb.advantages.to(logp.device), self.loss_config, logp_ref=ref, loss_mask=mask
                )
                (out.loss * float(mb.weight)).backward()
                if mb_index == 0:
                    dev = float((logp.detach() - old).abs().max())
                    first_dev = dev if first_dev is None else max(first_dev, dev)
                for k, v in out.metrics.items():
                    mini_metrics.setdefault(k, []).append(float(v))
            grad_norm = _full_norm(torch.nn.utils.clip_grad_norm_(module.parameters(), self.grad_clip))
            if not math.isfinite(grad_norm):
                # Never apply a NaN/inf update: skip it, count it, and let the driver stop the run at the limit.
                skipped += 1
                self.nonfinite_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            metrics.setdefault("actor/grad_norm", []).append(grad_norm)
            for k, v in mini_metrics.items():
                metrics.setdefault(k, []).append(float(np.mean(v)))
        result = {k: float(np.mean(v)) for k, v in metrics.items()}
        result["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        result["actor/skipped_nonfinite_updates"] = float(skipped)
        result["actor/total_nonfinite_updates"] = float(self.nonfinite_updates)
        result["actor/logp_abs_diff_first_minibatch"] = float(first_dev if first_dev is not None else 0.0)
        result["timing/update_s"] = time.perf_counter() - t0
        return result


__all__ = ["UpdateMicroBatch", "WNMDiffusionActor", "lr_multiplier"]
