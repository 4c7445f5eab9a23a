"""Rollout requests and the counterfactual stratified sampling plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verl_omni.pipelines.wnm_shared.layers import check_layer_names


def _nonneg_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"RolloutRequest.{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: which prompt context row, and every key of its random draws.

    Attributes:
        sample_id: The prompt's ``sample_id`` (Parquet row id).
        stratum: Noise stratum; branches of a stratum share the initial noise.
        branch: Counterfactual branch inside the stratum (differs only in SDE noise).
        step: Training step.
        seed: Run seed.
        context_row: Row of the prompt in the ``WNMContext`` passed with the batch.
        request_id: Name used in results and error messages (default derived from the keys).
        num_steps: Denoising steps the caller expects, or ``None``; a mismatch with the sampler is refused.
        layer_names: Layer layout the caller expects, or ``None``; anything but ``LAYER_NAMES`` is refused.
    """

    sample_id: str
    stratum: int
    branch: int
    step: int
    seed: int
    context_row: int = 0
    request_id: str = ""
    num_steps: int | None = None
    layer_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sample_id, str) or not self.sample_id:
            raise ValueError(f"RolloutRequest.sample_id must be a non-empty str, got {self.sample_id!r}")
        for name in ("stratum", "branch", "step", "seed", "context_row"):
            _nonneg_int(name, getattr(self, name))
        if not self.request_id:
            rid = f"{self.sample_id}/t{self.step}/s{self.stratum}/b{self.branch}"
            object.__setattr__(self, "request_id", rid)
        if self.layer_names is not None:
            check_layer_names(self.layer_names, f"request {self.request_id}")


def stratified_requests(
    sample_ids: Sequence[str],
    run_seed: int,
    step: int,
    num_strata: int = 4,
    num_branches: int = 4,
) -> list[RolloutRequest]:
    """The ``num_strata x num_branches`` rollouts of every prompt, prompt-major, then stratum, then branch.

    Args:
        sample_ids: One id per prompt; prompt ``p`` uses context row ``p``.
        run_seed, step: Run seed and training step.
        num_strata, num_branches: Plan shape (4 x 4 in the recipe).

    Returns:
        ``len(sample_ids) * num_strata * num_branches`` requests.
    """
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("stratified_requests: sample_ids must be unique within a batch")
    return [
        RolloutRequest(sample_id=sid, stratum=s, branch=b, step=step, seed=run_seed, context_row=p)
        for p, sid in enumerate(sample_ids)
        for s in range(num_strata)
        for b in range(num_branches)
    ]
