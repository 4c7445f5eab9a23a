"""The WNM checkpoint as a closed-loop :class:`~verl_omni.sim.closed_loop.Policy`.

Each call encodes the batch's contexts with the frozen encoders (history + instruction) and samples the joint
video/action latent with the deterministic ODE sampler of the native rollout backend. The initial noise of an
episode's ``k``-th call is keyed by ``(episode seed, k, episode_id)`` through :class:`RolloutRequest`
(``seed``, ``step``, ``sample_id``), so two checkpoints with the same latent layout start every call of every
episode from identical noise: differences between them come from their weights and the states they reach.
Only frames and instruction are used; the privileged pose/goal of :class:`PolicyQuery` are ignored.

STOP by vote (``stop_votes > 1``): STOP ends an episode for good, and one ODE sample places it where its initial
noise says, i.e. it is a draw from the model's belief about when the expert would stop. Measured on Stage-II
checkpoints: the stop onset is drawn from a broad belief while the goal is far or out of sight, so some call of
nearly every episode draws an early one (premature STOP in 93% of the episodes, 1.8 m from the goal on median).
With votes, the call also samples ``stop_votes - 1`` more initial noises (more strata of the same call) and a
step's STOP flag is set when most samples set it: the median of the belief instead of one draw from it, the
usual way to turn a sampled policy into a decision (cf. the ensembles of action-chunking policies). The motion
stays that of the first sample, so ``stop_votes = 1`` is exactly the single-sample policy.

STOP gate (``stop_gate``): votes leave the early STOPs in place because the belief itself is wrong there (it
fires about 1.7 m short of the goal). A checkpoint trained with the view head keeps it as a
:class:`~verl_omni.models.wnm.stop_gate.StopGate`; with the gate on, a chunk's STOP is executed only where the
head sees the named object within the expert's stopping distance, and otherwise the call drives on with the
motion of another vote that does not stop (:func:`~verl_omni.models.wnm.stop_gate.gate_stop`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from verl_omni.sim.closed_loop import PolicyQuery


class WNMPolicy:
    """Closed-loop policy around a loaded ``WNMModel``.

    Args:
        model: The model (eval mode is set here).
        sampler: Sampler settings (``num_steps``, ``shift``; the ODE ignores the SDE options).
        backend_config: Native backend settings (device, dtype, batching).
        name: Label used in reports.
        stop_votes: Samples per call that vote on each step's STOP flag (1 = the first sample decides).
        stop_gate: Optional ``StopGate``: STOP only where its head sees the named object close enough.
    """

    def __init__(
        self, model, sampler=None, backend_config=None, name: str = "wnm", stop_votes: int = 1, stop_gate=None
    ) -> None:
        from verl_omni.pipelines.wnm_shared import NativeRolloutBackend

        if isinstance(stop_votes, bool) or not isinstance(stop_votes, int) or stop_votes < 1:
            raise ValueError(f"WNMPolicy.stop_votes: must be an int >= 1, got {stop_votes!r}")
        self.stop_votes = stop_votes
        self.stop_gate = stop_gate
        self._notes: list[dict | None] | None = None
        self._gate_view: list[dict] | None = None
        self._chosen: np.ndarray | None = None
        if stop_gate is not None:
            stop_gate.head.to(model.device)

        self.model = model.eval()
        self.backend = NativeRolloutBackend.from_model(model, sampler, backend_config)
        self.image_size = tuple(int(v) for v in model.config.image_size)
        self.history_frames = int(model.config.history_frames)
        self.name = name

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        num_steps: int = 10,
        shift: float = 3.0,
        name: str | None = None,
        exact: bool = False,
        stop_votes: int = 1,
        stop_gate: bool = False,
        stop_gate_distance_m: float | None = None,
    ) -> WNMPolicy:
        """Loads a complete checkpoint directory (sha256-verified) and wraps it.

        ``exact=False`` runs all active episodes in one DiT batch (fast); ``exact=True`` evaluates each episode's
        sample on its own so that its bits do not depend on which episodes share the call (slower on CPU).

        ``stop_gate=True`` loads the checkpoint's ``stop_gate/`` (see the module docstring);
        ``stop_gate_distance_m`` replaces its fitted stopping distance (to measure the gate at other settings).

        Raises:
            verl_omni.models.wnm.CheckpointError: the checkpoint is missing or malformed, or ``stop_gate`` is asked
                for and the checkpoint has none.
            ValueError: invalid sampler/backend settings (the message names the field).
        """
        from verl_omni.models.wnm import CheckpointError, load_wnm_checkpoint
        from verl_omni.models.wnm.stop_gate import GATE_DIR, load_stop_gate
        from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig

        # The ODE never uses the SDE window; a one-step window keeps any num_steps >= 2 valid.
        sampler = SamplerConfig(num_steps=num_steps, shift=shift, window_size=1)
        backend_config = NativeBackendConfig(device=device, dtype=dtype, deterministic=exact)
        model = load_wnm_checkpoint(checkpoint, device=device)
        gate = None
        if stop_gate:
            gate = load_stop_gate(checkpoint, device=device)
            if gate is None:
                raise CheckpointError(
                    f"{Path(checkpoint) / GATE_DIR}: missing; the STOP gate needs a checkpoint trained with the view "
                    "head (train_stage2.py --view-aux-weight > 0)"
                )
            if stop_gate_distance_m is not None:
                if not stop_gate_distance_m > 0:
                    raise ValueError(f"WNMPolicy.stop_gate_distance_m: must be > 0, got {stop_gate_distance_m!r}")
                gate = dataclasses.replace(gate, stop_distance_m=float(stop_gate_distance_m))
        return cls(model, sampler, backend_config, name=name or Path(checkpoint).name, stop_votes=stop_votes,
                   stop_gate=gate)  # fmt: skip

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """Decoded actions ``float64 [B, 32, 4]`` for ``uint8 [B, 33, H, W, 3]`` histories."""
        import torch

        from verl_omni.pipelines.wnm_shared import RolloutRequest

        frames = torch.from_numpy(np.ascontiguousarray(history))
        contexts = self.model.encode_context(frames, [q.instruction for q in queries])
        requests = [
            RolloutRequest(sample_id=q.episode_id, stratum=v, branch=0, step=q.call_index, seed=q.seed, context_row=i)
            for v in range(self.stop_votes)
            for i, q in enumerate(queries)
        ]  # vote v of query i is request v * B + i; vote 0 is the single-sample policy's request
        results = self.backend.generate(requests, contexts, ode=True)
        actions = results.actions.double().numpy().reshape(self.stop_votes, len(queries), *results.actions.shape[1:])
        chosen = vote_stop(actions)
        self._chosen = chosen
        if self.stop_gate is None:
            return chosen
        from verl_omni.models.wnm.stop_gate import gate_stop, stop_allowed

        # The gate's noise is keyed like the call's own (episode, seed, call index); crc32, not hash(), so that it
        # is the same in every process.
        seeds = [zlib.crc32(f"stop_gate:{q.episode_id}:{q.seed}:{q.call_index}".encode()) for q in queries]
        view = self.stop_gate.predict(self.model.transformer, contexts, seeds)
        allowed = stop_allowed(view, self.stop_gate.stop_distance_m).cpu().numpy()
        self._notes = gate_notes(chosen, view, allowed, self.stop_gate.within_steps)
        self._gate_view = gate_answers(view, allowed)
        return gate_stop(np.concatenate([chosen[None], actions[1:]]), allowed, self.stop_gate.within_steps)

    def call_notes(self) -> list[dict | None] | None:
        """Per query of the last call, where the chosen chunk asked for a STOP the gate decided on: what the gate saw
        (:func:`gate_notes`); None without a gate."""
        return self._notes

    def last_chosen(self) -> np.ndarray | None:
        """``float64 [B, S, 4]``: the chunk each query of the last call chose before the STOP gate (after any
        vote); None before the first call."""
        return self._chosen

    def last_gate_view(self) -> list[dict] | None:
        """Per query of the last call, what the STOP gate saw, whether or not a STOP was asked (:func:`gate_answers`);
        None without a gate."""
        return self._gate_view


def gate_answers(view, allowed: np.ndarray) -> list[dict]:
    """The gate head's answer for every query: ``{"gate_visible_logit", "gate_distance_m", "stop_allowed"}``.

    Args:
        view: ``[B, 4]`` the head's prediction (visibility logit first, scaled distance last).
        allowed: ``bool [B]`` :func:`~verl_omni.models.wnm.stop_gate.stop_allowed` of each query.
    """
    from verl_omni.models.wnm.stop_gate import predicted_distance_m

    view = view.detach().float().cpu().numpy()
    distance_m = predicted_distance_m(view)
    return [
        {
            "gate_visible_logit": float(view[b, 0]),
            "gate_distance_m": float(distance_m[b]),
            "stop_allowed": bool(allowed[b]),
        }
        for b in range(view.shape[0])
    ]


def gate_notes(chosen: np.ndarray, view, allowed: np.ndarray, within_steps: int | None) -> list[dict | None]:
    """What the STOP gate saw where the chosen chunk asked for a STOP in its first ``within_steps`` steps.

    Args:
        chosen: ``float [B, S, 4]`` the chunk each query would execute before the gate.
        view: ``[B, 4]`` the gate head's prediction (visibility logit first, scaled distance last).
        allowed: ``bool [B]``.
        within_steps: The gate's STOP window (None: the whole chunk).

    Returns:
        Per query None (no STOP asked) or ``{"stop_asked": True, "stop_step" (first stopping step of the chunk),
        "stop_allowed", "gate_visible_logit", "gate_distance_m"}``: the closed-loop report then shows at what true
        distance the gate let STOPs through.
    """
    from verl_omni.models.wnm.stop_gate import predicted_distance_m, stop_steps

    view = view.detach().float().cpu().numpy()
    stops = stop_steps(chosen, within_steps)  # the gate's own STOP-in-window rule
    asked = stops.any(-1)
    distance_m = predicted_distance_m(view)
    return [
        {
            "stop_asked": True,
            "stop_step": int(stops[b].argmax()),
            "stop_allowed": bool(allowed[b]),
            "gate_visible_logit": float(view[b, 0]),
            "gate_distance_m": float(distance_m[b]),
        }
        if asked[b]
        else None
        for b in range(len(asked))
    ]


def vote_stop(actions: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """The first sample's actions with each step's stop flag set by majority over the samples.

    Args:
        actions: ``float [V, B, S, 4]`` decoded actions of ``V`` samples per query.
        threshold: A sample sets a step's flag when its stop channel exceeds this (the evaluator's rule).

    Returns:
        ``float64 [B, S, 4]``: sample 0's motion; stop channel 1 where more than half of the ``V`` samples stop at
        that step, else 0 (for ``V = 1``, sample 0 unchanged).
    """
    actions = np.asarray(actions, np.float64)
    if actions.shape[0] == 1:
        return actions[0]
    out = actions[0].copy()
    votes = (actions[..., 3] > threshold).mean(0)  # [B, S]
    out[..., 3] = (votes > 0.5).astype(np.float64)
    return out
