"""The WNM checkpoint as a closed-loop :class:`~verl_omni.sim.closed_loop.Policy`.

Each call encodes the batch's contexts with the frozen encoders (history + instruction) and samples the joint
video/action latent with the deterministic ODE sampler of the native rollout backend. The initial noise of an
episode's ``k``-th call is keyed by ``(episode seed, k, episode_id)`` through :class:`RolloutRequest`
(``seed``, ``step``, ``sample_id``), so two checkpoints with the same latent layout start every call of every
episode from identical noise: differences between them come from their weights and the states they reach.
Only frames and instruction are used; the privileged pose/goal of :class:`PolicyQuery` are ignored.
"""

from __future__ import annotations

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
    """

    def __init__(self, model, sampler=None, backend_config=None, name: str = "wnm") -> None:
        from verl_omni.pipelines.wnm_shared import NativeRolloutBackend

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
    ) -> WNMPolicy:
        """Loads a complete checkpoint directory (sha256-verified) and wraps it.

        ``exact=False`` runs all active episodes in one DiT batch (fast); ``exact=True`` evaluates each episode's
        sample on its own so that its bits do not depend on which episodes share the call (slower on CPU).

        Raises:
            verl_omni.models.wnm.CheckpointError: the checkpoint is missing or malformed.
            ValueError: invalid sampler/backend settings (the message names the field).
        """
        from verl_omni.models.wnm import load_wnm_checkpoint
        from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig

        # The ODE never uses the SDE window; a one-step window keeps any num_steps >= 2 valid.
        sampler = SamplerConfig(num_steps=num_steps, shift=shift, window_size=1)
        backend_config = NativeBackendConfig(device=device, dtype=dtype, deterministic=exact)
        model = load_wnm_checkpoint(checkpoint, device=device)
        return cls(model, sampler, backend_config, name=name or Path(checkpoint).name)

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """Decoded actions ``float64 [B, 32, 4]`` for ``uint8 [B, 33, H, W, 3]`` histories."""
        import torch

        from verl_omni.pipelines.wnm_shared import RolloutRequest

        frames = torch.from_numpy(np.ascontiguousarray(history))
        contexts = self.model.encode_context(frames, [q.instruction for q in queries])
        requests = [
            RolloutRequest(sample_id=q.episode_id, stratum=0, branch=0, step=q.call_index, seed=q.seed, context_row=i)
            for i, q in enumerate(queries)
        ]
        results = self.backend.generate(requests, contexts, ode=True)
        return results.actions.double().numpy()
