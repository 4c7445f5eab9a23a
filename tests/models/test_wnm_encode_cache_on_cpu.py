"""models/wnm/encode_cache.py: parts saved one by one, tied to their source, a fresh model's state restored."""

import json

import torch

from verl_omni.models.wnm import WNMConfig, WNMModel
from verl_omni.models.wnm.encode_cache import EncodeCache
from verl_omni.models.wnm.encoded_rows import EncodedRows


def _rows(n: int, fill: float) -> EncodedRows:
    lat = torch.full((n, 2, 1, 2, 2), fill)
    return EncodedRows(
        history_latents=lat, target_latents=lat + 1, actions=torch.zeros(n, 32, 4), row_example=torch.arange(n),
        text=torch.zeros(n, 3, 4), text_mask=torch.ones(n, 3, dtype=torch.bool), image=torch.zeros(n, 2, 4),
        geometry=None, text_ids=torch.zeros(n, 3, dtype=torch.long),
        views=torch.zeros(n, 1, 8, 8, 3, dtype=torch.uint8),
    )  # fmt: skip


def test_parts_come_back_until_the_source_changes(tmp_path):
    root, logs = tmp_path / "r0.encoded", []
    cache = EncodeCache(root, {"model": "a", "collection": "c", "size": (1, 2)}, logs.append)
    assert cache.load_part(0, None) is None and cache.load_rest() is None
    cache.save_part(0, _rows(3, 0.5))
    # A new call (another object) on the same source finds part 0 but not part 1, and no rest yet; key order and
    # tuples (JSON gives lists back) do not make it another source.
    again = EncodeCache(root, {"collection": "c", "size": [1, 2], "model": "a"}, logs.append)
    part = again.load_part(0, None)
    assert part.examples == 3 and torch.equal(part.history_latents, torch.full((3, 2, 1, 2, 2), 0.5))
    assert again.load_part(1, None) is None and again.load_rest() is None
    assert not logs
    again.save_rest({"heldout_rows": None, "probe_examples": [1, 2]})
    assert again.load_rest() == {"heldout_rows": None, "probe_examples": [1, 2]}
    assert not list(root.glob("*.partial"))  # every file went through its temporary name
    # Another model: nothing of the old encoding is mixed in.
    other = EncodeCache(root, {"model": "b", "collection": "c"}, logs.append)
    assert other.load_part(0, None) is None and other.load_rest() is None
    assert json.loads((root / "source.json").read_text()) == {"collection": "c", "model": "b"}
    assert len(logs) == 1 and "another model" in logs[0]


def test_unreadable_part_is_encoded_again(tmp_path):
    logs = []
    cache = EncodeCache(tmp_path / "r1.encoded", {"m": 1}, logs.append)
    (tmp_path / "r1.encoded" / "part_0000.pt").write_bytes(b"cut short")
    assert cache.load_part(0, None) is None and "unreadable" in logs[0]


def test_fresh_model_state_is_restored_with_its_part(tmp_path):
    config = WNMConfig.from_size("tiny")
    torch.manual_seed(1)
    fitted = WNMModel(config)
    fitted.set_latent_statistics([0.25] * config.latent_channels, [2.0] * config.latent_channels)
    cache = EncodeCache(tmp_path / "r0.encoded", {"fresh": True})
    cache.save_part(0, _rows(2, 1.0), fitted)
    torch.manual_seed(2)  # another random initialisation, as in a new process
    resumed = WNMModel(config)
    cache.load_part(0, resumed)
    a, b = fitted.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.latents_mean.flatten().tolist() == [0.25] * config.latent_channels
    assert resumed.latents_std.flatten().tolist() == [2.0] * config.latent_channels
