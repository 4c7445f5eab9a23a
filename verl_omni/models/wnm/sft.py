"""Flow-matching SFT of the joint DiT on expert data from a GN0 collection (a Stage-II stand-in).

Used by ``tools/checkpoint/make_tiny_wnm_checkpoint.py`` and the Stage-II driver ``scripts/train_stage2.py``
(which adds closed-loop DAgger rounds). Runs on any torch device: encoder outputs are cached once on the
training device and every step draws its rows and noise there.

Per query state t of an episode: history = ``rgb.mp4`` frames ``t-32 .. t`` (clamped at 0),
target = the 33 frames of ``ref_<t>.mp4``, expert actions = ``poses_to_actions(reference_poses,
reference_stop)``; one row per instruction variant. Whole episodes are held out for the held-out loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from verl_omni.data.actions import ActionNormalization, poses_to_actions

from .flow_matching import joint_flow_matching_loss
from .model import WNMModel


@dataclass
class ExpertExample:
    """One query state of the expert data.

    Attributes:
        episode_id: Source episode.
        history: uint8 ``[33, H, W, 3]``.
        target: uint8 ``[33, H, W, 3]``.
        actions: float64 ``[32, 4]`` raw expert actions.
        instructions: Instruction variants of the episode.
    """

    episode_id: str
    history: np.ndarray
    target: np.ndarray
    actions: np.ndarray
    instructions: tuple[str, ...]


def history_indices(t: int, frames: int) -> list[int]:
    """Frame indices ``t - frames + 1 .. t`` clamped at 0 (as the converted rows, :mod:`verl_omni.data.schema`)."""
    return [max(0, t - frames + 1 + i) for i in range(frames)]


def _episode_examples(job: tuple[str, str, int]) -> list[ExpertExample]:
    """The query states of one episode (a module-level function so process pools can pickle it)."""
    from verl_omni.data.gn0 import RecordRejected, parse_episode
    from verl_omni.data.video import read_frames

    root, episode_id, history_frames = job
    root = Path(root)
    try:
        ep = parse_episode(root, episode_id)
    except RecordRejected:
        return []  # the converter reports rejected records; SFT simply learns from the valid ones
    out = []
    # One forward decode of the episode video serves every query (a seek per query costs far more).
    last = max((q.t for q in ep.queries), default=-1)
    frames = read_frames(root / ep.video, list(range(last + 1))) if last >= 0 else None
    for q in ep.queries:
        history = frames[history_indices(q.t, history_frames)]
        target = read_frames(root / q.reference_video, list(range(len(q.reference_poses))))
        actions = poses_to_actions(q.reference_poses, q.reference_stop)
        out.append(ExpertExample(episode_id, history, target, actions, tuple(ep.instructions)))
    return out


def load_expert_examples(
    collection: str | Path,
    history_frames: int,
    image_size: tuple[int, int],
    progress: bool = True,
    workers: int = 1,
) -> list[ExpertExample]:
    """Reads every valid query of a GN0 collection (skipping rejected records), in episode order.

    Args:
        collection: Collection root.
        history_frames / image_size: What the model needs.
        progress: Show a progress bar.
        workers: Threads decoding episodes (video decoding dominates; results keep episode order).

    Raises:
        ValueError: the collection's image size differs from the model's (names both).
    """
    from concurrent.futures import ThreadPoolExecutor

    from verl_omni.data.gn0 import list_episode_ids, read_collection_info

    info = read_collection_info(collection)
    if tuple(info.image_size) != tuple(image_size):
        raise ValueError(
            f"{info.root / 'collection.json'}: field 'image_size' is {list(info.image_size)}, the model needs "
            f"{list(image_size)}; pick a matching --size or re-synthesize the collection"
        )
    jobs = [(str(info.root), eid, history_frames) for eid in list_episode_ids(info.root)]
    examples = []
    bar = tqdm(total=len(jobs), desc="read episodes", disable=not progress)
    if workers <= 1:
        for job in jobs:
            examples.extend(_episode_examples(job))
            bar.update()
    else:
        # Threads, not processes: the video decoders release the GIL, and decoded frames (about 0.8 MB per
        # query state) would otherwise be pickled back through pipes, which costs more than the decoding.
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            for part in pool.map(_episode_examples, jobs):  # map keeps episode order
                examples.extend(part)
                bar.update()
    bar.close()
    if not examples:
        raise ValueError(f"{info.root}: no valid query records")
    return examples


def subsample(examples: list[ExpertExample], max_examples: int) -> list[ExpertExample]:
    """At most ``max_examples`` examples, evenly spaced over the (episode-ordered) list."""
    if len(examples) <= max_examples:
        return examples
    keep = np.linspace(0, len(examples) - 1, max_examples).round().astype(int)
    return [examples[i] for i in keep]


def split_by_episode(examples: list[ExpertExample], heldout_fraction: float, seed: int):
    """Holds out whole episodes (at least one, at most all but one). Returns ``(train, heldout)``."""
    episodes = sorted({e.episode_id for e in examples})
    if len(episodes) < 2:
        raise ValueError(f"need >= 2 episodes to hold one out, the collection has {len(episodes)}")
    order = np.random.default_rng(seed).permutation(len(episodes))
    n_held = min(len(episodes) - 1, max(1, round(heldout_fraction * len(episodes))))
    held = {episodes[i] for i in order[:n_held]}
    return [e for e in examples if e.episode_id not in held], [e for e in examples if e.episode_id in held]


@dataclass
class EncodedRows:
    """Frozen-encoder outputs of examples, one row per (example, instruction variant).

    Attributes:
        history_latents / target_latents: ``[N, C, T', h, w]`` per example.
        actions: ``[N, 32, 4]`` normalized actions per example.
        row_example: ``[R]`` example index of each row.
        text / text_mask: ``[R, Lt, text_dim]`` / ``[R, Lt]`` per row.
        image / geometry: ``[N, Li, image_dim]`` / ``[N, Lg, geometry_dim]`` (or None) per example.
    """

    history_latents: torch.Tensor
    target_latents: torch.Tensor
    actions: torch.Tensor
    row_example: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor
    image: torch.Tensor
    geometry: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.row_example.shape[0]

    def to(self, device) -> EncodedRows:
        """A copy with every tensor on ``device`` (training draws its rows there)."""
        return EncodedRows(
            **{k: None if v is None else v.to(device) for k, v in self.__dict__.items()}  # all fields are tensors
        )

    def features(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """History latents and encoder features of the given rows."""
        ex = self.row_example[rows]
        feats = {
            "text": self.text[rows],
            "text_mask": self.text_mask[rows],
            "image": self.image[ex],
            "geometry": None if self.geometry is None else self.geometry[ex],
        }
        return self.history_latents[ex], feats


@torch.no_grad()
def encode_examples(
    model: WNMModel, examples: list[ExpertExample], batch: int = 8, progress: bool = True, calibrate: bool = False
) -> EncodedRows:
    """Runs the frozen encoders once over all examples.

    With ``calibrate`` the model's latent statistics are first set from these examples' target clips
    (per-channel mean/std of the raw VAE latents), which a randomly initialised tiny VAE needs; the clips are
    encoded only once either way.
    """
    if calibrate:
        model.set_latent_statistics([0.0] * model.config.latent_channels, [1.0] * model.config.latent_channels)
    hist, targ, image, geometry, text, mask, row_ex = [], [], [], [], [], [], []
    for i in tqdm(range(0, len(examples), batch), desc="encode", disable=not progress):
        chunk = examples[i : i + batch]
        h = torch.from_numpy(np.stack([e.history for e in chunk]))
        hist.append(model.encode_video(h))
        targ.append(model.encode_video(torch.from_numpy(np.stack([e.target for e in chunk]))))
        feats = model.encode_condition_features(h, [e.instructions[0] for e in chunk])
        image.append(feats["image"])
        if feats["geometry"] is not None:
            geometry.append(feats["geometry"])
        for j, e in enumerate(chunk):
            t, m = model.encode_text(list(e.instructions))
            text.append(t)
            mask.append(m)
            row_ex += [i + j] * len(e.instructions)
    actions = np.stack([e.actions for e in examples])
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
        actions=model.action_normalization.normalize(torch.from_numpy(actions).float()),
        row_example=torch.tensor(row_ex),
        text=torch.cat(text),
        text_mask=torch.cat(mask),
        image=torch.cat(image),
        geometry=torch.cat(geometry) if geometry else None,
    )


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
    """

    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    action_weight: float = 1.0
    eval_every: int = 25
    eval_rows: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SFTConfig.lr: must be a positive number, got {self.lr}")
        if self.weight_decay < 0 or self.action_weight < 0:
            raise ValueError("SFTConfig.weight_decay and SFTConfig.action_weight must be >= 0")


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
        hist, feats = data.features(chunk.to(data.row_example.device))
        ctx = model.context_from_features(hist, feats)
        loss, parts = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
        w = len(chunk) / len(rows)
        totals["loss"] += loss.item() * w
        totals["video"] += parts["video"] * w
        totals["action"] += parts["action"] * w
    model.transformer.train(was_training)
    return totals


def train_sft(model: WNMModel, train: EncodedRows, heldout: EncodedRows, cfg: SFTConfig, progress: bool = True) -> dict:
    """AdamW flow-matching training of ``model.transformer``.

    Returns:
        ``{"initial_heldout", "final_heldout", "curve": [(step, train_loss_avg, heldout_loss)], "train_losses"}``.
    """
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.transformer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    initial = heldout_loss(model, heldout, cfg)
    curve, losses, window = [(0, None, initial["loss"])], [], []
    model.train()
    bar = tqdm(range(1, cfg.steps + 1), desc="sft", disable=not progress)
    for step in bar:
        rows = torch.randint(0, train.rows, (cfg.batch_size,), generator=g)
        x0, a0, s, ev, ea = _draw(train, rows, g)
        hist, feats = train.features(rows.to(train.row_example.device))
        ctx = model.context_from_features(hist, feats)  # projectors train; encoder features are fixed
        loss, _ = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, cfg.action_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.transformer.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        window.append(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            held = heldout_loss(model, heldout, cfg)["loss"]
            curve.append((step, float(np.mean(window)), held))
            window = []
            bar.set_postfix(train=f"{curve[-1][1]:.3f}", heldout=f"{held:.3f}")
    model.eval()
    final = heldout_loss(model, heldout, cfg)
    return {"initial_heldout": initial, "final_heldout": final, "curve": curve, "train_losses": losses}


def fit_action_normalization(examples: list[ExpertExample]) -> ActionNormalization:
    """Action mean/std of the training examples (stop channel kept raw, see ``ActionNormalization``)."""
    return ActionNormalization.from_actions(np.stack([e.actions for e in examples]))
