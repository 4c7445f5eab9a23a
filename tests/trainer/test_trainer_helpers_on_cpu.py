"""Pure driver helpers: rank sharding, result merging, mini-batch groups, checkpoint pointer, config checks."""

import dataclasses
import json
import warnings

import pytest
import torch

from verl_omni.pipelines.wnm_shared.requests import stratified_requests
from verl_omni.trainer import checkpointing
from verl_omni.trainer.config import ConfigError, trainer_config_from_dict
from verl_omni.trainer.rollout_batch import (
    cat_dataclass_tensors,
    minibatch_prompt_groups,
    shard_requests,
    split_balanced,
    split_even,
)


def test_split_even_and_balanced():
    assert split_even(8, 2) == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="equal parts"):
        split_even(10, 4)
    sizes = [s.stop - s.start for s in split_balanced(10, 4)]
    assert sizes == [3, 3, 2, 2]


def test_shard_requests_keeps_prompts_whole_per_rank_and_remaps_rows():
    rows = ["row-a", "row-b", "row-c"]
    reqs = stratified_requests(["a", "b", "c"], run_seed=1, step=2, num_strata=2, num_branches=2)  # 12 requests
    shards = shard_requests(reqs, rows, 4, "/src", "ode")  # 3 requests per rank
    # rank 0: a,a,a ; rank 1: a,b,b ; rank 2: b,b,c ; rank 3: c,c,c
    assert [s.rows for s in shards] == [["row-a"], ["row-a", "row-b"], ["row-b", "row-c"], ["row-c"]]
    assert [s.global_rows for s in shards] == [[0], [0, 1], [1, 2], [2]]
    assert all(s.source_root == "/src" and s.mode == "ode" for s in shards)
    assert [r.context_row for r in shards[1].requests] == [0, 1, 1]
    # Only context_row changes: the RNG keys (sample id, stratum, branch, step, seed) are untouched.
    flat = [r for s in shards for r in s.requests]
    assert [dataclasses.replace(r, context_row=0) for r in flat] == [
        dataclasses.replace(r, context_row=0) for r in reqs
    ]


@dataclasses.dataclass
class _Ctx:
    a: torch.Tensor
    b: torch.Tensor | None = None


def test_cat_dataclass_tensors():
    out = cat_dataclass_tensors([_Ctx(torch.zeros(1, 2)), _Ctx(torch.ones(2, 2))])
    assert out.a.shape == (3, 2) and out.b is None


def test_minibatch_groups_are_whole_prompts_deterministic_and_differ_by_epoch():
    keys = [k for k in "abcdefgh" for _ in range(16)]
    g0 = minibatch_prompt_groups(keys, 2, run_seed=7, step=3, epoch=0)
    assert g0 == minibatch_prompt_groups(keys, 2, run_seed=7, step=3, epoch=0)
    assert sorted(k for grp in g0 for k in grp) == list("abcdefgh") and all(len(g) == 2 for g in g0)
    assert g0 != minibatch_prompt_groups(keys, 2, run_seed=7, step=3, epoch=1)
    with pytest.raises(ValueError, match="mini-batches"):
        minibatch_prompt_groups(keys, 3, 7, 3, 0)


def test_checkpoint_pointer_is_written_last_and_partial_dirs_are_ignored(tmp_path):
    assert checkpointing.latest_step(tmp_path) is None
    part = checkpointing.begin(tmp_path, 2)
    (part / "actor" / ".metadata").write_text("x")
    # Killed before commit: the partial directory is not a checkpoint.
    assert checkpointing.latest_step(tmp_path) is None
    final = checkpointing.commit(tmp_path, 2, {"step": 2})
    assert final.name == "global_step_2" and checkpointing.latest_step(tmp_path) == 2
    assert json.loads((final / "trainer_state.json").read_text())["step"] == 2
    # A pointer naming a checkpoint that was removed falls back to the newest complete one.
    part = checkpointing.begin(tmp_path, 4)
    (part / "actor" / ".metadata").write_text("x")
    checkpointing.commit(tmp_path, 4, {"step": 4})
    (tmp_path / "global_step_4" / "trainer_state.json").unlink()
    assert checkpointing.latest_step(tmp_path) == 2
    assert [p.name for p in checkpointing.prune(tmp_path, 1)] == []  # only one complete checkpoint left


def _minimal(**over):
    d = {
        "model": {"initial_checkpoint": "/ckpt", "data_contract_checkpoint": "/ckpt"},
        "data": {"train_root": "/data", "expected_train_size": 8},
        "trainer": {"output_dir": "/out"},
        "topology": {
            "cpu_workers_per_node": 2,
            "prompts_per_step": 2,
            "ppo_mini_batch_prompts": 1,
            "micro_batch_rollouts": 4,
        },
    }
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return d


def test_config_validation_names_the_field():
    cfg = trainer_config_from_dict(_minimal())
    assert cfg.topology.world_size == 2 and cfg.rollout.rollouts_per_prompt == 16
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['rollout.nsteps'\]"):
        trainer_config_from_dict(_minimal(rollout={"nsteps": 3}))
    with pytest.raises(ConfigError, match="topology.micro_batch_rollouts"):
        # 16 rollouts per mini-batch over 2 ranks = 8 per rank, not a multiple of 3
        trainer_config_from_dict(_minimal(topology={"micro_batch_rollouts": 3}))
    with pytest.raises(ConfigError, match="topology.prompts_per_step"):
        # 16 x 1 rollouts cannot split over 3 ranks
        trainer_config_from_dict(
            _minimal(topology={"cpu_workers_per_node": 3, "prompts_per_step": 1, "ppo_mini_batch_prompts": 1})
        )
    with pytest.raises(ConfigError, match="algorithm.layer_weights"):
        trainer_config_from_dict(_minimal(algorithm={"layer_weights": {"visual": 1.0}}))
    with pytest.raises(ConfigError, match="rollout.window.range"):
        trainer_config_from_dict(_minimal(rollout={"window": {"range": [0, 20]}}))


def test_actor_checkpoint_blocks_is_null_or_a_count():
    assert trainer_config_from_dict(_minimal()).actor.checkpoint_blocks is None  # default: all blocks, as before
    for ok in (None, 0, 7, 30):
        assert trainer_config_from_dict(_minimal(actor={"checkpoint_blocks": ok})).actor.checkpoint_blocks == ok
    # True is an int in Python but would mean "1 block"; "10" and 2.5 are YAML typos, -1 has no meaning.
    for bad in (-1, 2.5, "10", True):
        with pytest.raises(ConfigError, match=r"actor\.checkpoint_blocks: must be null .* int >= 0"):
            trainer_config_from_dict(_minimal(actor={"checkpoint_blocks": bad}))


def test_actor_activation_memory_budget_is_null_or_a_share_for_compiled_actors():
    assert trainer_config_from_dict(_minimal()).actor.activation_memory_budget is None  # inductor's default
    for ok in (0.2, 1, 1.0):
        cfg = trainer_config_from_dict(_minimal(actor={"compile": True, "activation_memory_budget": ok}))
        assert cfg.actor.activation_memory_budget == ok
    # 0 keeps nothing, 1.5 is not a share, "0.2" is a YAML typo, True is an int in Python.
    for bad in (0, 1.5, -0.1, "0.2", True):
        with pytest.raises(ConfigError, match=r"actor\.activation_memory_budget: must be null .* in \(0, 1\]"):
            trainer_config_from_dict(_minimal(actor={"compile": True, "activation_memory_budget": bad}))
    with pytest.raises(ConfigError, match=r"actor\.activation_memory_budget: applies to the compiled DiT only"):
        trainer_config_from_dict(_minimal(actor={"compile": False, "activation_memory_budget": 0.2}))
    with pytest.raises(ConfigError, match=r"actor\.activation_memory_budget: replaces activation checkpointing"):
        both = {"compile": True, "gradient_checkpointing": True, "activation_memory_budget": 0.2}
        trainer_config_from_dict(_minimal(actor=both))


def test_rollout_fp8_needs_recomputed_old_logprobs_and_the_native_backend():
    assert trainer_config_from_dict(_minimal()).rollout.fp8 is False  # off unless asked for
    with pytest.warns(UserWarning, match=r"rollout\.fp8 without actor\.compile.*set actor\.compile: true"):
        ok = trainer_config_from_dict(_minimal(rollout={"fp8": True}, algorithm={"recompute_old_logp": True}))
    assert ok.rollout.fp8 is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled: no warning
        trainer_config_from_dict(
            _minimal(rollout={"fp8": True}, algorithm={"recompute_old_logp": True}, actor={"compile": True})
        )
    with pytest.raises(ConfigError, match=r"rollout\.fp8: samples with FP8 weights.*recompute_old_logp: true"):
        trainer_config_from_dict(_minimal(rollout={"fp8": True}))
    with pytest.raises(ConfigError, match=r"rollout\.fp8: applies to the native rollout backend only"):
        trainer_config_from_dict(
            _minimal(rollout={"fp8": True, "backend": "vllm_omni"}, algorithm={"recompute_old_logp": True})
        )
    with pytest.raises(ConfigError, match=r"rollout\.fp8: must be true or false"):
        trainer_config_from_dict(_minimal(rollout={"fp8": "yes"}, algorithm={"recompute_old_logp": True}))


@pytest.mark.parametrize("field", ["norm_rope_kernel", "residual_norm_kernel"])
def test_rollout_kernel_switches_default_on_and_must_be_bools(field):
    assert getattr(trainer_config_from_dict(_minimal()).rollout, field) is True
    off = trainer_config_from_dict(_minimal(rollout={field: False}))
    assert getattr(off.rollout, field) is False
    with pytest.raises(ConfigError, match=rf"rollout\.{field}: must be true or false, got 1"):
        trainer_config_from_dict(_minimal(rollout={field: 1}))


def test_rollout_gelu_epilogue_defaults_on_and_must_be_a_bool():
    assert trainer_config_from_dict(_minimal()).rollout.gelu_epilogue is True
    assert trainer_config_from_dict(_minimal(rollout={"gelu_epilogue": False})).rollout.gelu_epilogue is False
    with pytest.raises(ConfigError, match=r"rollout\.gelu_epilogue: must be true or false, got 'no'"):
        trainer_config_from_dict(_minimal(rollout={"gelu_epilogue": "no"}))


def test_actor_attention_backend_defaults_to_default_and_names_the_known_kernels():
    from verl_omni.models.wnm.attention import ATTENTION_BACKENDS
    from verl_omni.trainer.config import ATTENTION_BACKEND_NAMES

    assert ATTENTION_BACKEND_NAMES == ATTENTION_BACKENDS  # the config's torch-free copy of the model's list
    assert trainer_config_from_dict(_minimal()).actor.attention_backend == "default"
    assert trainer_config_from_dict(_minimal(actor={"attention_backend": "fa4"})).actor.attention_backend == "fa4"
    with pytest.raises(ConfigError, match=r"actor\.attention_backend: must be one of default, cudnn, fa4"):
        trainer_config_from_dict(_minimal(actor={"attention_backend": "flash3"}))


def test_sections_build_the_sampler_loss_and_advantage_configs():
    cfg = trainer_config_from_dict(
        _minimal(
            rollout={"num_steps": 12, "shift": 2.5, "strata": 2, "branches": 8, "shared_initial_noise": False},
            algorithm={"clip_eps": 0.2, "kl_beta": 0.01, "baseline": "prompt", "layer_conditioned": False},
        )
    )
    sampler = cfg.rollout.sampler_config()
    assert (sampler.num_steps, sampler.shift, sampler.num_strata, sampler.num_branches) == (12, 2.5, 2, 8)
    assert sampler.shared_initial_noise is False
    assert sampler.window_size == cfg.rollout.window.size and sampler.window_start == cfg.rollout.window.start
    loss = cfg.algorithm.loss_config()
    assert (loss.clip_eps, loss.kl_beta) == (0.2, 0.01) and loss.layer_weights == dict(cfg.algorithm.layer_weights)
    adv = cfg.algorithm.advantage_config(cfg.rollout)
    assert (adv.baseline, adv.num_strata, adv.num_branches, adv.layer_conditioned) == ("prompt", 2, 8, False)
    assert (adv.eps, adv.a_max) == (cfg.algorithm.adv_eps, cfg.algorithm.adv_clip)


def test_trainer_warns_once_when_the_dit_block_reaches_dynamos_recompile_limit():
    from types import SimpleNamespace

    from verl_omni.trainer.ray_trainer import Stage3Trainer

    logged: list[str] = []
    trainer = SimpleNamespace(_warned_recompile_limit=False, _log=logged.append)
    warn = Stage3Trainer._warn_at_recompile_limit
    warn(trainer, {}, 1)  # not compiled: no counts, nothing to say
    warn(trainer, {"compile/block_graphs": 63.0, "compile/block_graph_limit": 64.0}, 2)
    assert logged == []
    warn(trainer, {"compile/block_graphs": 64.0, "compile/block_graph_limit": 64.0}, 3)
    warn(trainer, {"compile/block_graphs": 64.0, "compile/block_graph_limit": 64.0}, 4)
    assert len(logged) == 1
    assert "step 3" in logged[0] and "64 graphs" in logged[0] and "recompile_limit" in logged[0]
