"""Trainer-side reader: opening datasets, deterministic epoch order, resumable position, frame decoding."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest
from gn0_test_builders import frame_value, synthetic_row, write_collection_json, write_episode, write_scene

from verl_omni.data.convert import EpisodeTask, convert_episode
from verl_omni.data.dataset import DataPosition, DatasetError, EpochSampler, Stage3Dataset, epoch_order
from verl_omni.data.frames import resolve_reference
from verl_omni.data.manifest import build_manifest, write_manifest
from verl_omni.data.parquet_io import ShardWriter
from verl_omni.data.schema import rows_to_table

NORM = {"version": 1, "channels": ["dx", "dy", "dyaw", "stop"], "mean": [0.0] * 4, "std": [1.0] * 4}


def _unit(seed, key):
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{key}".encode()).digest()[:8], "big") / 2.0**64


def test_epoch_order_is_the_documented_hash_permutation():
    ids = [f"e{i}/t000001/i000" for i in range(9)]
    order = epoch_order(ids, seed=4, epoch=2)
    expected = sorted(range(9), key=lambda i: _unit(4, f"2:{ids[i]}"))
    assert order.tolist() == expected
    assert sorted(order.tolist()) == list(range(9))
    assert epoch_order(ids, 4, 3).tolist() != expected


def test_sampler_resume_continues_exactly():
    ids = [f"s{i}" for i in range(5)]
    full = EpochSampler(ids, seed=1)
    stream = np.concatenate([full.next_indices(3) for _ in range(7)])  # 21 rows = 4 epochs + 1
    assert stream[:5].tolist() == epoch_order(ids, 1, 0).tolist()
    assert stream[5:10].tolist() == epoch_order(ids, 1, 1).tolist()
    first = EpochSampler(ids, seed=1)
    head = [first.next_indices(3) for _ in range(3)]
    state = first.state_dict()
    assert state == {"num_rows": 5, "seed": 1, "epoch": 1, "position": 4}
    resumed = EpochSampler(ids, seed=1, position=DataPosition.from_state_dict(state, num_rows=5))
    tail = [resumed.next_indices(3) for _ in range(4)]
    assert np.concatenate(head + tail).tolist() == stream.tolist()
    with pytest.raises(ValueError, match="same dataset"):
        DataPosition.from_state_dict(state, num_rows=6)


def _write_dataset(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    writers = {s: ShardWriter(out, s, s, 2) for s in ("train", "val")}
    for i in range(5):
        split = "val" if i == 4 else "train"
        writers[split].add([synthetic_row(f"e{i}", 3, events=("required_stop",), split=split, seed=i)])
    shards = [s.to_dict() for w in writers.values() for s in w.close()]
    ckpt = {
        "model_config": {"a": 1},
        "transform_metadata": {"b": 2},
        "model_config_hash": "x",
        "transform_metadata_hash": "y",
    }
    counts = {
        "episodes": 5,
        "records": 5,
        "rows": 5,
        "rows_by_split": {"train": 4, "val": 1},
        "skipped": 0,
        "skipped_by_reason": {},
    }
    write_manifest(
        out,
        build_manifest(
            kind="converted",
            tool="t",
            args={},
            source_root="/src",
            occupancy_root="/occ",
            checkpoint=ckpt,
            action_normalization=NORM,
            counts=counts,
            shards=shards,
            run={},
        ),
    )
    return out


def test_open_manifest_directory_and_single_file(tmp_path):
    out = _write_dataset(tmp_path)
    ds = Stage3Dataset.open(out)
    assert len(ds) == 5 and ds.sample_ids[0] == "e0/t000003/i000"
    assert str(ds.source_root) == "/src" and str(ds.occupancy_root) == "/occ"
    assert ds[1].episode_id == "e1" and ds[-1].split == "val" and ds.index_of("e2/t000003/i000") == 2
    np.testing.assert_array_equal(ds[2].expert_actions, synthetic_row("e2", 3, seed=2).expert_actions)
    assert len(Stage3Dataset.open(out / "manifest.json", split="val")) == 1
    single = Stage3Dataset.open(out / "train-00001.parquet")
    assert single.sample_ids == ["e2/t000003/i000", "e3/t000003/i000"] and str(single.source_root) == "/src"
    (out / "train-00000.parquet").unlink()
    with pytest.raises(DatasetError, match="missing"):
        Stage3Dataset.open(out)


def test_frames_are_decoded_by_index_from_the_source_videos(tmp_path):
    root, occ = tmp_path / "col", tmp_path / "occ"
    write_collection_json(root, 1)
    write_scene(occ, "scene_a")
    write_episode(root, "e1")
    rows = convert_episode(EpisodeTask(str(root), str(occ), "e1", NORM, split="train")).rows
    pq.write_table(rows_to_table(rows), tmp_path / "rows.parquet")
    ds = Stage3Dataset.open(tmp_path / "rows.parquet", source_root=root)
    history, target = ds.frames(0)  # query t = 5: history 28 x frame 0 then frames 1..5
    assert history.shape == (33, 16, 16, 3) and target.shape == (33, 16, 16, 3)
    expected_history = [frame_value(0)] * 28 + [frame_value(k) for k in range(1, 6)]
    np.testing.assert_allclose(history.reshape(33, -1).mean(axis=1), expected_history, atol=2.5)
    np.testing.assert_allclose(target.reshape(33, -1).mean(axis=1), [frame_value(100 + j) for j in range(33)], atol=2.5)
    with pytest.raises(ValueError, match="relative path"):
        resolve_reference(root, "../etc/passwd")
