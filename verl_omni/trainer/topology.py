"""Topology resolver: batch sizes that divide exactly over the actor ranks.

World size ``G = nnodes x gpus_per_node`` (CPU: ``nnodes x cpu_workers_per_node``). Each prompt gets
``n`` rollouts (16 = 4 strata x 4 branches in the locked recipe). With ``q = G / gcd(n, G)`` (the smallest
prompt count whose ``n q`` rollouts split evenly over ``G`` ranks), the resolver picks

* prompt batch ``P``: a multiple of ``q`` that divides the training row count ``N`` (every epoch is made of
  whole steps, so a resumed run sees exactly the same batches), closest to the recipe's target;
* PPO mini-batch ``M`` prompts: a multiple of ``q`` dividing ``P``, closest to the target;
* micro-batch ``m`` rollouts: the largest divisor of the per-rank mini-batch share ``n M / G`` that does not
  exceed the target.

Ties go to the larger candidate. The result satisfies :meth:`verl_omni.trainer.config.TopologyConfig.validate`
by construction. When no prompt batch can divide (``N`` is not a multiple of ``q``), :class:`TopologyError`
explains why and which training sizes or worker counts would work.

The recipe's ``topology`` section holds the world size and the three targets; :func:`resolve_config_topology`
turns a composed config tree into the one the run uses. The contract check and the driver
(``main_stage3.py``) both call it on the same composed recipe, so both see the same batch sizes. A section
that already satisfies ``TopologyConfig.validate`` and whose prompt batch divides ``N`` resolves to itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class TopologyError(ValueError):
    """No batch sizes fit the requested topology; the message says why and what to change."""


def _positive_int(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TopologyError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TopologyRequest:
    """What the resolver starts from.

    Attributes:
        nnodes: Number of nodes (``NNODES``).
        gpus_per_node: GPUs per node; 0 runs the actors on CPU.
        cpu_workers_per_node: Actor processes per node on CPU (``WAM_CPU_WORKERS``; ignored on GPU).
        rollouts_per_prompt: Rollouts per prompt group (strata x branches).
        target_prompts_per_step: Preferred prompt batch ``P``.
        target_mini_batch_prompts: Preferred prompts per PPO mini-batch.
        target_micro_batch_rollouts: Largest rollouts per forward/backward on one rank.
        train_size: Training row count ``N`` (``WAM_EXPECTED_TRAIN_SIZE``).
    """

    nnodes: int
    gpus_per_node: int
    cpu_workers_per_node: int
    rollouts_per_prompt: int
    target_prompts_per_step: int
    target_mini_batch_prompts: int
    target_micro_batch_rollouts: int
    train_size: int

    def __post_init__(self) -> None:
        owner = "TopologyRequest"
        _positive_int(owner, "nnodes", self.nnodes)
        _positive_int(owner, "gpus_per_node", self.gpus_per_node, minimum=0)
        if self.gpus_per_node == 0:
            _positive_int(owner, "cpu_workers_per_node", self.cpu_workers_per_node)
        for name in (
            "rollouts_per_prompt",
            "target_prompts_per_step",
            "target_mini_batch_prompts",
            "target_micro_batch_rollouts",
            "train_size",
        ):
            _positive_int(owner, name, getattr(self, name))

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_workers_per_node

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node


@dataclass(frozen=True)
class TopologyPlan:
    """A resolved topology (all counts exact).

    Attributes:
        request: The request it was resolved from.
        prompt_quantum: ``q``: every prompt count must be a multiple of it.
        prompts_per_step: ``P``.
        ppo_mini_batch_prompts: ``M``.
        micro_batch_rollouts: ``m``.
    """

    request: TopologyRequest
    prompt_quantum: int
    prompts_per_step: int
    ppo_mini_batch_prompts: int
    micro_batch_rollouts: int

    @property
    def world_size(self) -> int:
        return self.request.world_size

    @property
    def rollouts_per_step(self) -> int:
        return self.request.rollouts_per_prompt * self.prompts_per_step

    @property
    def rollouts_per_rank_per_step(self) -> int:
        return self.rollouts_per_step // self.world_size

    @property
    def mini_batches_per_step(self) -> int:
        return self.prompts_per_step // self.ppo_mini_batch_prompts

    @property
    def rollouts_per_rank_per_mini_batch(self) -> int:
        return self.request.rollouts_per_prompt * self.ppo_mini_batch_prompts // self.world_size

    @property
    def micro_batches_per_rank_per_mini_batch(self) -> int:
        return self.rollouts_per_rank_per_mini_batch // self.micro_batch_rollouts

    @property
    def steps_per_epoch(self) -> int:
        return self.request.train_size // self.prompts_per_step

    def topology_section(self) -> dict[str, int]:
        """The ``topology`` section of the trainer config (keys of ``TopologyConfig``)."""
        r = self.request
        return {
            "nnodes": r.nnodes,
            "gpus_per_node": r.gpus_per_node,
            "cpu_workers_per_node": r.cpu_workers_per_node,
            "prompts_per_step": self.prompts_per_step,
            "ppo_mini_batch_prompts": self.ppo_mini_batch_prompts,
            "micro_batch_rollouts": self.micro_batch_rollouts,
        }

    def describe(self) -> str:
        """Human-readable summary, including which targets were adjusted and why."""
        r = self.request
        device = f"{r.gpus_per_node} GPU(s)" if r.gpus_per_node > 0 else f"{r.cpu_workers_per_node} CPU worker(s)"
        lines = [
            f"topology: {r.nnodes} node(s) x {device} = world size {self.world_size}",
            f"  rollouts per prompt {r.rollouts_per_prompt}; prompt counts must be multiples of {self.prompt_quantum}",
            f"  prompt batch P = {self.prompts_per_step} -> {self.rollouts_per_step} rollouts/step, "
            f"{self.rollouts_per_rank_per_step} per rank; {self.steps_per_epoch} step(s) per epoch of "
            f"{r.train_size} rows",
            f"  PPO mini-batch = {self.ppo_mini_batch_prompts} prompts ({self.mini_batches_per_step} per step), "
            f"{self.rollouts_per_rank_per_mini_batch} rollouts per rank",
            f"  micro-batch = {self.micro_batch_rollouts} rollouts ({self.micro_batches_per_rank_per_mini_batch} "
            f"per rank per mini-batch)",
        ]
        for name, target, got in (
            ("prompt batch", r.target_prompts_per_step, self.prompts_per_step),
            ("PPO mini-batch", r.target_mini_batch_prompts, self.ppo_mini_batch_prompts),
            ("micro-batch", r.target_micro_batch_rollouts, self.micro_batch_rollouts),
        ):
            if target != got:
                lines.append(f"  note: {name} target {target} adjusted to {got} for exact divisibility")
        return "\n".join(lines)


def _closest(candidates: list[int], target: int) -> int:
    """Candidate nearest to ``target``; ties go to the larger one."""
    return min(candidates, key=lambda c: (abs(c - target), -c))


def resolve_topology(request: TopologyRequest) -> TopologyPlan:
    """Derives exact batch sizes for ``request`` (see the module docstring for the rule).

    Raises:
        TopologyError: the training row count is not a multiple of the prompt quantum, so no prompt batch
            splits both the data (whole steps per epoch) and the rollouts (whole rollouts per rank).
    """
    n, g, size = request.rollouts_per_prompt, request.world_size, request.train_size
    q = g // math.gcd(n, g)
    prompt_options = [p for p in range(q, size + 1, q) if size % p == 0]
    if not prompt_options:
        lower, upper = (size // q) * q, -(-size // q) * q
        sizes = " or ".join(str(s) for s in (lower, upper) if s > 0)
        raise TopologyError(
            f"topology cannot divide: world size {g} with {n} rollouts per prompt needs a prompt batch that is a "
            f"multiple of {q} (so that {n} x P rollouts split evenly over {g} ranks), and the prompt batch must "
            f"divide the {size} training rows (whole steps per epoch); no such batch exists. Use a training size "
            f"that is a multiple of {q} (e.g. {sizes}: resample with tools/data/sample_stage3_train.py "
            f"--train-size and set WAM_EXPECTED_TRAIN_SIZE), or a world size that divides {n} "
            f"({', '.join(str(d) for d in range(1, n + 1) if n % d == 0)} ranks), which accepts any training size"
        )
    p = _closest(prompt_options, request.target_prompts_per_step)
    mini = _closest([m for m in range(q, p + 1, q) if p % m == 0], request.target_mini_batch_prompts)
    per_rank = n * mini // g
    micro = max(d for d in range(1, min(per_rank, request.target_micro_batch_rollouts) + 1) if per_rank % d == 0)
    return TopologyPlan(
        request=request, prompt_quantum=q, prompts_per_step=p, ppo_mini_batch_prompts=mini, micro_batch_rollouts=micro
    )


def resolve_config_topology(tree: Mapping[str, Any]) -> tuple[dict[str, Any], TopologyPlan]:
    """Resolves the ``topology`` targets of a composed, interpolation-resolved config tree.

    Reads ``topology`` (world size and targets), ``rollout.strata x rollout.branches`` (rollouts per prompt)
    and ``data.expected_train_size`` (``N``); a key the tree leaves out takes the schema's default
    (:class:`~verl_omni.trainer.config.Stage3Config`), as it would when the tree is validated.

    Args:
        tree: The composed config as plain containers (e.g. ``OmegaConf.to_container(cfg, resolve=True)``).

    Returns:
        A deep copy of ``tree`` whose ``topology`` section holds the resolved counts, and the plan.

    Raises:
        TopologyError: a needed value is missing or not an integer, or no batch sizes divide (see
            :func:`resolve_topology`).
    """
    from verl_omni.trainer.config import Stage3Config

    defaults = Stage3Config().to_dict()

    def value(section: str, key: str, minimum: int = 1) -> int:
        # Named by the config key (not the request field) because that is what the user sets.
        raw = (tree.get(section) or {}).get(key, defaults[section][key])
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw != int(raw) or raw < minimum:
            raise TopologyError(f"{section}.{key} must be an integer >= {minimum}, got {raw!r}")
        return int(raw)

    gpus = value("topology", "gpus_per_node", minimum=0)
    request = TopologyRequest(
        nnodes=value("topology", "nnodes"),
        gpus_per_node=gpus,
        cpu_workers_per_node=value("topology", "cpu_workers_per_node", minimum=1 if gpus == 0 else 0),
        rollouts_per_prompt=value("rollout", "strata") * value("rollout", "branches"),
        target_prompts_per_step=value("topology", "prompts_per_step"),
        target_mini_batch_prompts=value("topology", "ppo_mini_batch_prompts"),
        target_micro_batch_rollouts=value("topology", "micro_batch_rollouts"),
        train_size=value("data", "expected_train_size"),
    )
    plan = resolve_topology(request)
    resolved = copy.deepcopy(dict(tree))
    resolved["topology"] = {**(resolved.get("topology") or {}), **plan.topology_section()}
    return resolved, plan
