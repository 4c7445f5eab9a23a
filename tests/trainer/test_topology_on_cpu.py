"""Topology resolver: hand-computed plans, refusals, and the schema's own divisibility rule as a reference."""

from __future__ import annotations

import itertools
import math

import pytest

from verl_omni.trainer.config import TopologyConfig
from verl_omni.trainer.topology import TopologyError, TopologyRequest, resolve_config_topology, resolve_topology


def _req(nnodes=1, gpus=0, cpu=2, p=8, mini=8, micro=8, n_train=1024, rollouts=16):
    return TopologyRequest(
        nnodes=nnodes,
        gpus_per_node=gpus,
        cpu_workers_per_node=cpu,
        rollouts_per_prompt=rollouts,
        target_prompts_per_step=p,
        target_mini_batch_prompts=mini,
        target_micro_batch_rollouts=micro,
        train_size=n_train,
    )


def test_one_node_eight_gpus_keeps_targets():
    # G = 8, q = 8 / gcd(16, 8) = 1; 16 x 4 / 8 = 8 rollouts per rank per mini-batch.
    plan = resolve_topology(_req(gpus=8, p=8, mini=4, micro=8))
    assert (plan.prompt_quantum, plan.prompts_per_step, plan.ppo_mini_batch_prompts, plan.micro_batch_rollouts) == (
        1,
        8,
        4,
        8,
    )
    assert (plan.rollouts_per_step, plan.rollouts_per_rank_per_step, plan.steps_per_epoch) == (128, 16, 128)
    assert "note:" not in plan.describe()


def test_four_nodes_of_eight_gpus():
    # G = 32, q = 32 / gcd(16, 32) = 2; 16 x 8 / 32 = 4 per rank; micro 4 -> 1 micro-batch per rank.
    plan = resolve_topology(_req(nnodes=4, gpus=8, p=16, mini=8, micro=4, n_train=4096))
    assert (plan.prompt_quantum, plan.prompts_per_step, plan.ppo_mini_batch_prompts) == (2, 16, 8)
    assert (plan.rollouts_per_rank_per_mini_batch, plan.micro_batches_per_rank_per_mini_batch) == (4, 1)
    assert plan.mini_batches_per_step == 2 and plan.world_size == 32


def test_three_cpu_workers_adjusts_targets():
    # G = 3, q = 3: P in {3, 6, 12} (divides 12) closest to 4 -> 3; mini must be a multiple of 3 dividing 3 -> 3;
    # 16 x 3 / 3 = 16 rollouts per rank, micro target 4 divides 16 -> 4.
    plan = resolve_topology(_req(cpu=3, p=4, mini=2, micro=4, n_train=12))
    assert (plan.prompts_per_step, plan.ppo_mini_batch_prompts, plan.micro_batch_rollouts) == (3, 3, 4)
    text = plan.describe()
    assert "prompt batch target 4 adjusted to 3" in text and "PPO mini-batch target 2 adjusted to 3" in text


def test_tie_goes_to_the_larger_prompt_batch():
    # G = 6, q = 6 / gcd(16, 6) = 3; divisors of 36 that are multiples of 3: 3, 6, 9, 12, 18, 36; 12 and 18 are
    # both 3 away from 15.
    plan = resolve_topology(_req(cpu=6, p=15, mini=3, micro=8, n_train=36))
    assert plan.prompts_per_step == 18 and plan.ppo_mini_batch_prompts == 3


def test_micro_batch_is_largest_divisor_below_target():
    # G = 2, mini 1 prompt: 16 / 2 = 8 rollouts per rank; divisors of 8 up to 3 are 1, 2 -> 2.
    plan = resolve_topology(_req(cpu=2, p=2, mini=1, micro=3, n_train=8))
    assert plan.micro_batch_rollouts == 2 and plan.micro_batches_per_rank_per_mini_batch == 4


def test_refuses_when_nothing_divides():
    with pytest.raises(TopologyError) as e:
        resolve_topology(_req(cpu=3, p=4, mini=2, micro=4, n_train=4))
    msg = str(e.value)
    assert "multiple of 3" in msg and "divide the 4 training rows" in msg and "3 or 6" in msg
    assert "WAM_EXPECTED_TRAIN_SIZE" in msg


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("nnodes", {"nnodes": 0}),
        ("train_size", {"n_train": 0}),
        ("cpu_workers_per_node", {"cpu": 0}),
        ("gpus_per_node", {"gpus": -1}),
    ],
)
def test_request_validation_names_field(field, kwargs):
    with pytest.raises(TopologyError, match=f"TopologyRequest.{field}"):
        _req(**kwargs)


def test_every_plan_passes_the_schema_check():
    # TopologyConfig.validate (config.py, written independently) is the reference for exact divisibility.
    for nnodes, gpus, cpu, p, mini, micro, n_train in itertools.product(
        (1, 2, 3), (0, 1, 3, 8), (1, 2, 5), (1, 4, 8), (1, 2, 8), (1, 4, 16), (6, 24, 60)
    ):
        try:
            plan = resolve_topology(
                _req(nnodes=nnodes, gpus=gpus, cpu=cpu, p=p, mini=mini, micro=micro, n_train=n_train)
            )
        except TopologyError:
            g = nnodes * (gpus or cpu)
            assert n_train % (g // math.gcd(16, g)) != 0  # refused only when no prompt batch can exist
            continue
        TopologyConfig(**plan.topology_section()).validate(16)
        assert n_train % plan.prompts_per_step == 0


def _tree(**topology):
    return {
        "rollout": {"strata": 4, "branches": 4},
        "data": {"expected_train_size": 24},
        "topology": {"nnodes": 1, "gpus_per_node": 0, "cpu_workers_per_node": 3, **topology},
        "trainer": {"seed": 5},
    }


def test_config_tree_resolves_to_exact_counts_and_stays_untouched():
    # G = 3, q = 3 / gcd(16, 3) = 3; multiples of 3 dividing 24: 3, 6, 12, 24 -> P = 6 (nearest 8);
    # M from {3, 6} -> 6; per rank 16 x 6 / 3 = 32 rollouts -> micro 16 (largest divisor <= 16).
    tree = _tree(prompts_per_step=8, ppo_mini_batch_prompts=8, micro_batch_rollouts=16)
    resolved, plan = resolve_config_topology(tree)
    assert resolved["topology"] == {
        "nnodes": 1,
        "gpus_per_node": 0,
        "cpu_workers_per_node": 3,
        "prompts_per_step": 6,
        "ppo_mini_batch_prompts": 6,
        "micro_batch_rollouts": 16,
    }
    assert resolved["trainer"] == {"seed": 5} and tree["topology"]["prompts_per_step"] == 8
    assert plan.describe() == resolve_topology(plan.request).describe()
    # Resolved counts resolve to themselves: the driver may resolve what the contract check resolved.
    again, _ = resolve_config_topology(resolved)
    assert again == resolved


def test_config_tree_takes_schema_defaults_and_refuses_non_integers():
    # Schema defaults: 1 node x 2 CPU workers, P = 2, M = 2, micro 4; 16 x 2 / 2 = 16 per rank -> micro 4.
    resolved, _ = resolve_config_topology({"data": {"expected_train_size": 8}})
    assert resolved["topology"]["prompts_per_step"] == 2 and resolved["topology"]["micro_batch_rollouts"] == 4
    with pytest.raises(TopologyError, match=r"topology.prompts_per_step must be an integer >= 1, got '8'"):
        resolve_config_topology(_tree(prompts_per_step="8"))
    with pytest.raises(TopologyError, match=r"data.expected_train_size must be an integer >= 1, got 0"):
        resolve_config_topology({})
    with pytest.raises(TopologyError, match=r"topology.cpu_workers_per_node must be an integer >= 1, got 0"):
        resolve_config_topology(_tree(cpu_workers_per_node=0))
