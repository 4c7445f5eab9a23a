"""End to end on a synthesized collection: convert -> sample -> event val, each run twice."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from gn0_test_builders import load_tool

from verl_omni.data.cli_common import run_cli
from verl_omni.data.dataset import Stage3Dataset
from verl_omni.data.manifest import manifest_content_sha256, read_manifest, validate_manifest
from verl_omni.data.schema import EVENT_NAMES


def _parquet_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.parquet"))}


def _episodes(directory):
    return [e for p in sorted(directory.glob("*.parquet")) for e in pq.read_table(p).column("episode_id").to_pylist()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    synth = load_tool("synthesize_gn0_collection")
    assert (
        synth.main(
            [
                "--output-dir",
                str(base / "col"),
                "--occupancy-dir",
                str(base / "occ"),
                "--num-scenes",
                "2",
                "--episodes-per-scene",
                "2",
                "--image-size",
                "32",
                "--seed",
                "0",
            ]
        )
        == 0
    )
    ckpt = load_tool("make_tiny_wnm_checkpoint", folder="checkpoint")
    assert ckpt.main(["--output-dir", str(base / "ckpt"), "--no-progress"]) == 0
    return base


def test_three_commands_in_sequence_are_deterministic(inputs, tmp_path, capsys):
    convert = load_tool("convert_interiorgs_dagger_to_rlhf")
    sample = load_tool("sample_stage3_train")
    event_val = load_tool("build_vggt_stage3_event_val")
    col, occ, ckpt = inputs / "col", inputs / "occ", inputs / "ckpt"

    for run, workers in (("c1", "1"), ("c2", "2")):
        assert (
            run_cli(
                convert.main,
                [
                    "--input-root",
                    str(col),
                    "--output-dir",
                    str(tmp_path / run),
                    "--checkpoint",
                    str(ckpt),
                    "--occupancy-root",
                    str(occ),
                    "--shard-size",
                    "16",
                    "--val-fraction",
                    "0",
                    "--split-seed",
                    "42",
                    "--workers",
                    workers,
                    "--worker-prefetch",
                    "2",
                ],
            )
            == 0
        )
    out = capsys.readouterr().out
    assert out.count("rows/s") == 2
    conv = read_manifest(tmp_path / "c1")
    assert conv["counts"]["skipped"] == 0 and conv["counts"]["rows"] > 0 and conv["counts"]["episodes"] == 4
    assert _parquet_bytes(tmp_path / "c1") == _parquet_bytes(tmp_path / "c2")
    assert manifest_content_sha256(conv) == manifest_content_sha256(read_manifest(tmp_path / "c2"))
    assert validate_manifest(tmp_path / "c1", checkpoint=ckpt, check_references=True) == []

    for run in ("t1", "t2"):
        assert (
            run_cli(
                sample.main,
                [
                    "--source-manifest",
                    str(tmp_path / "c1" / "manifest.json"),
                    "--output-dir",
                    str(tmp_path / run),
                    "--train-size",
                    "2",
                    "--shard-size",
                    "2048",
                    "--seed",
                    "42",
                ],
            )
            == 0
        )
    train_eps = _episodes(tmp_path / "t1")
    assert len(train_eps) == 2 and len(set(train_eps)) == 2
    assert _parquet_bytes(tmp_path / "t1") == _parquet_bytes(tmp_path / "t2")
    assert manifest_content_sha256(read_manifest(tmp_path / "t1")) == manifest_content_sha256(
        read_manifest(tmp_path / "t2")
    )

    for run in ("v1", "v2"):
        assert (
            run_cli(
                event_val.main,
                [
                    "--input-root",
                    str(col),
                    "--output-dir",
                    str(tmp_path / run),
                    "--checkpoint",
                    str(ckpt),
                    "--exclude-parquet-dir",
                    str(tmp_path / "t1"),
                    "--occupancy-root",
                    str(occ),
                    "--per-event",
                    "1",
                    "--workers",
                    "2" if run == "v1" else "1",
                ],
            )
            == 0
        )
    val = read_manifest(tmp_path / "v1")
    assert val["counts"]["skipped"] == 0 and val["selection"]["selected"] == dict.fromkeys(EVENT_NAMES, 1)
    assert not set(_episodes(tmp_path / "v1")) & set(train_eps)
    assert _parquet_bytes(tmp_path / "v1") == _parquet_bytes(tmp_path / "v2")
    assert manifest_content_sha256(val) == manifest_content_sha256(read_manifest(tmp_path / "v2"))

    # The trainer-side reader sees the sample and decodes its frames from the source videos.
    ds = Stage3Dataset.open(tmp_path / "t1")
    history, target = ds.frames(0)
    assert len(ds) == 2 and history.shape == (33, 32, 32, 3) and target.shape == (33, 32, 32, 3)
    assert ds[0].expert_actions.shape == (32, 4)
