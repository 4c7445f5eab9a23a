"""Expert examples encoded once for SFT: cached encoder features, raw encoder inputs and auxiliary targets.

One row per (example, instruction variant); the features of the frozen encoders are computed once on the training
device, and the raw inputs of the built-in encoders are kept beside them so that SFT can train those encoders
without decoding videos again (:func:`trained_features`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from verl_omni.data.actions import ActionNormalization

from .expert_data import ExpertExample
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
        goal_view: ``[N, 4]`` the goal object in the current frame per example (:func:`goal_probe.object_view_target`;
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


def trained_features(model: WNMModel, data: EncodedRows, rows: torch.Tensor, trained: tuple[str, ...]):
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
        h = torch.from_numpy(np.stack([e.history for e in chunk])).to(model.device)  # uint8, one copy for all users
        hist.append(model.encode_video(h))
        targ.append(model.encode_video(torch.from_numpy(np.stack([e.target for e in chunk]))))
        feats = model.encode_view_features(h)  # the text of every variant is encoded below, in one call
        image.append(feats["image"])
        if feats["geometry"] is not None:
            geometry.append(feats["geometry"])
        views.append(h[:, view_idx])
        # Every instruction variant of the chunk in one encoder call (one call per example cost more than the VAE).
        texts = [t for e in chunk for t in e.instructions]
        tok_ids, tok_mask = model.tokenizer(texts)  # tokenized once: the ids are kept for the trained text encoder
        text.append(model.encode_tokens(tok_ids, tok_mask))
        mask.append(tok_mask.to(model.device))
        ids.append(tok_ids.to(model.device))
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
        _, feats = trained_features(model, data, rows, trained)
        data.text[rows] = feats["text"]
        ex = data.row_example[rows]
        data.image[ex] = feats["image"]  # examples repeat over their rows; every copy is the same value
        if data.geometry is not None:
            data.geometry[ex] = feats["geometry"]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a fresh CPU tensor) on ``device`` without waiting for the device: a plain copy from pageable memory
    synchronizes the stream, which at several copies per SFT step leaves the GPU idle while the CPU prepares the
    next step. Pinned memory lets the copy queue behind the running kernels (torch's pinned-memory cache keeps
    the block alive until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def draw_noise(
    data: EncodedRows, rows: torch.Tensor, g: torch.Generator, sigma: torch.Tensor | None = None, move: bool = True
):
    """``(x0, a0, sigma, noise_video, noise_action)`` of ``rows``: their target latents and actions, noise levels
    (``sigma`` or uniform draws) and Gaussian noise, drawn from ``g`` on the CPU (``move=False`` leaves ``sigma``
    and the noise there, for the caller to mix and move with :func:`to_device`)."""
    # The CPU generator keeps draws identical on every device; they are moved to the data's device.
    dev = data.target_latents.device
    ex = data.row_example[to_device(rows, dev)]
    x0, a0 = data.target_latents[ex], data.actions[ex]
    if sigma is None:
        sigma = torch.rand(len(rows), generator=g)
    ev, ea = torch.randn(x0.shape, generator=g), torch.randn(a0.shape, generator=g)
    if not move:
        return x0, a0, sigma, ev, ea
    return x0, a0, to_device(sigma, dev), to_device(ev, dev), to_device(ea, dev)
