"""Flow-matching SFT of the joint DiT on expert data from a GN0 collection (a Stage-II stand-in).

Used by ``tools/checkpoint/make_tiny_wnm_checkpoint.py`` and the Stage-II driver ``scripts/train_stage2.py``
(which adds closed-loop DAgger rounds). Runs on any torch device: encoder outputs are cached once on the
training device and every step draws its rows and noise there.

The expert examples (one per query state, :mod:`.expert_data`) become one row per instruction variant; whole
episodes are held out for the held-out loss. An optional auxiliary goal-direction loss (:mod:`.goal_probe`)
trains with the flow-matching loss.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from verl_omni.data.actions import ActionNormalization

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
from .goal_probe import GoalProbe, ObjectViewProbe, bearing_error_deg
from .model import WNMModel


@dataclass
class EncodedRows:
    """Frozen-encoder outputs of examples, one row per (example, instruction variant).

    The raw encoder inputs (token ids, the history views) are kept beside the features so that SFT can train
    the built-in encoders (``SFTConfig.train_encoders``) without decoding the videos again.

    Attributes:
        history_latents / target_latents: ``[N, C, T', h, w]`` per example.
        actions: ``[N, 32, 4]`` normalized actions per example.
        row_example: ``[R]`` example index of each row.
        text / text_mask: ``[R, Lt, text_dim]`` / ``[R, Lt]`` per row.
        image / geometry: ``[N, Li, image_dim]`` / ``[N, Lg, geometry_dim]`` (or None) per example.
        text_ids: ``[R, Lt]`` long token ids per row.
        views: uint8 ``[N, V, H, W, 3]`` history frames at :func:`condition_view_indices` per example; the
            last one is the current view.
        goal_polar: ``[N, 3]`` goal bearing/distance targets per example (None when an example lacks one).
        goal_view: ``[N, 3]`` the goal object in the current frame per example (:func:`goal_probe.object_view_target`;
            None when an example lacks one).
    """

    history_latents: torch.Tensor
    target_latents: torch.Tensor
    actions: torch.Tensor
    row_example: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor
    image: torch.Tensor
    geometry: torch.Tensor | None
    text_ids: torch.Tensor
    views: torch.Tensor
    goal_polar: torch.Tensor | None = None
    goal_view: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.row_example.shape[0]

    @property
    def examples(self) -> int:
        return self.history_latents.shape[0]

    def to(self, device) -> EncodedRows:
        """A copy with every tensor on ``device`` (training draws its rows there)."""
        return EncodedRows(
            **{k: None if v is None else v.to(device) for k, v in self.__dict__.items()}  # all fields are tensors
        )

    @classmethod
    def concat(cls, parts: list[EncodedRows]) -> EncodedRows:
        """Rows of several encodings (e.g. DAgger rounds) as one; ``row_example`` is re-offset."""
        if not parts:
            raise ValueError("EncodedRows.concat: nothing to concatenate")
        fields = {}
        for name in cls.__dataclass_fields__:
            values = [getattr(p, name) for p in parts]
            if name == "row_example":
                offsets = np.cumsum([0] + [p.examples for p in parts[:-1]])
                values = [v + int(o) for v, o in zip(values, offsets, strict=True)]
            fields[name] = None if any(v is None for v in values) else torch.cat(values)
        return cls(**fields)

    def features(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """History latents and cached encoder features of the given rows."""
        ex = self.row_example[rows]
        feats = {
            "text": self.text[rows],
            "text_mask": self.text_mask[rows],
            "image": self.image[ex],
            "geometry": None if self.geometry is None else self.geometry[ex],
        }
        return self.history_latents[ex], feats


def condition_view_indices(model: WNMModel) -> list[int]:
    """History frame indices the image and geometry encoders look at (the newest frame last)."""
    last = model.config.history_frames - 1
    indices = getattr(model.geometry_encoder, "frame_indices", None)
    return list(indices) if indices else [last]


def _trained_features(model: WNMModel, data: EncodedRows, rows: torch.Tensor, trained: tuple[str, ...]):
    """History latents and features of ``rows``: the ``trained`` encoders run on the raw inputs (with grad),
    the others come from the cache."""
    hist, feats = data.features(rows)
    ex = data.row_example[rows]
    if "text_encoder" in trained:
        feats["text"] = model.text_encoder(data.text_ids[rows], data.text_mask[rows]).float()
    if "image_encoder" in trained:
        feats["image"] = model.image_encoder(data.views[ex][:, -1]).float()
    if "geometry_encoder" in trained:
        feats["geometry"] = model.geometry_encoder.encode_views(data.views[ex]).float()
    return hist, feats


@torch.no_grad()
def encode_examples(
    model: WNMModel,
    examples: Iterable[ExpertExample],
    batch: int = 8,
    progress: bool = True,
    calibrate: bool = False,
    fit_normalization: bool = False,
) -> EncodedRows:
    """Runs the frozen encoders once over all examples (any iterable: decoding and encoding stream together).

    Args:
        model: The model whose encoders run.
        examples: Expert examples (e.g. :func:`iter_expert_examples`).
        batch: Examples per encoder call.
        progress: Show a progress bar.
        calibrate: First set the model's latent statistics from these examples' target clips (per-channel
            mean/std of the raw VAE latents), which a randomly initialised tiny VAE needs; the clips are encoded
            only once either way.
        fit_normalization: Set ``model.action_normalization`` from these examples' actions
            (:func:`fit_action_normalization`) before normalizing them.
    """
    if calibrate:
        model.set_latent_statistics([0.0] * model.config.latent_channels, [1.0] * model.config.latent_channels)
    view_idx = condition_view_indices(model)
    hist, targ, image, geometry, text, mask, ids, views, actions, row_ex, polar, in_view = ([] for _ in range(12))
    n = 0

    def flush(chunk: list[ExpertExample]) -> None:
        nonlocal n
        h = torch.from_numpy(np.stack([e.history for e in chunk]))
        hist.append(model.encode_video(h))
        targ.append(model.encode_video(torch.from_numpy(np.stack([e.target for e in chunk]))))
        feats = model.encode_condition_features(h, [e.instructions[0] for e in chunk])
        image.append(feats["image"])
        if feats["geometry"] is not None:
            geometry.append(feats["geometry"])
        views.append(h[:, view_idx])
        # Every instruction variant of the chunk in one encoder call (one call per example cost more than the VAE).
        texts = [t for e in chunk for t in e.instructions]
        tok_ids, _ = model.tokenizer(texts)
        t, m = model.encode_text(texts)
        text.append(t)
        mask.append(m)
        ids.append(tok_ids.to(m.device))
        for j, e in enumerate(chunk):
            row_ex.extend([n + j] * len(e.instructions))
            actions.append(e.actions)
            polar.append(e.goal_polar)
            in_view.append(e.goal_view)
        n += len(chunk)

    chunk: list[ExpertExample] = []
    bar = tqdm(desc="encode", unit="state", disable=not progress)
    for e in examples:
        chunk.append(e)
        if len(chunk) == batch:
            flush(chunk)
            bar.update(len(chunk))
            chunk = []
    if chunk:
        flush(chunk)
        bar.update(len(chunk))
    bar.close()
    if n == 0:
        raise ValueError("encode_examples: no examples")
    raw_actions = np.stack(actions)
    if fit_normalization:
        model.action_normalization = ActionNormalization.from_actions(raw_actions)
    hist, targ = torch.cat(hist), torch.cat(targ)
    if calibrate:
        z = targ.transpose(0, 1).flatten(1)  # [C, everything]
        mean, std = z.mean(1), z.std(1).clamp_min(1e-3)
        model.set_latent_statistics(mean.tolist(), std.tolist())
        hist = (hist - model.latents_mean) / model.latents_std
        targ = (targ - model.latents_mean) / model.latents_std
    return EncodedRows(
        history_latents=hist,
        target_latents=targ,
        actions=model.action_normalization.normalize(torch.from_numpy(raw_actions).float()).to(hist.device),
        row_example=torch.tensor(row_ex, device=hist.device),
        text=torch.cat(text),
        text_mask=torch.cat(mask),
        image=torch.cat(image),
        geometry=torch.cat(geometry) if geometry else None,
        text_ids=torch.cat(ids),
        views=torch.cat(views).to(hist.device),
        goal_polar=_stacked_or_none(polar, hist.device),
        goal_view=_stacked_or_none(in_view, hist.device),
    )


def _stacked_or_none(values: list[np.ndarray | None], device) -> torch.Tensor | None:
    return None if any(v is None for v in values) else torch.from_numpy(np.stack(values)).to(device)


@torch.no_grad()
def refresh_features(model: WNMModel, data: EncodedRows, trained: tuple[str, ...], batch: int = 256) -> None:
    """Recomputes the cached features of the ``trained`` encoders in place, with their current weights.

    Needed after SFT trained an encoder: the cache must describe the encoders saved with the checkpoint.
    """
    for start in range(0, data.rows, batch):
        rows = torch.arange(start, min(start + batch, data.rows), device=data.row_example.device)
        _, feats = _trained_features(model, data, rows, trained)
        data.text[rows] = feats["text"]
        ex = data.row_example[rows]
        data.image[ex] = feats["image"]  # examples repeat over their rows; every copy is the same value
        if data.geometry is not None:
            data.geometry[ex] = feats["geometry"]


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_encoders", tuple(self.train_encoders))
        unknown = sorted(set(self.train_encoders) - set(TRAINABLE_ENCODERS))
        if unknown:
            raise ValueError(f"SFTConfig.train_encoders: unknown {unknown}; choose from {list(TRAINABLE_ENCODERS)}")
        for name in ("steps", "batch_size", "eval_every", "eval_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SFTConfig.lr: must be a positive number, got {self.lr}")
        if self.weight_decay < 0 or self.action_weight < 0 or not self.goal_aux_weight >= 0:
            raise ValueError("SFTConfig.weight_decay, action_weight and goal_aux_weight must be >= 0")
        if not (self.view_aux_weight >= 0 and math.isfinite(self.view_aux_weight)):
            raise ValueError(f"SFTConfig.view_aux_weight: must be a number >= 0, got {self.view_aux_weight}")
        for name in ("independent_action_noise", "goal_aux_pure_noise"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SFTConfig.{name}: must be in [0, 1], got {getattr(self, name)}")


def _draw(data: EncodedRows, rows: torch.Tensor, g: torch.Generator, sigma: torch.Tensor | None = None):
    # The CPU generator keeps draws identical on every device; they are moved to the data's device.
    dev = data.target_latents.device
    rows = rows.to(dev)
    ex = data.row_example[rows]
    x0, a0 = data.target_latents[ex], data.actions[ex]
    if sigma is None:
        sigma = torch.rand(len(rows), generator=g)
    ev, ea = torch.randn(x0.shape, generator=g), torch.randn(a0.shape, generator=g)
    return x0, a0, sigma.to(dev), ev.to(dev), ea.to(dev)


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
        hist, feats = _trained_features(model, data, chunk.to(data.row_example.device), cfg.train_encoders)
        ctx = model.context_from_features(hist, feats)
        loss, parts = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
        w = len(chunk) / len(rows)
        totals["loss"] += loss.item() * w
        totals["video"] += parts["video"] * w
        totals["action"] += parts["action"] * w
    model.transformer.train(was_training)
    return totals


@torch.no_grad()
def swap_partners(data: EncodedRows, rows: torch.Tensor) -> torch.Tensor:
    """``[n]`` partners of ``rows [n]``: from half the set away on (cyclically), the first row of another example
    with other token ids (a fixed offset alone can land on the same goal and swap nothing); a row without any
    such partner keeps itself."""
    total, ids, example = data.rows, data.text_ids.cpu(), data.row_example.cpu()
    out = []
    for r in rows.tolist():
        cands = ((r + step) % total for step in range(total // 2, total // 2 + total))
        out.append(next((o for o in cands if example[o] != example[r] and not torch.equal(ids[o], ids[r])), r))
    return torch.tensor(out, dtype=torch.long)


def _evaluation_rows(data: EncodedRows, cfg: SFTConfig) -> torch.Tensor:
    """``[n]`` rows spread evenly over the whole set (rows come in episode order)."""
    n = min(cfg.eval_rows, data.rows)
    return torch.linspace(0, data.rows - 1, n).round().long()


@torch.no_grad()
def _paired_contexts(model: WNMModel, data: EncodedRows, cfg: SFTConfig, sigma: float | None):
    """Chunks of the own-versus-swapped instruction comparison shared by the two gap measurements.

    Yields, per chunk of up to 16 of :func:`_evaluation_rows`: ``(pos [c], x0, a0, sigma [c], noise_video,
    noise_action, (context_own, context_swapped))``, with the same fixed noise for both contexts; the swapped
    context differs only in its text tokens (those of :func:`swap_partners`). ``sigma`` None gives stratified
    noise levels, a float puts every row at that level.
    """
    g = torch.Generator().manual_seed(54321)
    rows = _evaluation_rows(data, cfg)
    n = len(rows)
    other = swap_partners(data, rows)
    sigmas = (torch.arange(n) + 0.5) / n if sigma is None else torch.full((n,), float(sigma))
    dev = data.row_example.device
    for pos in torch.arange(n).split(16):
        chunk, chunk_other = rows[pos], other[pos]
        x0, a0, s, ev, ea = _draw(data, chunk, g, sigmas[pos])
        hist, feats = _trained_features(model, data, chunk.to(dev), ())
        _, feats_other = _trained_features(model, data, chunk_other.to(dev), ())
        contexts = tuple(
            model.context_from_features(hist, {**feats, "text": text["text"], "text_mask": text["text_mask"]})
            for text in (feats, feats_other)
        )
        yield pos, x0, a0, s, ev, ea, contexts


@torch.no_grad()
def instruction_gap(model: WNMModel, data: EncodedRows, cfg: SFTConfig, sigma: float | None = None) -> dict[str, float]:
    """Held-out action loss with each row's own instruction and with the instruction of another row.

    Same rows, noise and sigmas for both. The ``cfg.eval_rows`` rows are spread evenly over the whole set
    (rows come in episode order, so the first rows would be a few episodes only), and each is paired with
    :func:`swap_partners` (another example's, different, instruction). A model that reads its instruction loses
    accuracy when it is swapped (``gap > 0``); a model that ignores it scores the same.

    ``sigma`` puts every row at one noise level instead of stratified ones. At ``sigma = 1`` the noisy target
    video and actions are pure noise, so the history and the instruction are all the model has: the policy's
    own knowledge, without the expert's future leaking in through a barely noisy target (at low noise the
    actions can be read off the target video).

    Returns:
        ``{"action": loss with the own instruction, "action_swapped": with another's, "gap": their difference}``.
    """
    was_training = model.transformer.training
    model.transformer.eval()
    totals = {"action": 0.0, "action_swapped": 0.0}
    n = min(cfg.eval_rows, data.rows)
    for pos, x0, a0, s, ev, ea, contexts in _paired_contexts(model, data, cfg, sigma):
        for key, ctx in zip(("action", "action_swapped"), contexts):
            _, parts = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
            totals[key] += parts["action"] * len(pos) / n
    model.transformer.train(was_training)
    totals["gap"] = totals["action_swapped"] - totals["action"]
    return totals


@torch.no_grad()
def goal_direction_gap(
    model: WNMModel, probe: GoalProbe, data: EncodedRows, cfg: SFTConfig, sigma: float | None = None
) -> dict[str, float]:
    """Held-out goal-bearing error of the goal-direction head with each row's own instruction and another's.

    The grounding test that the action loss cannot give: the head must say where the *named* object is, so a
    model that finds it in the views answers better with its own instruction than with one naming another
    object (``gap > 0``), and a model that ignores the instruction scores the same with both. Rows, pairing,
    noise and sigmas as :func:`instruction_gap`. ``constant`` is the error of always answering the held-out rows'
    mean bearing (what a head that learned nothing conditional gets at best). ``sigma`` as
    :func:`instruction_gap`: at 1, the bearing must come from the history and the instruction alone.

    Returns:
        ``{"bearing_error_deg", "bearing_error_deg_swapped", "gap", "constant"}`` (mean absolute degrees).
    """
    was_training = model.transformer.training
    model.transformer.eval()
    dev = data.row_example.device
    target = data.goal_polar[data.row_example[_evaluation_rows(data, cfg).to(dev)]].float()
    errors: dict[str, list[torch.Tensor]] = {"bearing_error_deg": [], "bearing_error_deg_swapped": []}
    with probe.attached(model.transformer):
        for pos, x0, a0, s, ev, ea, contexts in _paired_contexts(model, data, cfg, sigma):
            for key, ctx in zip(("bearing_error_deg", "bearing_error_deg_swapped"), contexts):
                joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
                errors[key].append(bearing_error_deg(probe.predict(), target[pos.to(dev)]))
    model.transformer.train(was_training)
    out = {k: float(torch.cat(v).mean()) for k, v in errors.items()}
    out["gap"] = out["bearing_error_deg_swapped"] - out["bearing_error_deg"]
    mean_direction = target[:, :2].mean(0, keepdim=True).expand(len(target), 2)
    out["constant"] = float(bearing_error_deg(mean_direction, target).mean())
    return out


@torch.no_grad()
def object_view_gap(
    model: WNMModel, probe: ObjectViewProbe, data: EncodedRows, cfg: SFTConfig, sigma: float | None = None
) -> dict[str, float]:
    """Held-out view grounding of the :class:`ObjectViewProbe` head with each row's own instruction and another's.

    Whether the named object is drawn in the current frame, and where, is decided by the current view and the
    instruction alone, so a grounded model answers it well with its own instruction and badly with one naming
    another object; a model that ignores the instruction scores the same with both. Rows, pairing, noise and
    sigmas as :func:`instruction_gap`.

    Returns:
        ``{"visible_accuracy", "visible_accuracy_swapped"`` (share of rows whose visibility logit has the right
        sign) ``, "base_rate"`` (accuracy of always answering the majority class) ``, "bearing_error_deg",
        "bearing_error_deg_swapped"`` (on rows where the object is drawn; NaN if none) ``, "gap"`` (accuracy own
        minus swapped)``}``.
    """
    was_training = model.transformer.training
    model.transformer.eval()
    dev = data.row_example.device
    target = data.goal_view[data.row_example[_evaluation_rows(data, cfg).to(dev)]].float()
    keys = ("", "_swapped")
    preds: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    with probe.attached(model.transformer):
        for _pos, x0, a0, s, ev, ea, contexts in _paired_contexts(model, data, cfg, sigma):
            for key, ctx in zip(keys, contexts):
                joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
                preds[key].append(probe.predict().float())
    model.transformer.train(was_training)
    visible = target[:, 0] > 0.5
    out: dict[str, float] = {}
    for key in keys:
        pred = torch.cat(preds[key])
        out[f"visible_accuracy{key}"] = float(((pred[:, 0] > 0) == visible).float().mean())
        err = bearing_error_deg(pred[visible, 1:], target[visible, 1:])
        out[f"bearing_error_deg{key}"] = float(err.mean()) if visible.any() else math.nan
    share = float(visible.float().mean())
    out["base_rate"] = max(share, 1.0 - share)
    out["gap"] = out["visible_accuracy"] - out["visible_accuracy_swapped"]
    return out


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


def _sft_loop(model, train, heldout, cfg, bar, g, opt, params, probes, curve, losses, window, aux_losses) -> None:
    """The optimizer steps of :func:`train_sft` (appends to ``curve``, ``losses``, ``window``, ``aux_losses``)."""
    probe, view_probe = probes
    for step in bar:
        rows = torch.randint(0, train.rows, (cfg.batch_size,), generator=g)
        x0, a0, s, ev, ea = _draw(train, rows, g)
        pure = None
        if probe is not None and cfg.goal_aux_pure_noise > 0:  # drawn only when on (old random stream when off)
            pure = torch.rand(len(rows), generator=g) < cfg.goal_aux_pure_noise
            s = torch.where(pure.to(s.device), torch.ones_like(s), s)
        sa = None
        if cfg.independent_action_noise > 0:  # drawn only when on, so that off keeps the old random stream
            own = torch.rand(len(rows), generator=g) < cfg.independent_action_noise
            sa = torch.where(own, torch.rand(len(rows), generator=g), s.cpu()).to(s.device)
            if pure is not None:  # the goal head's rows stay at pure noise for the actions too
                sa = torch.where(pure.to(s.device), torch.ones_like(sa), sa)
        rows = rows.to(train.row_example.device)
        hist, feats = _trained_features(model, train, rows, cfg.train_encoders)
        ctx = model.context_from_features(hist, feats)  # projectors train; frozen encoders' features are fixed
        loss, _ = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight, sa)
        total = loss
        if probe is not None:  # reads the hidden state recorded by the forward just above
            aux = probe.loss(train.goal_polar[train.row_example[rows]], pure)
            total = loss + cfg.goal_aux_weight * aux
            aux_losses["goal"].append(aux.item())
        if view_probe is not None:  # same recorded forward; every row counts
            aux = view_probe.loss(train.goal_view[train.row_example[rows]])
            total = total + cfg.view_aux_weight * aux
            aux_losses["view"].append(aux.item())
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        window.append(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            held = heldout_loss(model, heldout, cfg)["loss"]
            curve.append((step, float(np.mean(window)), held))
            window.clear()
            bar.set_postfix(train=f"{curve[-1][1]:.3f}", heldout=f"{held:.3f}")


def train_sft(model: WNMModel, train: EncodedRows, heldout: EncodedRows, cfg: SFTConfig, progress: bool = True) -> dict:
    """AdamW flow-matching training of ``model.transformer`` (and of the ``cfg.train_encoders``).

    Trained encoders are frozen again at the end and the cached features of ``train`` and ``heldout`` are
    recomputed with their new weights.

    Returns:
        ``{"initial_heldout", "final_heldout", "instruction_gap"`` (:func:`instruction_gap` of the held-out rows)
        ``, "instruction_gap_pure_noise"`` (at sigma 1) ``, "goal_direction"`` (:func:`goal_direction_gap`, None
        without the goal head) ``, "goal_direction_pure_noise"`` (at sigma 1) ``, "object_view"``
        (:func:`object_view_gap`, None without the view head) ``, "object_view_pure_noise"`` (at sigma 1) ``,
        "curve": [(step, train_loss_avg, heldout_loss)], "train_losses", "goal_aux_losses", "view_aux_losses"}``
        (the last two empty unless their head is on).
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
        view_probe = ObjectViewProbe(model.config.dim).to(train.goal_view.device)
        params += list(view_probe.parameters())
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    initial = heldout_loss(model, heldout, cfg)
    curve, losses, window, aux_losses = [(0, None, initial["loss"])], [], [], {"goal": [], "view": []}
    model.train()  # frozen parts stay in eval mode; the built-in encoders have no dropout or batch norm
    bar = tqdm(range(1, cfg.steps + 1), desc="sft", disable=not progress)
    try:
        with contextlib.ExitStack() as heads:
            for head in (probe, view_probe):
                if head is not None:
                    heads.enter_context(head.attached(model.transformer))
            probes = (probe, view_probe)
            _sft_loop(model, train, heldout, cfg, bar, g, opt, params, probes, curve, losses, window, aux_losses)
    finally:
        for module in encoders:
            freeze(module)
    model.eval()
    if encoders:
        refresh_features(model, train, cfg.train_encoders)
        refresh_features(model, heldout, cfg.train_encoders)
    final = heldout_loss(model, heldout, cfg)
    return {
        "initial_heldout": initial,
        "final_heldout": final,
        "instruction_gap": instruction_gap(model, heldout, cfg),
        "instruction_gap_pure_noise": instruction_gap(model, heldout, cfg, sigma=1.0),
        "goal_direction": None if probe is None else goal_direction_gap(model, probe, heldout, cfg),
        "goal_direction_pure_noise": None if probe is None else goal_direction_gap(model, probe, heldout, cfg, 1.0),
        "object_view": None if view_probe is None else object_view_gap(model, view_probe, heldout, cfg),
        "object_view_pure_noise": None if view_probe is None else object_view_gap(model, view_probe, heldout, cfg, 1.0),
        "curve": curve,
        "train_losses": losses,
        "goal_aux_losses": aux_losses["goal"],
        "view_aux_losses": aux_losses["view"],
    }


def fit_action_normalization(examples: list[ExpertExample]) -> ActionNormalization:
    """Action mean/std of the training examples (stop channel kept raw, see ``ActionNormalization``)."""
    return ActionNormalization.from_actions(np.stack([e.actions for e in examples]))
