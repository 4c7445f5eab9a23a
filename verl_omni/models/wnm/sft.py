"""Flow-matching SFT of the joint DiT on expert data from a GN0 collection (a Stage-II stand-in).

Used by ``tools/checkpoint/make_tiny_wnm_checkpoint.py`` and the Stage-II driver ``scripts/train_stage2.py``
(which adds closed-loop DAgger rounds). Runs on any torch device: encoder outputs are cached once on the
training device and every step draws its rows and noise there.

The expert examples (one per query state, :mod:`.expert_data`) become one row per instruction variant
(:mod:`.encoded_rows`); whole episodes are held out for the held-out loss. Optional auxiliary heads
(:mod:`.goal_probe`: the goal's direction, the named object in the current view) train with the flow-matching
loss, and :mod:`.grounding_eval` measures whether the result reads its instruction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from verl_omni.data.actions import ActionNormalization

from .encoded_rows import (  # noqa: F401  (re-exported)
    EncodedRows,
    condition_view_indices,
    encode_examples,
    refresh_features,
    to_device,
    trained_features,
)
from .encoded_rows import draw_noise as _draw
from .encoders import freeze
from .expert_data import (  # noqa: F401  (re-exported: sft.* is the Stage-II API)
    ExpertExample,
    episode_group,
    history_indices,
    iter_expert_examples,
    load_expert_examples,
    split_by_episode,
    split_episode_ids,
    subsample,
)
from .flow_matching import joint_flow_matching_loss
from .goal_probe import GoalProbe, ObjectViewProbe
from .grounding_eval import (  # noqa: F401  (re-exported)
    goal_direction_gap,
    instruction_gap,
    object_view_gap,
    swap_partners,
)
from .model import WNMModel
from .sft_resume import SFTResume

TRAINABLE_ENCODERS = ("text_encoder", "image_encoder", "geometry_encoder")
_BUILTIN_KIND_FIELD = {
    "text_encoder": "text_encoder_kind",
    "image_encoder": "image_encoder_kind",
    "geometry_encoder": "geometry_encoder_kind",
}


@dataclass(frozen=True)
class SFTConfig:
    """Flow-matching SFT settings.

    Attributes:
        steps: Optimizer steps.
        batch_size: Rows per step.
        lr / weight_decay: AdamW settings.
        action_weight: Weight of the action loss term.
        eval_every: Held-out evaluation interval (steps).
        eval_rows: Held-out rows evaluated (fixed noise, stratified sigmas).
        seed: Seed of the training noise and row sampling.
        train_encoders: Built-in encoders trained with the DiT (``text_encoder``, ``image_encoder``,
            ``geometry_encoder``); the rest stay frozen. Stage II trains them because randomly initialised
            built-in encoders carry no meaning: a frozen random byte encoder left the policy blind to its
            instruction. They are frozen again afterwards (Stage III never updates them).
        goal_aux_weight: Weight of the auxiliary goal-direction loss (:class:`goal_probe.GoalProbe`; 0 = off).
        independent_action_noise: Share of training rows whose actions get their own noise level, drawn
            independently of the video's (0 = off, every row shares one level as in rollouts). Why: with one
            shared level the action tokens can read the expert's motion off the barely noisy target video
            (inverse dynamics) at low noise; rows whose video is noisier than their actions must predict the
            actions from the history and the instruction alone (the decoupled noise of unified world models).
        view_aux_weight: Weight of the auxiliary view-grounding loss (:class:`goal_probe.ObjectViewProbe`: is the
            named object in the current frame, at what bearing; 0 = off). Taken on every row: the current view
            and the instruction answer it at any noise level.
        goal_aux_pure_noise: Share of training rows put at pure noise (sigma = 1 for video and actions) on which
            alone the goal-direction loss is taken (0 = on every row at its own level). Measured: at spread levels
            the head reads the goal off the barely noisy target clip (17 degrees of error at spread levels, 43 at
            pure noise, constant answer 45), so its gradient never asks for the named object in the views.
        autocast: ``none`` (the weights' float32; TF32 matmuls where the caller allows them) or ``bfloat16``
            (``torch.autocast`` around the training forwards; the weights, gradients and optimizer stay float32,
            held-out losses are taken in float32).
        newest_share: Share of every batch drawn from the rows at ``newest_rows_from`` and after (a DAgger round's
            own rows, appended after the aggregate of earlier rounds); the rest of the batch is drawn from the
            rows before. None: every row is equally likely (the aggregate's own proportions). Why: the DAgger
            rows' relabels are the expert's answers in states the learner drove into (stalls, walls), mostly
            turns in place and short moves; the state-matched probe showed a DAgger round that learnt caution
            from them, and this share sets their weight without dropping them.
        newest_rows_from: First row of the newest round's rows (used with ``newest_share``).
        ema_decay: Decay of an exponential moving average of the trained weights (0 = off). When on, the weights
            the run ends with (and saves) are the average, not the last iterate: with a constant learning rate the
            last iterate carries the noise of its final steps, which open-loop losses average out but a closed
            loop compounds. The decay ramps up as ``min(ema_decay, (1 + t) / (10 + t))`` at step ``t``
            (:func:`ema_decay_at`), so that the average forgets the starting weights in short runs.
    """

    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    action_weight: float = 1.0
    eval_every: int = 25
    eval_rows: int = 64
    seed: int = 0
    train_encoders: tuple[str, ...] = ()
    goal_aux_weight: float = 0.0
    independent_action_noise: float = 0.0
    goal_aux_pure_noise: float = 0.0
    view_aux_weight: float = 0.0
    autocast: str = "none"
    newest_share: float | None = None
    newest_rows_from: int = 0
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_encoders", tuple(self.train_encoders))
        unknown = sorted(set(self.train_encoders) - set(TRAINABLE_ENCODERS))
        if unknown:
            raise ValueError(f"SFTConfig.train_encoders: unknown {unknown}; choose from {list(TRAINABLE_ENCODERS)}")
        if self.steps < 0:  # 0: no optimizer step; the held-out loss, the feature refresh and the probes still run
            raise ValueError(f"SFTConfig.steps: must be >= 0, got {self.steps}")
        for name in ("batch_size", "eval_every", "eval_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SFTConfig.lr: must be a positive number, got {self.lr}")
        if self.weight_decay < 0 or self.action_weight < 0 or not self.goal_aux_weight >= 0:
            raise ValueError("SFTConfig.weight_decay, action_weight and goal_aux_weight must be >= 0")
        if not (self.view_aux_weight >= 0 and math.isfinite(self.view_aux_weight)):
            raise ValueError(f"SFTConfig.view_aux_weight: must be a number >= 0, got {self.view_aux_weight}")
        if self.autocast not in ("none", "bfloat16"):
            raise ValueError(f"SFTConfig.autocast: 'none' or 'bfloat16', got {self.autocast!r}")
        for name in ("independent_action_noise", "goal_aux_pure_noise"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SFTConfig.{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.newest_share is not None and not 0.0 <= self.newest_share <= 1.0:
            raise ValueError(f"SFTConfig.newest_share: must be in [0, 1] or None, got {self.newest_share}")
        if self.newest_rows_from < 0:
            raise ValueError(f"SFTConfig.newest_rows_from: must be >= 0, got {self.newest_rows_from}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"SFTConfig.ema_decay: must be in [0, 1) (0 = off), got {self.ema_decay}")


def snapshot_settings(cfg: SFTConfig) -> dict:
    """The settings an SFT snapshot is keyed by: every field of ``cfg``, less the ones at a default that came later.

    A snapshot is continued only by a run with the same key. Fields added to :class:`SFTConfig` after snapshots were
    first written (``ema_decay``) are left out while they are off, so a run cut off before such a field existed is
    continued by the newer code instead of being trained again from step 0.
    """
    settings = dataclasses.asdict(cfg)
    if settings["ema_decay"] == 0.0:
        del settings["ema_decay"]
    return settings


def ema_decay_at(step: int, decay: float) -> float:
    """The moving average's decay after optimizer step ``step`` (1-based): ``min(decay, (1 + step) / (10 + step))``.

    The ramp (as in timm's and Diffusion Policy's EMA warm-up) keeps the first steps from pinning the average to
    the starting weights.
    """
    return min(decay, (1.0 + step) / (10.0 + step))


@torch.no_grad()
def ema_update(average: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    """``average <- decay * average + (1 - decay) * params``, in place, for every tensor pair."""
    torch._foreach_lerp_(average, [p.detach() for p in params], 1.0 - decay)


# Steps at the start of an SFT loop whose time :class:`PhaseClock` reports apart: the first steps of a process pay
# one-time costs per new shape (cuDNN attention plans under bfloat16, cuBLAS heuristics, allocator growth), which
# would otherwise inflate a short run's mean step time.
WARMUP_STEPS = 20


def draw_rows(
    total_rows: int,
    batch_size: int,
    generator: torch.Generator,
    newest_share: float | None = None,
    newest_rows_from: int = 0,
) -> torch.Tensor:
    """Row indices of one SFT batch.

    Args:
        total_rows: Rows to draw from (``EncodedRows.rows``).
        batch_size: Rows per batch.
        generator: The run's CPU generator (its stream is unchanged when ``newest_share`` is None).
        newest_share: Share of the batch drawn uniformly from rows ``[newest_rows_from, total_rows)``; the rest
            is drawn uniformly from ``[0, newest_rows_from)``. The split is ``round(newest_share * batch_size)``
            rows exactly, every batch. None, or no rows on one side: uniform over all rows.
        newest_rows_from: First row of the newest rows.

    Returns:
        ``int64 [batch_size]`` row indices, earlier rows first.
    """
    if newest_share is None or not 0 < newest_rows_from < total_rows:
        return torch.randint(0, total_rows, (batch_size,), generator=generator)
    newest = round(newest_share * batch_size)
    earlier = torch.randint(0, newest_rows_from, (batch_size - newest,), generator=generator)
    later = torch.randint(newest_rows_from, total_rows, (newest,), generator=generator)
    return torch.cat([earlier, later])


class PhaseClock:
    """Wall seconds of the phases of an SFT run (steps, held-out losses, snapshots, feature refresh, probes).

    The device is synchronized at each phase boundary, so that kernels queued in a phase are charged to it. The
    boundaries are the held-out evaluations and the snapshots, which wait for the device anyway (they read losses
    back), so timing adds no wait to the steps themselves. One more wait, at the end of the first
    :data:`WARMUP_STEPS` steps of a long enough loop (:meth:`end_warmup`), separates their one-time costs (cuDNN and
    cuBLAS plan selection for each new shape, the allocator's first growth) from the steady step time.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self._warmup: tuple[int, float] | None = None  # (steps, seconds without their evaluations and snapshots)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Adds the wall time of the ``with`` body (device work included) to ``seconds[name]``."""
        self._sync()
        t0 = self._started[name] = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - t0

    def end_warmup(self, steps: int) -> None:
        """Marks the end of the loop's first ``steps`` steps (call inside the ``"loop"`` phase, once)."""
        self._sync()
        elapsed = time.perf_counter() - self._started["loop"]
        self._warmup = (steps, max(0.0, elapsed - self.seconds["heldout_eval"] - self.seconds["snapshot"]))

    def report(self, steps: int) -> dict[str, float]:
        """``{"steps", "steps_s", "ms_per_step", "warmup_steps", "warmup_s", "steady_ms_per_step",
        "heldout_eval_s", "snapshot_s", "refresh_features_s", "probes_s"}``: ``steps_s`` is the loop's time
        without its held-out evaluations and snapshots; ``warmup_s`` the part of it spent in the first
        ``warmup_steps`` steps (0 and 0 when the loop was too short to split) and ``steady_ms_per_step`` the mean of
        the steps after them; ``probes_s`` the held-out loss before and after the loop and the grounding probes."""
        sec = self.seconds
        steps_s = max(0.0, sec["loop"] - sec["heldout_eval"] - sec["snapshot"])
        warm_steps, warm_s = self._warmup if self._warmup is not None and self._warmup[0] < steps else (0, 0.0)
        steady = steps - warm_steps
        return {"steps": steps, "steps_s": steps_s, "ms_per_step": 1000 * steps_s / steps if steps else 0.0,
                "warmup_steps": warm_steps, "warmup_s": warm_s,
                "steady_ms_per_step": 1000 * max(0.0, steps_s - warm_s) / steady if steady else 0.0,
                "heldout_eval_s": sec["heldout_eval"], "snapshot_s": sec["snapshot"],
                "refresh_features_s": sec["refresh_features"], "probes_s": sec["probes"]}  # fmt: skip


@torch.no_grad()
def heldout_loss(model: WNMModel, data: EncodedRows, cfg: SFTConfig) -> dict[str, float]:
    """Loss on held-out rows with fixed noise and stratified sigmas (same draws at every call)."""
    was_training = model.transformer.training
    model.transformer.eval()
    g = torch.Generator().manual_seed(12345)
    rows = torch.arange(min(cfg.eval_rows, data.rows))
    sigma = (torch.arange(len(rows)) + 0.5) / len(rows)
    totals = {"loss": 0.0, "video": 0.0, "action": 0.0}
    for chunk in rows.split(16):
        x0, a0, s, ev, ea = _draw(data, chunk, g, sigma[chunk])
        hist, feats = trained_features(model, data, chunk.to(data.row_example.device), cfg.train_encoders)
        ctx = model.context_from_features(hist, feats)
        loss, parts = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
        w = len(chunk) / len(rows)
        totals["loss"] += loss.item() * w
        totals["video"] += parts["video"] * w
        totals["action"] += parts["action"] * w
    model.transformer.train(was_training)
    return totals


def _trainable_encoders(model: WNMModel, names: tuple[str, ...]) -> list[torch.nn.Module]:
    modules = []
    for name in names:
        kind = getattr(model.config, _BUILTIN_KIND_FIELD[name])
        module = getattr(model, name)
        if module is None or kind != "builtin":
            raise ValueError(
                f"SFTConfig.train_encoders: {name} is {kind!r} in this model; only built-in encoders train in SFT "
                "(pretrained ones stay frozen); drop it from train_encoders"
            )
        modules.append(module)
    return modules


def _sft_loop(model, train, heldout, cfg, bar, g, opt, params, probes, curve, losses, window, aux_losses,
              after_step: Callable[[int, Callable[[], None]], None] | None = None,
              clock: PhaseClock | None = None, step_hook: Callable[[int], None] | None = None,
              average: list[torch.Tensor] | None = None) -> None:  # fmt: skip
    """The optimizer steps of :func:`train_sft` (appends to ``curve``, ``losses``, ``window``, ``aux_losses``;
    calls ``after_step(step, flush)`` once a step is complete, ``flush()`` bringing the losses up to date;
    updates ``average``, the moving average of ``params``, after every step when given).

    Nothing in a step waits for the device: the draws are made on the CPU and queued behind the running kernels
    (:func:`encoded_rows.to_device`), and the losses stay on the device until an evaluation or ``flush`` reads
    them, so the CPU prepares the next step while the GPU runs this one.
    """
    probe, view_probe = probes
    dev = train.row_example.device
    pending: dict[str, list[torch.Tensor]] = {"loss": [], "goal": [], "view": []}

    def flush() -> None:
        for key, values in pending.items():
            if values:
                floats = torch.stack(values).tolist()
                if key == "loss":
                    losses.extend(floats)
                    window.extend(floats)
                else:
                    aux_losses[key].extend(floats)
                values.clear()

    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    # Which rows' text masks are all True, on the host (one wait for the device here): every step then tells the
    # transformer whether its context mask can be dropped, instead of the transformer checking on the device,
    # which would make the host wait for the previous step in every forward.
    text_full = train.text_mask.all(dim=1).cpu()
    first = None  # the loop's first step (later than 1 when resumed from a snapshot)
    for step in bar:
        first = step if first is None else first
        rows = draw_rows(train.rows, cfg.batch_size, g, cfg.newest_share, cfg.newest_rows_from)
        text_all_true = bool(text_full[rows].all())
        x0, a0, s, ev, ea = _draw(train, rows, g, move=False)
        pure = None
        if probe is not None and cfg.goal_aux_pure_noise > 0:  # drawn only when on (old random stream when off)
            pure = torch.rand(len(rows), generator=g) < cfg.goal_aux_pure_noise
            s = torch.where(pure, torch.ones_like(s), s)
        sa = None
        if cfg.independent_action_noise > 0:  # drawn only when on, so that off keeps the old random stream
            own = torch.rand(len(rows), generator=g) < cfg.independent_action_noise
            sa = torch.where(own, torch.rand(len(rows), generator=g), s)
            if pure is not None:  # the goal head's rows stay at pure noise for the actions too
                sa = to_device(torch.where(pure, torch.ones_like(sa), sa), dev)
            else:
                sa = to_device(sa, dev)
        s, ev, ea, rows = (to_device(t, dev) for t in (s, ev, ea, rows))
        pure = None if pure is None else to_device(pure, dev)
        with amp:
            hist, feats = trained_features(model, train, rows, cfg.train_encoders)
            feats["text_mask_all_true"] = text_all_true
            ctx = model.context_from_features(hist, feats)  # projectors train; frozen encoders' features are fixed
            loss, _ = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight, sa,
                                               as_tensors=True)  # fmt: skip
            total = loss
            if probe is not None:  # reads the hidden state recorded by the forward just above
                aux = probe.loss(train.goal_polar[train.row_example[rows]], pure)
                total = loss + cfg.goal_aux_weight * aux
                pending["goal"].append(aux.detach())
            if view_probe is not None:  # same recorded forward; every row counts
                aux = view_probe.loss(train.goal_view[train.row_example[rows]])
                total = total + cfg.view_aux_weight * aux
                pending["view"].append(aux.detach())
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if average is not None:
            ema_update(average, params, ema_decay_at(step, cfg.ema_decay))
        pending["loss"].append(loss.detach())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            flush()
            with clock.phase("heldout_eval") if clock is not None else contextlib.nullcontext():
                held = heldout_loss(model, heldout, cfg)["loss"]
            curve.append((step, float(np.mean(window)), held))
            window.clear()
            bar.set_postfix(train=f"{curve[-1][1]:.3f}", heldout=f"{held:.3f}")
        if after_step is not None:
            after_step(step, flush)
        if step_hook is not None:
            step_hook(step)
        if clock is not None and step == first + WARMUP_STEPS - 1 and step < cfg.steps - WARMUP_STEPS:
            clock.end_warmup(WARMUP_STEPS)
    flush()


def train_sft(
    model: WNMModel,
    train: EncodedRows,
    heldout: EncodedRows,
    cfg: SFTConfig,
    progress: bool = True,
    view_head: ObjectViewProbe | None = None,
    resume: SFTResume | None = None,
    step_hook: Callable[[int], None] | None = None,
) -> dict:
    """AdamW flow-matching training of ``model.transformer`` (and of the ``cfg.train_encoders``).

    Trained encoders are frozen again at the end and the cached features of ``train`` and ``heldout`` are
    recomputed with their new weights. ``view_head`` continues an earlier round's view head (``cfg.view_aux_weight``
    > 0) instead of starting a fresh one. With ``resume``, the run is snapshotted every ``resume.every_s`` seconds
    and a snapshot of the same settings and data sizes left by a run that was cut off is continued (the result is
    the uninterrupted run's); the caller removes the snapshot once it has saved the result. ``step_hook(step)`` is
    called after every optimizer step (e.g. ``torch.profiler.profile.step`` of a profiler around the call).

    Returns:
        ``{"initial_heldout", "final_heldout", "instruction_gap"`` (:func:`instruction_gap` of the held-out rows)
        ``, "instruction_gap_pure_noise"`` (at sigma 1) ``, "goal_direction"`` (:func:`goal_direction_gap`, None
        without the goal head) ``, "goal_direction_pure_noise"`` (at sigma 1) ``, "object_view"``
        (:func:`object_view_gap`, None without the view head) ``, "object_view_pure_noise"`` (at sigma 1) ``,
        "curve": [(step, train_loss_avg, heldout_loss)], "train_losses", "goal_aux_losses", "view_aux_losses"``
        (the last two empty unless their head is on)``, "view_head"`` (the trained view head, None when off)``,
        "timings"`` (:meth:`PhaseClock.report` of this call: its steps and where its time went)``}``.
    """
    encoders = _trainable_encoders(model, cfg.train_encoders)
    params = list(model.transformer.parameters())
    for module in encoders:
        for p in module.parameters():
            p.requires_grad_(True)
        params += list(module.parameters())
    probe = None
    if cfg.goal_aux_weight > 0:
        if train.goal_polar is None:
            raise ValueError("SFTConfig.goal_aux_weight > 0 needs goal targets (ExpertExample.goal_polar, set for "
                             "every example read from a GN0 collection)")  # fmt: skip
        probe = GoalProbe(model.config.dim).to(train.goal_polar.device)
        params += list(probe.parameters())
    view_probe = None
    if cfg.view_aux_weight > 0:
        if train.goal_view is None:
            raise ValueError(
                "SFTConfig.view_aux_weight > 0 needs the queries' goal_object_bearing (recorded by the simulator "
                "since the view-grounding head exists); re-synthesize the collection"
            )
        view_probe = view_head if view_head is not None else ObjectViewProbe(model.config.dim)
        view_probe = view_probe.to(train.goal_view.device).train()
        params += list(view_probe.parameters())
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    trained = {"transformer": model.transformer, **{f"encoder.{n}": getattr(model, n) for n in cfg.train_encoders}}
    trained.update({k: v for k, v in (("goal_head", probe), ("view_head", view_probe)) if v is not None})
    fingerprint = {"sft": snapshot_settings(cfg), "train": [train.examples, train.rows], "heldout": heldout.rows,
                   "modules": sorted(trained)}  # fmt: skip
    clock = PhaseClock(train.row_example.device)
    # The moving average of the trained weights (SFTConfig.ema_decay), kept as plain tensors beside ``params``:
    # torch.optim.swa_utils.AveragedModel would deep-copy whole modules, compiled DiT blocks included, where the
    # parameters are all that is averaged.
    average = [p.detach().clone() for p in params] if cfg.ema_decay > 0 else None
    snap = None if resume is None else resume.load(fingerprint)
    if snap is None:
        with clock.phase("probes"):
            initial = heldout_loss(model, heldout, cfg)
        curve, losses, window, aux_losses = [(0, None, initial["loss"])], [], [], {"goal": [], "view": []}
        start = 1
    else:
        for name, module in trained.items():
            module.load_state_dict(snap["modules"][name])
        opt.load_state_dict(snap["optimizer"])
        g.set_state(snap["generator"])
        if average is not None:
            for mine, saved in zip(average, snap["average"], strict=True):
                mine.copy_(saved)
        initial, curve, losses, window, aux_losses = (snap[k] for k in ("initial", "curve", "losses", "window", "aux"))
        start = snap["step"] + 1

    def after_step(step: int, flush: Callable[[], None]) -> None:
        if step < cfg.steps and resume.due():  # the last step's result is the caller's to save
            with clock.phase("snapshot"):
                flush()
                resume.save(fingerprint, {
                    "step": step, "modules": {k: m.state_dict() for k, m in trained.items()},
                    "optimizer": opt.state_dict(), "generator": g.get_state(), "initial": initial, "curve": curve,
                    "losses": losses, "window": window, "aux": aux_losses,
                    "average": None if average is None else [t.clone() for t in average],
                })  # fmt: skip

    model.train()  # frozen parts stay in eval mode; the built-in encoders have no dropout or batch norm
    bar = tqdm(range(start, cfg.steps + 1), desc="sft", disable=not progress, initial=start - 1, total=cfg.steps)
    try:
        with contextlib.ExitStack() as heads:
            for head in (probe, view_probe):
                if head is not None:
                    heads.enter_context(head.attached(model.transformer))
            probes = (probe, view_probe)
            with clock.phase("loop"):
                _sft_loop(model, train, heldout, cfg, bar, g, opt, params, probes, curve, losses, window, aux_losses,
                          None if resume is None else after_step, clock, step_hook, average)  # fmt: skip
        if average is not None:  # the run ends with (and its caller saves) the average, not the last iterate
            with torch.no_grad():
                torch._foreach_copy_(params, average)
    finally:
        for module in encoders:
            freeze(module)
    model.eval()
    if encoders:
        with clock.phase("refresh_features"):
            refresh_features(model, train, cfg.train_encoders)
            refresh_features(model, heldout, cfg.train_encoders)
    with clock.phase("probes"):
        final = heldout_loss(model, heldout, cfg)
        gaps = {
            "instruction_gap": instruction_gap(model, heldout, cfg),
            "instruction_gap_pure_noise": instruction_gap(model, heldout, cfg, sigma=1.0),
            "goal_direction": None if probe is None else goal_direction_gap(model, probe, heldout, cfg),
            "goal_direction_pure_noise": None if probe is None else goal_direction_gap(model, probe, heldout, cfg, 1.0),
            "object_view": None if view_probe is None else object_view_gap(model, view_probe, heldout, cfg),
            "object_view_pure_noise": None
            if view_probe is None
            else object_view_gap(model, view_probe, heldout, cfg, 1.0),
        }
    return {
        "initial_heldout": initial,
        "final_heldout": final,
        **gaps,
        "timings": clock.report(cfg.steps - start + 1),
        "curve": curve,
        "train_losses": losses,
        "goal_aux_losses": aux_losses["goal"],
        "view_aux_losses": aux_losses["view"],
        "view_head": None if view_probe is None else view_probe.eval(),
    }


def fit_action_normalization(examples: list[ExpertExample]) -> ActionNormalization:
    """Action mean/std of the training examples (stop channel kept raw, see ``ActionNormalization``)."""
    return ActionNormalization.from_actions(np.stack([e.actions for e in examples]))
