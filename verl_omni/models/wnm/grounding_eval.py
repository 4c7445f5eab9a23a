"""Does a Stage-II model read its instruction? Held-out measurements with each row's own instruction and another's.

Every measurement runs the same rows, noise and noise levels twice: once with the row's own instruction and once
with that of another example naming a different goal (:func:`swap_partners`). A model that grounds its instruction
answers worse with the swapped one; a model that ignores it scores the same. ``sigma = 1`` puts every row at pure
noise, where the noisy target clip and actions carry nothing and only the history and the instruction can inform
the answer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .encoded_rows import EncodedRows, draw_noise, trained_features
from .flow_matching import joint_flow_matching_loss
from .goal_probe import DISTANCE_SCALE_M, GoalProbe, ObjectViewProbe, bearing_error_deg
from .model import WNMModel

if TYPE_CHECKING:  # annotations only: the measurements read cfg.eval_rows and cfg.action_weight
    from .sft import SFTConfig


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
    """Chunks of the own-versus-swapped instruction comparison shared by the measurements of this module.

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
        x0, a0, s, ev, ea = draw_noise(data, chunk, g, sigmas[pos])
        hist, feats = trained_features(model, data, chunk.to(dev), ())
        _, feats_other = trained_features(model, data, chunk_other.to(dev), ())
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
        "bearing_error_deg_swapped", "distance_error_m", "distance_error_m_swapped"`` (mean absolute, on rows where
        the object is drawn; NaN if none) ``, "gap"`` (accuracy own minus swapped)``}``.
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
        reach = (pred[visible, 3] - target[visible, 3]).abs() * DISTANCE_SCALE_M
        out[f"distance_error_m{key}"] = float(reach.mean()) if visible.any() else math.nan
    share = float(visible.float().mean())
    out["base_rate"] = max(share, 1.0 - share)
    out["gap"] = out["visible_accuracy"] - out["visible_accuracy_swapped"]
    return out
