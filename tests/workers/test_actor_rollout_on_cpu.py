"""ActorRolloutWorker's set-up helpers that need no process group: activation checkpointing of the DiT and how
many requests a DiT call takes."""

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMTransformer
from verl_omni.pipelines.wnm_shared import NativeBackendConfig
from verl_omni.trainer.config import ConfigError
from verl_omni.workers.actor_rollout import (
    apply_activation_checkpointing,
    one_request_per_call,
)


def _flags(model) -> list[bool]:
    return [b.activation_checkpointing for b in model.blocks]


def test_checkpoint_blocks_reaches_the_first_blocks():
    model = WNMTransformer(WNMConfig.from_size("tiny"))  # 4 blocks
    apply_activation_checkpointing(model, None)  # actor.checkpoint_blocks: null, the recipe default
    assert _flags(model) == [True] * 4
    apply_activation_checkpointing(model, 1)
    assert _flags(model) == [True, False, False, False]
    apply_activation_checkpointing(model, 0)
    assert _flags(model) == [False] * 4
    apply_activation_checkpointing(model, 4)
    assert _flags(model) == [True] * 4


def test_checkpoint_blocks_above_the_model_depth_is_refused_by_name():
    model = WNMTransformer(WNMConfig.from_size("tiny"))
    with pytest.raises(ConfigError, match=r"actor\.checkpoint_blocks: 5 exceeds the model's 4 blocks"):
        apply_activation_checkpointing(model, 5)
    assert _flags(model) == [False] * 4


def test_a_model_without_partial_checkpointing():
    """An external model (WNM3D_SOURCE_ROOT adapter) may lack the switches: null leaves it as built, as before the
    field existed; a count is refused, since the model could not honour it."""

    class External(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    model = External()
    apply_activation_checkpointing(model, None)
    with pytest.raises(ConfigError, match=r"actor\.checkpoint_blocks: External cannot checkpoint part"):
        apply_activation_checkpointing(model, 1)


def test_deterministic_runs_one_request_per_dit_call_on_cpu_only():
    """trainer.deterministic: on CPU every request gets its own DiT call (batch-invariant, as the CPU tests need);
    on GPUs the backend keeps rollout.micro_batch_size rows per call, the shape the recipe sets for the update."""
    assert one_request_per_call(True, "cpu") and not one_request_per_call(False, "cpu")
    assert not one_request_per_call(True, "cuda")
    cpu = NativeBackendConfig(device="cpu", deterministic=one_request_per_call(True, "cpu"), chunk_size=16)
    assert cpu.effective_chunk_size == 1
    gpu_kind = NativeBackendConfig(device="cpu", deterministic=one_request_per_call(True, "cuda"), chunk_size=16)
    assert gpu_kind.effective_chunk_size == 16
