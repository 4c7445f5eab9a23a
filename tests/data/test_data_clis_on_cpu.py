"""The three data CLIs on a hand-built collection: skips by reason, refusals, determinism, exclusions."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest
from gn0_test_builders import load_tool, make_checkpoint, write_collection_json, write_episode, write_scene

from verl_omni.data.cli_common import run_cli
from verl_omni.data.manifest import manifest_content_sha256, read_manifest, validate_manifest
from verl_omni.data.schema import EVENT_NAMES

CONVERT = load_tool("convert_interiorgs_dagger_to_rlhf")
SAMPLE = load_tool("sample_stage3_train")
EVENT_VAL = load_tool("build_vggt_stage3_event_val")
NUM_GOOD = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A collection of NUM_GOOD valid straight-line episodes, one scene, and a tiny checkpoint."""
    base = tmp_path_factory.mktemp("world")
    root, occ = base / "col", base / "occ"
    write_collection_json(root, NUM_GOOD)
    write_scene(occ, "scene_a")
    for i in range(NUM_GOOD):
        # Each episode covers two of the four events, so every event has candidates in several episodes.
        queries = ((5, None, [EVENT_NAMES[i % 4]]), (36, 10, [EVENT_NAMES[(i + 1) % 4], "required_stop"]))
        write_episode(root, f"ep{i}", queries=queries)
    ckpt = make_checkpoint(base / "ckpt")
    return {"base": base, "root": root, "occ": occ, "ckpt": ckpt}


def _convert(world, out, *extra, root=None):
    argv = [
        "--input-root",
        str(root or world["root"]),
        "--output-dir",
        str(out),
        "--checkpoint",
        str(world["ckpt"]),
        "--occupancy-root",
        str(world["occ"]),
        "--shard-size",
        "5",
        "--val-fraction",
        "0.3",
        "--split-seed",
        "3",
        *extra,
    ]
    return run_cli(CONVERT.main, argv)


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix == ".parquet"}


def test_convert_is_byte_identical_across_runs_and_worker_counts(world, tmp_path, capsys):
    assert _convert(world, tmp_path / "a", "--workers", "1") == 0
    out_a = capsys.readouterr().out
    assert _convert(world, tmp_path / "b", "--workers", "2", "--worker-prefetch", "1") == 0
    out_b = capsys.readouterr().out
    assert "rows/s" in out_a and "with 1 worker(s)" in out_a and "with 2 worker(s)" in out_b
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    ma, mb = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert manifest_content_sha256(ma) == manifest_content_sha256(mb)
    assert ma["run"]["workers"] == 1 and mb["run"]["workers"] == 2
    counts = ma["counts"]
    # 6 episodes x 2 queries x 2 instruction variants.
    assert counts["rows"] == 24 and counts["records"] == 12 and counts["skipped"] == 0
    assert counts["rows_by_split"]["train"] + counts["rows_by_split"]["val"] == 24
    assert counts["rows_by_split"]["val"] > 0 and counts["rows_by_split"]["train"] > 0
    assert ma["action_normalization"] == json.loads((world["ckpt"] / "action_normalization.json").read_text())
    assert ma["checkpoint"]["model_config_hash"] and ma["checkpoint"]["transform_metadata_hash"]
    assert validate_manifest(tmp_path / "a", checkpoint=world["ckpt"], check_references=True) == []
    splits = {}
    for shard in ma["shards"]:
        table = pq.read_table(tmp_path / "a" / shard["file"], columns=["episode_id", "split"])
        assert set(table.column("split").to_pylist()) == {shard["split"]}
        for e in table.column("episode_id").to_pylist():
            splits.setdefault(e, set()).add(shard["split"])
    assert all(len(s) == 1 for s in splits.values())  # the split is by episode


def test_bad_records_are_skipped_and_counted_by_reason(world, tmp_path, capsys):
    root = tmp_path / "col"
    shutil.copytree(world["root"], root)
    ep = root / "episodes"
    for name in ("bad_video", "bad_json", "bad_count", "bad_scene"):
        write_episode(root, name, scene_id="scene_nowhere" if name == "bad_scene" else "scene_a")
    data = bytearray((ep / "bad_video" / "rgb.mp4").read_bytes())
    data[len(data) // 3 :] = bytes(len(data) - len(data) // 3)
    (ep / "bad_video" / "rgb.mp4").write_bytes(bytes(data))
    text = (ep / "bad_json" / "episode.json").read_text()
    (ep / "bad_json" / "episode.json").write_text(text[: len(text) - 25])
    doc = json.loads((ep / "bad_count" / "episode.json").read_text())
    doc["poses"] = doc["poses"][:-1]
    (ep / "bad_count" / "episode.json").write_text(json.dumps(doc))

    assert _convert(world, tmp_path / "out", "--workers", "2", root=root) == 3
    captured = capsys.readouterr()
    assert "NOT USABLE" in captured.err
    m = read_manifest(tmp_path / "out")
    by_reason = {k: v for k, v in m["counts"]["skipped_by_reason"].items() if v}
    assert by_reason == {"unreadable_video": 1, "unreadable_json": 1, "pose_frame_mismatch": 1, "unknown_scene": 1}
    assert m["counts"]["skipped"] == 4 and m["counts"]["rows"] == 24 and m["counts"]["episodes"] == NUM_GOOD + 4
    named = {item["episode_id"]: item["reason"] for item in m["skipped_items"]}
    assert named == {
        "bad_video": "unreadable_video",
        "bad_json": "unreadable_json",
        "bad_count": "pose_frame_mismatch",
        "bad_scene": "unknown_scene",
    }
    for name in named:
        assert name in captured.out
    assert any("counts.skipped is 4" in p for p in validate_manifest(tmp_path / "out"))


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


def test_differing_action_scale_fails_before_writing(world, tmp_path, capsys):
    assert _convert(world, tmp_path / "out", "--action-scale", "0.1,0.2,0.3,2") == 2
    err = capsys.readouterr().err
    assert "--action-scale" in err and "action_normalization.json" in err and "nothing was written" in err
    assert _leftovers(tmp_path) == []
    # Asserting the checkpoint's own values (std 0.1, 0.2, 0.3 for dx, dy, dyaw) is accepted.
    assert _convert(world, tmp_path / "ok", "--action-scale", "0.1,0.2,0.3") == 0


def test_existing_output_directory_is_refused(world, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _convert(world, out) == 2
    assert "already exists" in capsys.readouterr().err
    assert _leftovers(out) == ["keep.txt"] and _leftovers(tmp_path) == ["out"]
    assert run_cli(SAMPLE.main, ["--source-manifest", str(out), "--output-dir", str(out), "--train-size", "1"]) == 2


@pytest.fixture(scope="module")
def converted(world):
    out = world["base"] / "converted"
    assert _convert(world, out, "--workers", "1") == 0
    return out


def _sample(converted, out, size, seed="7"):
    return run_cli(
        SAMPLE.main,
        [
            "--source-manifest",
            str(converted / "manifest.json"),
            "--output-dir",
            str(out),
            "--train-size",
            str(size),
            "--shard-size",
            "2",
            "--seed",
            seed,
        ],
    )


def test_sample_one_row_per_episode_deterministic(converted, tmp_path, capsys):
    eligible = read_manifest(converted)["counts"]["rows_by_split"]["train"]
    train_episodes = {
        e
        for s in read_manifest(converted)["shards"]
        if s["split"] == "train"
        for e in pq.read_table(converted / s["file"], columns=["episode_id"]).column("episode_id").to_pylist()
    }
    assert eligible > len(train_episodes) >= 3
    assert _sample(converted, tmp_path / "a", 3) == 0 and _sample(converted, tmp_path / "b", 3) == 0
    assert "rows/s" in capsys.readouterr().out
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    ma, mb = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert manifest_content_sha256(ma) == manifest_content_sha256(mb)
    episodes = [
        e
        for f in sorted(_files(tmp_path / "a"))
        for e in pq.read_table(tmp_path / "a" / f).column("episode_id").to_pylist()
    ]
    assert len(episodes) == 3 and len(set(episodes)) == 3 and set(episodes) <= train_episodes
    prov = ma["provenance"]
    assert prov["seed"] == 7 and prov["train_size"] == 3 and prov["eligible_episodes"] == len(train_episodes)
    assert prov["source_content_sha256"] == manifest_content_sha256(read_manifest(converted))
    assert ma["action_normalization"] == read_manifest(converted)["action_normalization"]
    assert validate_manifest(tmp_path / "a", kind="train_subset", expected_rows=3) == []

    too_many = len(train_episodes) + 1
    assert _sample(converted, tmp_path / "c", too_many) == 2
    assert f"only {len(train_episodes)} source episodes" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_sample_event_share_prefers_rows_with_the_event(converted, tmp_path, capsys):
    # Every episode of the world has one query with EVENT_NAMES[i % 4] and one with EVENT_NAMES[(i + 1) % 4]
    # and required_stop, so all episodes have a collision_precursor row only where i % 4 in (0, 3).
    def run(out, share):
        return run_cli(SAMPLE.main, ["--source-manifest", str(converted / "manifest.json"), "--output-dir", str(out),
                                     "--train-size", "3", "--seed", "7", "--event-share", share])  # fmt: skip

    assert run(tmp_path / "e", "collision_precursor=1.0") == 0
    out = capsys.readouterr()
    rows = [r for f in sorted(_files(tmp_path / "e")) for r in pq.read_table(tmp_path / "e" / f).to_pylist()]
    with_event = sum("collision_precursor" in r["events"] for r in rows)
    prov = read_manifest(tmp_path / "e")["provenance"]
    assert prov["rows_with_event"] == {"collision_precursor": with_event}
    assert f"{with_event} of the 3 rows carry collision_precursor" in out.out
    assert len({r["episode_id"] for r in rows}) == 3
    # As many rows carry the event as the train split has episodes with such a row (at most 3); a shortfall is
    # said, and filled by the plain rule.
    train = [
        r
        for sh in read_manifest(converted)["shards"]
        if sh["split"] == "train"
        for r in pq.read_table(converted / sh["file"], columns=["episode_id", "events"]).to_pylist()
    ]
    supply = len({r["episode_id"] for r in train if "collision_precursor" in r["events"]})
    assert supply >= 1 and with_event == min(3, supply)
    assert ("warning: --event-share collision_precursor=1.0" in out.err) == (supply < 3)
    for bad in ("nope=0.5", "collision_precursor", "collision_precursor=0", "collision_precursor=x"):
        assert run(tmp_path / "bad", bad) == 2
        assert "--event-share" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def _event_val(world, out, exclude, per_event, *extra):
    argv = [
        "--input-root",
        str(world["root"]),
        "--output-dir",
        str(out),
        "--checkpoint",
        str(world["ckpt"]),
        "--exclude-parquet-dir",
        str(exclude),
        "--occupancy-root",
        str(world["occ"]),
        "--per-event",
        str(per_event),
        *extra,
    ]
    return run_cli(EVENT_VAL.main, argv)


def test_event_val_is_balanced_excludes_training_and_reproducible(world, converted, tmp_path, capsys):
    train = tmp_path / "train"
    assert _sample(converted, train, 2) == 0
    train_eps = set(pq.read_table(train / "train-00000.parquet").column("episode_id").to_pylist())
    assert _event_val(world, tmp_path / "v1", train, 1, "--workers", "2") == 0
    assert _event_val(world, tmp_path / "v2", train, 1) == 0
    out = capsys.readouterr().out
    assert "rows/s" in out
    assert _files(tmp_path / "v1") == _files(tmp_path / "v2")
    m1, m2 = read_manifest(tmp_path / "v1"), read_manifest(tmp_path / "v2")
    assert manifest_content_sha256(m1) == manifest_content_sha256(m2)
    table = pq.read_table(tmp_path / "v1" / "event_val.parquet")
    assert table.num_rows == 4 and set(table.column("split").to_pylist()) == {"val"}
    assert not set(table.column("episode_id").to_pylist()) & train_eps
    assert m1["selection"]["selected"] == dict.fromkeys(EVENT_NAMES, 1)
    for event, ids in m1["selection"]["sample_ids"].items():
        rows = {r["sample_id"]: r for r in table.select(["sample_id", "events"]).to_pylist()}
        assert all(event in rows[s]["events"] for s in ids)
    assert validate_manifest(tmp_path / "v1", kind="event_val", min_rows=4, checkpoint=world["ckpt"]) == []

    # Not enough candidates: nothing written unless --allow-short.
    assert _event_val(world, tmp_path / "v3", train, 50) == 2
    err = capsys.readouterr().err
    assert "fewer than --per-event 50" in err and all(e in err for e in EVENT_NAMES)
    assert not (tmp_path / "v3").exists()
    assert _event_val(world, tmp_path / "v4", train, 50, "--allow-short") == 3
    assert set(read_manifest(tmp_path / "v4")["selection"]["short"]) == set(EVENT_NAMES)
