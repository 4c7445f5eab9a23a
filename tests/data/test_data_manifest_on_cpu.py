"""Manifest building, content hashing and the shared validator."""

from __future__ import annotations

import json

import pytest
from gn0_test_builders import synthetic_row

from verl_omni.data.hashing import canonical_json_sha256
from verl_omni.data.manifest import (
    ManifestError,
    build_manifest,
    manifest_content_sha256,
    read_manifest,
    validate_manifest,
    write_manifest,
)
from verl_omni.data.parquet_io import ShardWriter

NORM = {"version": 1, "channels": ["dx", "dy", "dyaw", "stop"], "mean": [0.0] * 4, "std": [0.1, 0.1, 0.2, 1.0]}
MODEL_CONFIG = {"size": "tiny", "history_frames": 33}
TRANSFORM = {"history_frames": 33, "target_frames": 33, "image_size": [64, 64]}


def _contract(norm=NORM) -> dict:
    return {
        "model_config": MODEL_CONFIG,
        "transform_metadata": TRANSFORM,
        "action_normalization": norm,
        "model_config_hash": canonical_json_sha256(MODEL_CONFIG),
        "transform_metadata_hash": canonical_json_sha256(TRANSFORM),
    }


def _dataset(tmp_path, skipped: int = 0, created_at: str = "2026-01-01T00:00:00"):
    out = tmp_path / "data"
    out.mkdir(parents=True)
    writers = {s: ShardWriter(out, s, s, shard_size=3) for s in ("train", "val")}
    for i in range(7):
        writers["val" if i == 6 else "train"].add([synthetic_row(f"e{i}", 40, split="val" if i == 6 else "train")])
    shards = [s.to_dict() for w in writers.values() for s in w.close()]
    by_reason = {"unreadable_video": skipped, "unknown_scene": 0}
    counts = {
        "episodes": 7 + skipped,
        "records": 7,
        "rows": 7,
        "rows_by_split": {"train": 6, "val": 1},
        "skipped": skipped,
        "skipped_by_reason": by_reason,
    }
    ckpt = {k: v for k, v in _contract().items() if k != "action_normalization"}
    manifest = build_manifest(
        kind="converted",
        tool="test",
        args={"shard_size": 3},
        source_root=str(tmp_path / "col"),
        occupancy_root=str(tmp_path / "occ"),
        checkpoint=ckpt,
        action_normalization=NORM,
        counts=counts,
        shards=shards,
        run={"created_at": created_at},
    )
    write_manifest(out, manifest)
    return out, manifest


def test_valid_dataset_has_no_problems_and_shards_are_split(tmp_path):
    out, manifest = _dataset(tmp_path)
    assert validate_manifest(out) == []
    assert [s["file"] for s in manifest["shards"]] == [
        "train-00000.parquet",
        "train-00001.parquet",
        "val-00000.parquet",
    ]
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 1]
    assert validate_manifest(out / "manifest.json", expected_rows=7, min_rows=7, kind="converted") == []


def test_content_hash_ignores_only_the_run_section(tmp_path):
    a = _dataset(tmp_path / "a", created_at="2026-01-01")[1]
    b = _dataset(tmp_path / "b", created_at="2027-12-31")[1]
    for m in (a, b):  # source roots differ by tmp dir; align them to compare the rest
        m["source_root"] = m["occupancy_root"] = "/x"
    assert a != b and manifest_content_sha256(a) == manifest_content_sha256(b)
    b["counts"]["rows"] += 1
    assert manifest_content_sha256(a) != manifest_content_sha256(b)


def test_modified_or_missing_shard_is_reported(tmp_path):
    out, _ = _dataset(tmp_path)
    (out / "train-00001.parquet").write_bytes((out / "train-00000.parquet").read_bytes())
    (out / "val-00000.parquet").unlink()
    problems = validate_manifest(out)
    assert any("train-00001.parquet" in p and "sha256" in p for p in problems)
    assert any("val-00000.parquet" in p and "missing" in p for p in problems)


def test_skipped_rows_and_counts_are_checked(tmp_path):
    out, _ = _dataset(tmp_path, skipped=2)
    problems = validate_manifest(out, expected_rows=8, min_rows=10)
    assert any("counts.skipped is 2" in p for p in problems)
    assert any("expected exactly 8" in p for p in problems)
    assert any("at least 10" in p for p in problems)
    assert validate_manifest(out, require_no_skipped=False) == []


def test_structural_problems_name_the_field(tmp_path):
    out, manifest = _dataset(tmp_path)
    manifest["counts"]["rows_by_split"]["val"] = 0
    manifest["action_normalization"]["std"][1] = 0.0
    del manifest["checkpoint"]["model_config_hash"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = validate_manifest(out)
    assert any("rows_by_split.val" in p for p in problems)
    assert any("std" in p for p in problems)
    assert any("checkpoint.model_config_hash" in p for p in problems)
    (out / "manifest.json").write_text("{")
    assert "not valid JSON" in validate_manifest(out)[0]
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path / "nothing")


def test_contract_mismatch_names_the_differing_field(tmp_path):
    out, _ = _dataset(tmp_path)
    assert validate_manifest(out, checkpoint=_contract()) == []
    other = dict(NORM, std=[0.1, 0.1, 0.25, 1.0])
    problems = validate_manifest(out, checkpoint=_contract(other))
    assert problems and all("action_normalization.std" in p for p in problems)


def test_reference_check_finds_missing_videos(tmp_path):
    out, _ = _dataset(tmp_path)
    problems = validate_manifest(out, check_references=True)
    assert any("7 occupancy" not in p and "video" in p for p in problems)
    assert any("occupancy scene" in p for p in problems)
