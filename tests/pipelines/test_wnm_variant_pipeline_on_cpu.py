"""The variant pipeline packages: the model, backend and actor the worker builds, and the variant refusal."""

from __future__ import annotations

import pytest
import torch

from verl_omni import pipelines
from verl_omni.contracts import VariantMismatchError
from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMModel, save_wnm_checkpoint
from verl_omni.pipelines import wnm_2d, wnm_3d
from verl_omni.pipelines.wnm_3d.actor import WNMDiffusionActor
from verl_omni.pipelines.wnm_shared import NativeBackendConfig, SamplerConfig

torch.set_num_threads(1)
NORM = ActionNormalization(mean=(0.0, 0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0, 1.0))


@pytest.fixture(scope="module")
def ckpt_2d(tmp_path_factory):
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_2d", num_layers=1), NORM)
    return save_wnm_checkpoint(model, tmp_path_factory.mktemp("ck") / "tiny2d", {"run": "test"})


def test_pipeline_for_picks_the_variant_package():
    assert pipelines.pipeline_for("wnm_3d") is wnm_3d.PIPELINE and wnm_3d.PIPELINE.variant == "wnm_3d"
    assert pipelines.pipeline_for("wnm_2d") is wnm_2d.PIPELINE and wnm_2d.PIPELINE.variant == "wnm_2d"
    # Both variants train with the one actor class.
    assert wnm_2d.PIPELINE.actor_class is wnm_3d.PIPELINE.actor_class is WNMDiffusionActor
    with pytest.raises(ValueError, match=r"model.variant 'wnm_4d' has no pipeline package; choose one of"):
        pipelines.pipeline_for("wnm_4d")


def test_wnm_2d_pipeline_builds_model_backend_and_actor(ckpt_2d):
    pipe = pipelines.pipeline_for("wnm_2d")
    model = pipe.load_model(ckpt_2d)
    assert model.config.variant == "wnm_2d"
    sampler = SamplerConfig(num_steps=3, window_strategy="fixed", window_start=0, window_size=1)
    backend = pipe.build_backend(model, "native", sampler, NativeBackendConfig())
    opt = torch.optim.SGD(model.transformer.parameters(), lr=0.1)
    actor = pipe.build_actor(model.transformer, backend.layout, opt, grad_clip=2.0)
    assert isinstance(actor, WNMDiffusionActor) and actor.module is model.transformer and actor.grad_clip == 2.0
    # The other variant's pipeline refuses the in-memory model as well.
    with pytest.raises(ValueError, match="wnm_3d pipeline got a model of variant 'wnm_2d'"):
        wnm_3d.build_backend(model)


def test_wnm_3d_pipeline_refuses_a_wnm_2d_checkpoint_naming_both_values_the_file_and_the_field(ckpt_2d):
    with pytest.raises(VariantMismatchError) as e:
        wnm_3d.load_model(ckpt_2d)
    assert str(e.value) == (
        f"model.variant is 'wnm_3d' but the checkpoint {ckpt_2d / 'config.json'} has model_config.variant "
        "'wnm_2d': set model.variant: wnm_2d to train this checkpoint, or start from a wnm_3d checkpoint"
    )
