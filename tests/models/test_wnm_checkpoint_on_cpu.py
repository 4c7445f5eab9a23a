"""Complete checkpoints: exact save/load, sharding, manifest verification, contract compatibility."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import (
    CheckpointError,
    ContractMismatchError,
    WNMConfig,
    WNMModel,
    check_contract_compatibility,
    contract_of,
    load_wnm_checkpoint,
    read_checkpoint_contract,
    save_wnm_checkpoint,
)

torch.set_num_threads(1)
NORM = ActionNormalization(mean=(0.1, 0.0, 0.01, 0.0), std=(0.05, 0.02, 0.1, 1.0))


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return WNMModel(WNMConfig.from_size("tiny", num_layers=2, **overrides), NORM)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model()
    # 64 KiB shards force the transformer (about 2.4 MB of fp32) into many files plus an index.
    path = save_wnm_checkpoint(model, tmp_path_factory.mktemp("ck") / "tiny", {"run": "test", "step": 3}, 64 * 1024)
    return model, path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest_sha(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / "checkpoint_manifest.json").read_text())
    manifest["files"][name]["sha256"] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "checkpoint_manifest.json").write_text(json.dumps(manifest))


def test_layout_manifest_and_sharding(saved):
    _, path = saved
    for name in ("config.json", "action_normalization.json", "checkpoint_manifest.json"):
        assert (path / name).is_file()
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "image_encoder", "geometry_encoder"):
        assert (path / part).is_dir(), part
    index = json.loads((path / "transformer" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    manifest = json.loads((path / "checkpoint_manifest.json").read_text())
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [n for n in on_disk if n != "checkpoint_manifest.json"]
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    assert manifest["provenance"] == {"run": "test", "step": 3}
    assert json.loads((path / "action_normalization.json").read_text())["std"] == [0.05, 0.02, 0.1, 1.0]


def test_save_load_reproduces_outputs_exactly(saved):
    model, path = saved
    loaded = load_wnm_checkpoint(path)
    assert loaded.action_normalization == NORM and loaded.config == model.config
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (2, 33, 64, 64, 3), generator=g, dtype=torch.uint8)
    x = torch.randn(2, *model.config.target_latent_shape, generator=g)
    a = torch.randn(2, 32, 4, generator=g)
    s = torch.tensor([0.3, 0.8])
    outs = []
    for m in (model, loaded):
        m.eval()
        with torch.no_grad():
            ctx = m.encode_context(frames, ["turn left", "go straight and stop"])
            outs.append((ctx.history_latents, ctx.encoder_tokens, *m.transformer(x, a, s, ctx)))
    for ref, got in zip(*outs):
        assert torch.equal(ref, got)


def test_never_overwrites(saved, tmp_path):
    model, path = saved
    with pytest.raises(FileExistsError, match="already exists"):
        save_wnm_checkpoint(model, path, {})
    assert not any(p.name.startswith(".tiny.tmp") for p in path.parent.iterdir())


def test_contract_same_contract_different_weights_is_compatible(saved, tmp_path):
    _, path = saved
    other = save_wnm_checkpoint(_model(seed=7), tmp_path / "other", {"run": "b"})
    report = check_contract_compatibility(path, other)
    assert report.ok and report.differences == []
    report.raise_if_incompatible("test")
    contract = read_checkpoint_contract(path)
    assert set(contract) >= {
        "model_config",
        "transform_metadata",
        "action_normalization",
        "model_config_hash",
        "transform_metadata_hash",
    }
    assert contract["model_config_hash"] == read_checkpoint_contract(other)["model_config_hash"]


def test_contract_differences_name_the_field(saved):
    _, path = saved
    base = read_checkpoint_contract(path)
    cfg = WNMConfig.from_dict(base["model_config"])

    changed_norm = contract_of(cfg, ActionNormalization(mean=(0.2, 0.0, 0.01, 0.0), std=NORM.std))
    report = check_contract_compatibility(path, changed_norm)
    assert not report.ok and report.differences == ["action_normalization.mean[0]: 0.1 != 0.2"]
    with pytest.raises(
        ContractMismatchError, match=r"(?s)validate: contract mismatch.*action_normalization\.mean\[0\]"
    ):
        report.raise_if_incompatible("validate")

    fewer_frames = contract_of(WNMConfig.from_size("tiny", num_layers=2, history_frames=29), NORM)
    diffs = check_contract_compatibility(base, fewer_frames).differences
    assert "transform_metadata.history_frames: 33 != 29" in diffs
    assert "model_config.history_frames: 33 != 29" in diffs

    smaller = contract_of(WNMConfig.from_size("tiny", num_layers=2, image_size=(32, 64)), NORM)
    diffs = check_contract_compatibility(base, smaller).differences
    assert "transform_metadata.image_size[0]: 64 != 32" in diffs
    assert not any("image_size[1]" in d for d in diffs)


def test_sha_mismatch_names_the_file(saved, tmp_path):
    _, path = saved
    bad = _copy(path, tmp_path / "bad")
    shard = sorted((bad / "transformer").glob("model-*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: sha256 mismatch"):
        load_wnm_checkpoint(bad)


def test_missing_and_malformed_files(saved, tmp_path):
    _, path = saved
    missing = _copy(path, tmp_path / "missing")
    victim = sorted((missing / "vae").glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"vae/{victim.name}: listed in checkpoint_manifest\.json but missing"):
        load_wnm_checkpoint(missing)

    malformed = _copy(path, tmp_path / "malformed")
    (malformed / "config.json").write_text("{not json")
    _rewrite_manifest_sha(malformed, "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_wnm_checkpoint(malformed)

    no_manifest = _copy(path, tmp_path / "no_manifest")
    (no_manifest / "checkpoint_manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint_manifest\.json: file is missing"):
        read_checkpoint_contract(no_manifest)

    bad_norm = _copy(path, tmp_path / "bad_norm")
    (bad_norm / "action_normalization.json").write_text(
        json.dumps({"version": 1, "channels": ["dx", "dy", "dyaw", "stop"], "mean": [0, 0, 0, 0], "std": [1, 0, 1, 1]})
    )
    _rewrite_manifest_sha(bad_norm, "action_normalization.json")
    with pytest.raises(CheckpointError, match=r"action_normalization\.json.*std must be > 0"):
        load_wnm_checkpoint(bad_norm)


def test_config_disagreeing_with_weights_names_the_tensor(saved, tmp_path):
    _, path = saved
    bad = _copy(path, tmp_path / "ffn")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_config"]["ffn_dim"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    _rewrite_manifest_sha(bad, "config.json")
    with pytest.raises(CheckpointError, match=r"transformer: tensor 'blocks\.0\.ffn\.net\.0\.proj\.weight' has shape"):
        load_wnm_checkpoint(bad)

    unknown = _copy(path, tmp_path / "unknown")
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_config"]["size"] = "tiny"
    cfg["model_config"]["variant"] = "wnm_5d"
    (unknown / "config.json").write_text(json.dumps(cfg))
    _rewrite_manifest_sha(unknown, "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: model_config: WNMConfig\.variant"):
        load_wnm_checkpoint(unknown)


def test_wnm_2d_roundtrip(tmp_path):
    model = _model(variant="wnm_2d")
    path = save_wnm_checkpoint(model, tmp_path / "w2d", {})
    assert not (path / "geometry_encoder").exists() and (path / "transformer" / "model.safetensors").is_file()
    loaded = load_wnm_checkpoint(path)
    assert loaded.geometry_encoder is None
    for k, v in model.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[k], v)
