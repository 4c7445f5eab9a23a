"""A learned STOP gate: STOP only where the view head sees the named object within stopping distance.

Why: STOP ends an episode for good, and the flow-matched stop channel of the action chunk is a draw from the
model's belief about where the expert would stop. Measured on Stage-II checkpoints, that belief fires about 1.7
m short of the goal (median) in most episodes, while the view-grounding head trained beside it
(:class:`.goal_probe.ObjectViewProbe`) tells the named object's distance to about 0.3 m from the history and the
instruction alone. The gate keeps that head with the checkpoint (``stop_gate/``) and lets a sampled STOP through
only when the head says the object is in view and no farther than ``stop_distance_m``, the distance at which the
expert itself stops (fitted on the training rows). It decides nothing else: motion is always the DiT's.

Layout of ``stop_gate/`` in a checkpoint: ``config.json`` ``{"kind": "object_view", "dim", "stop_distance_m",
"quantile", "within_steps"}`` and ``model.safetensors`` (the head's weights); both are listed in the checkpoint
manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from verl_omni.contracts import CONFIG_NAME, MANIFEST_NAME, CheckpointError, read_manifest, verify_files

from .goal_probe import DISTANCE_SCALE_M, ObjectViewProbe

GATE_DIR = "stop_gate"
GATE_WEIGHTS = "model.safetensors"
GATE_KIND = "object_view"
FIT_LABELS = "expert_stop_labels"
FIT_PREDICTIONS = "predictions_at_goal"


def fit_stop_distance(
    actions: torch.Tensor, goal_view: torch.Tensor, quantile: float = 0.9, within_steps: int = 8
) -> float:
    """Metres from the named object within which the expert issues STOP (a quantile over its STOP states).

    Args:
        actions: ``[N, S, 4]`` expert action chunks (stop channel raw, 1 = STOP at that step).
        goal_view: ``[N, 4]`` :func:`.goal_probe.object_view_target` of the same states.
        quantile: Share of the expert's visible STOP states that the gate must let through.
        within_steps: A STOP state is one whose chunk stops within its first ``within_steps`` steps (the steps a
            closed-loop call executes).

    Raises:
        ValueError: no state where the expert stops at once with the object in view (the gate cannot be fitted;
            collect with the expert facing the object before STOP, ``--face-goal-object``).
    """
    stop_soon = (actions[:, :within_steps, 3] > 0.5).any(1)
    visible = goal_view[:, 0] > 0.5
    rows = stop_soon & visible
    if not bool(rows.any()):
        raise ValueError(
            "fit_stop_distance: no training state where the expert stops with the named object in view; collect "
            "with --face-goal-object so that the expert faces the object before STOP"
        )
    return float(torch.quantile(goal_view[rows, 3].double() * DISTANCE_SCALE_M, quantile))


def calibrate_stop_distance(
    predicted_m: np.ndarray,
    visible_logit: np.ndarray,
    geodesic_m: np.ndarray,
    success_radius: np.ndarray | float,
    quantile: float = 0.9,
) -> float:
    """Stopping distance fitted on the head's own predictions at states where a STOP would succeed.

    Why: :func:`fit_stop_distance` takes a quantile of the *label* distance over every state whose expert chunk
    stops within ``within_steps`` (8) steps, i.e. states up to about 2 m before the STOP pose, and the gate then
    compares the head's *prediction* with it. Measured on Stage-II checkpoints, that lets through most STOPs
    asked 0.5-1 m short of the goal radius. This fit uses the quantity the gate compares (the prediction) at the
    states where the evaluator counts a STOP as success (geodesic distance within the success radius), on states
    an expert reaches in closed loop (``tools/eval/stop_probe.py`` on a validation seed).

    Args:
        predicted_m: ``[N]`` the head's predicted distance to the named object (:func:`predicted_distance_m`).
        visible_logit: ``[N]`` the head's in-view logit (the gate needs > 0 anyway).
        geodesic_m: ``[N]`` true geodesic distance from the robot to the goal.
        success_radius: ``[N]`` or scalar success radius of each state's episode, metres.
        quantile: Share of the visible at-goal states whose STOP the gate must let through.

    Returns:
        The ``quantile`` of ``predicted_m`` over states with ``geodesic_m <= success_radius`` and a positive
        logit (linear interpolation, as :func:`torch.quantile`).

    Raises:
        ValueError: a quantile outside (0, 1], arrays of different lengths, or no visible at-goal state.
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"calibrate_stop_distance: quantile must be in (0, 1], got {quantile!r}")
    predicted_m, visible_logit, geodesic_m = (np.asarray(a, np.float64) for a in (predicted_m, visible_logit,
                                                                                    geodesic_m))  # fmt: skip
    radius = np.broadcast_to(np.asarray(success_radius, np.float64), geodesic_m.shape)
    if not predicted_m.shape == visible_logit.shape == geodesic_m.shape:
        raise ValueError(
            f"calibrate_stop_distance: predicted_m {predicted_m.shape}, visible_logit {visible_logit.shape} and "
            f"geodesic_m {geodesic_m.shape} must have one shape"
        )
    rows = (geodesic_m <= radius) & (visible_logit > 0)
    if not rows.any():
        raise ValueError(
            "calibrate_stop_distance: no state within the success radius where the head sees the object; probe "
            "more episodes (the expert must reach the goal facing the object: --goal-point nearest)"
        )
    return float(np.quantile(predicted_m[rows], quantile))


def predicted_distance_m(prediction):
    """``[B]`` metres to the named object from the head's ``[B, 4]`` prediction (tensor or array), whose last
    column regresses the distance divided by ``DISTANCE_SCALE_M``."""
    return prediction[:, 3] * DISTANCE_SCALE_M


def stop_allowed(prediction: torch.Tensor, stop_distance_m: float) -> torch.Tensor:
    """``bool [B]``: the head's ``[B, 4]`` prediction says the object is in view (logit > 0) and its distance is at
    most ``stop_distance_m``."""
    return (prediction[:, 0] > 0) & (predicted_distance_m(prediction) <= stop_distance_m)


def stop_steps(actions: np.ndarray, within_steps: int | None = None, threshold: float = 0.5) -> np.ndarray:
    """``bool [..., within_steps]``: which of the first ``within_steps`` steps of each ``[..., S, 4]`` chunk stop
    (stop channel above ``threshold``, the evaluator's rule; None = the whole chunk)."""
    return np.asarray(actions)[..., :within_steps, 3] > threshold


def gate_stop(
    actions: np.ndarray, allowed: np.ndarray, within_steps: int | None = None, threshold: float = 0.5
) -> np.ndarray:
    """Applies the gate to the chosen chunk of each query.

    Args:
        actions: ``float [V, B, S, 4]`` decoded actions of ``V`` samples per query; ``actions[0]`` is the chunk
            the policy would execute (after any STOP vote).
        allowed: ``bool [B]``: :func:`stop_allowed` of each query.
        within_steps: Only STOPs in the first ``within_steps`` steps count (those that would be executed); None =
            the whole chunk.
        threshold: A step stops when its stop channel exceeds this (the evaluator's rule).

    Returns:
        ``float64 [B, S, 4]``: sample 0 where STOP is allowed or not asked for. Where it is asked for but not
        allowed, the first other sample that does not stop in those steps (its motion goes on instead of the
        motion that was planned to end at STOP), else sample 0 with its stop channel cleared.
    """
    actions = np.asarray(actions, np.float64)
    out = actions[0].copy()
    stops = stop_steps(actions, within_steps, threshold).any(-1)  # [V, B]
    for b in np.flatnonzero(stops[0] & ~np.asarray(allowed, bool)):
        moving = np.flatnonzero(~stops[1:, b])
        if moving.size:
            out[b] = actions[1 + moving[0], b]
        else:
            out[b, :, 3] = 0.0
    return out


@dataclass
class StopGate:
    """The view head and its stopping distance.

    Args:
        head: The trained :class:`ObjectViewProbe`.
        stop_distance_m: Largest predicted object distance at which STOP passes.
        quantile: The quantile :func:`fit_stop_distance` used (recorded for the model card).
        within_steps: The STOP window :func:`fit_stop_distance` and :func:`gate_stop` use.
        fitted_on: What ``stop_distance_m`` is a quantile of: ``"expert_stop_labels"`` (:func:`fit_stop_distance`,
            in training) or ``"predictions_at_goal"`` (:func:`calibrate_stop_distance`).
    """

    head: ObjectViewProbe
    stop_distance_m: float
    quantile: float = 0.9
    within_steps: int = 8
    fitted_on: str = FIT_LABELS

    @torch.no_grad()
    def predict(self, transformer, context, seeds: list[int]) -> torch.Tensor:
        """``[B, 4]`` head output for ``context`` at pure noise (sigma = 1: only the history and the instruction
        inform it, nothing from a sampled chunk), from one extra DiT forward.

        Args:
            transformer: The model's ``WNMTransformer``.
            context: ``WNMContext`` of B queries.
            seeds: ``B`` seeds of each query's noise (drawn on the CPU, one generator per query, so a query's
                answer does not depend on which others share the batch).
        """
        cfg = transformer.config
        dev = context.history_latents.device
        dtype = next(transformer.parameters()).dtype
        videos, actions = [], []
        for seed in seeds:
            g = torch.Generator().manual_seed(int(seed) % (2**63))
            videos.append(torch.randn(cfg.target_latent_shape, generator=g))
            actions.append(torch.randn((cfg.action_steps, cfg.action_channels), generator=g))
        video = torch.stack(videos).to(dev, dtype)
        action = torch.stack(actions).to(dev, dtype)
        sigma = torch.ones(len(seeds), device=dev, dtype=dtype)
        with self.head.attached(transformer):
            transformer(video, action, sigma, context)
            return self.head.predict().float()

    def save(self, root: Path) -> None:
        """Writes ``root / stop_gate`` (config and weights)."""
        folder = Path(root) / GATE_DIR
        folder.mkdir()
        dim = self.head.net[0].normalized_shape[0]
        config = {"kind": GATE_KIND, "dim": dim, "stop_distance_m": self.stop_distance_m, "quantile": self.quantile,
                  "within_steps": self.within_steps, "fitted_on": self.fitted_on}  # fmt: skip
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}, folder / GATE_WEIGHTS)


def load_stop_gate(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> StopGate | None:
    """The checkpoint's :class:`StopGate`, or None when it has none (trained without the view head).

    Raises:
        CheckpointError: the gate's files are not in the manifest, fail their sha256, or are malformed.
    """
    ckpt_dir = Path(ckpt_dir)
    folder = ckpt_dir / GATE_DIR
    if not folder.is_dir():
        return None
    names = [f"{GATE_DIR}/{CONFIG_NAME}", f"{GATE_DIR}/{GATE_WEIGHTS}"]
    verify_files(ckpt_dir, read_manifest(ckpt_dir), only=names)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except ValueError as e:
        raise CheckpointError(f"{folder / CONFIG_NAME}: not JSON ({e})") from e
    if not isinstance(config, dict) or config.get("kind") != GATE_KIND:
        kind = config.get("kind") if isinstance(config, dict) else None
        raise CheckpointError(f"{folder / CONFIG_NAME}: field 'kind' must be {GATE_KIND!r}, got {kind!r}")
    try:
        head = ObjectViewProbe(int(config["dim"]))
        head.load_state_dict(load_file(folder / GATE_WEIGHTS))
        gate = StopGate(head.to(device).eval(), float(config["stop_distance_m"]), float(config["quantile"]),
                        int(config["within_steps"]), str(config.get("fitted_on", FIT_LABELS)))  # fmt: skip
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: malformed stop gate ({e}); see {MANIFEST_NAME} for what was saved") from e
    return gate
