"""External WNM-3D source adapter, exercised with the fake checkout in tests/fixtures."""

import sys
from pathlib import Path

import pytest
import torch

from verl_omni.models.wnm import WNMConfig, WNMModel, build_wnm_model, load_wnm_checkpoint, save_wnm_checkpoint
from verl_omni.models.wnm.external import load_adapter

torch.set_num_threads(1)
FAKE_ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "fake_wnm3d_source"


@pytest.fixture
def fake_source(monkeypatch):
    monkeypatch.setenv("WNM3D_SOURCE_ROOT", str(FAKE_ROOT))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "wnm3d_rl_adapter", raising=False)
    yield FAKE_ROOT
    sys.modules.pop("wnm3d_rl_adapter", None)


def test_geometry_encoder_built_through_protocol(fake_source, tmp_path):
    cfg = WNMConfig.from_size("tiny", num_layers=1, geometry_encoder_kind="external")
    torch.manual_seed(0)
    model = WNMModel(cfg)
    assert type(model.geometry_encoder).__module__ == "wnm3d_rl_adapter"
    assert str(fake_source) in sys.path
    assert not any(p.requires_grad for p in model.geometry_encoder.parameters())
    frames = torch.randint(0, 256, (1, 33, 64, 64, 3), dtype=torch.uint8)
    ctx = model.encode_context(frames, ["find the sofa"])
    assert ctx.encoder_tokens.shape == (1, cfg.context_tokens, cfg.dim)
    # The external encoder's weights travel in the checkpoint and load into a freshly built instance.
    path = save_wnm_checkpoint(model, tmp_path / "ext", {"source": "fake"})
    loaded = load_wnm_checkpoint(path)
    assert torch.equal(loaded.geometry_encoder(frames), model.geometry_encoder(frames))


def test_optional_model_factory(fake_source):
    model = build_wnm_model(WNMConfig.from_size("tiny", num_layers=1))
    assert model.built_by == "fake_wnm3d_source"


def test_without_source_uses_builtin_model(monkeypatch):
    monkeypatch.delenv("WNM3D_SOURCE_ROOT", raising=False)
    model = build_wnm_model(WNMConfig.from_size("tiny", num_layers=1))
    assert not hasattr(model, "built_by")
    with pytest.raises(RuntimeError, match="WNM3D_SOURCE_ROOT is not set"):
        WNMModel(WNMConfig.from_size("tiny", num_layers=1, geometry_encoder_kind="external"))


def test_bad_checkouts_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(RuntimeError, match=r"missing wnm3d_rl_adapter\.py"):
        load_adapter(tmp_path)
    (tmp_path / "wnm3d_rl_adapter.py").write_text("ADAPTER_PROTOCOL_VERSION = 2\n")
    monkeypatch.delitem(sys.modules, "wnm3d_rl_adapter", raising=False)
    with pytest.raises(RuntimeError, match="ADAPTER_PROTOCOL_VERSION is 2, expected 1"):
        load_adapter(tmp_path)
    sys.modules.pop("wnm3d_rl_adapter", None)
