"""GN0 collection parsing: every malformed record is rejected with its reason and the file named."""

from __future__ import annotations

import json
import math

import pytest
from gn0_test_builders import reference, write_collection_json

from verl_omni.data.gn0 import (
    SKIP_REASONS,
    CollectionError,
    RecordRejected,
    list_episode_ids,
    parse_episode,
    read_collection_info,
)


def _episode_doc(num_poses: int = 40) -> dict:
    ref_poses, ref_stop = reference(5, None)
    return {
        "episode_id": "e1",
        "scene_id": "scene_a",
        "instructions": ["go", "walk"],
        "goal": [4.0, 0.0],
        "success_radius": 0.5,
        "video": "rgb.mp4",
        "poses": [[0.1 * k, 0.0, 0.0] for k in range(num_poses)],
        "queries": [
            {
                "t": 5,
                "reference_poses": ref_poses,
                "reference_stop": ref_stop,
                "reference_video": "ref_5.mp4",
                "events": ["required_stop", "collision_precursor"],
            },
        ],
    }


def _write(root, doc=None, text=None, episode_id="e1"):
    ep = root / "episodes" / episode_id
    ep.mkdir(parents=True, exist_ok=True)
    (ep / "episode.json").write_text(text if text is not None else json.dumps(doc))
    return ep / "episode.json"


def _reject(root, doc=None, text=None) -> RecordRejected:
    _write(root, doc, text)
    with pytest.raises(RecordRejected) as info:
        parse_episode(root, "e1")
    return info.value


def test_valid_episode_parses_with_canonical_event_order(tmp_path):
    _write(tmp_path, _episode_doc())
    ep = parse_episode(tmp_path, "e1")
    assert ep.poses.shape == (40, 3) and ep.instructions == ("go", "walk")
    (q,) = ep.queries
    assert q.t == 5 and q.reference_video == "episodes/e1/ref_5.mp4"
    assert q.events == ("collision_precursor", "required_stop")  # EVENT_NAMES order
    assert ep.rejected_queries == ()


def test_truncated_json_is_unreadable(tmp_path):
    text = json.dumps(_episode_doc())
    err = _reject(tmp_path, text=text[: len(text) // 2])
    assert err.reason == "unreadable_json" and "episode.json" in err.detail


def test_missing_episode_json(tmp_path):
    (tmp_path / "episodes" / "e1").mkdir(parents=True)
    with pytest.raises(RecordRejected) as info:
        parse_episode(tmp_path, "e1")
    assert info.value.reason == "missing_file"


@pytest.mark.parametrize(
    "mutate, reason, needle",
    [
        (lambda d: d["poses"][3].__setitem__(1, math.nan), "non_finite", "poses"),
        (lambda d: d.__setitem__("goal", [1.0, math.inf]), "non_finite", "goal"),
        (lambda d: d.pop("scene_id"), "invalid_record", "scene_id"),
        (lambda d: d.__setitem__("instructions", []), "invalid_record", "instructions"),
        (lambda d: d.__setitem__("success_radius", -1), "invalid_record", "success_radius"),
        (lambda d: d.__setitem__("episode_id", "other"), "invalid_record", "episode_id"),
        (lambda d: d.__setitem__("video", "../x.mp4"), "invalid_record", "video"),
    ],
)
def test_episode_level_problems(tmp_path, mutate, reason, needle):
    doc = _episode_doc()
    mutate(doc)
    err = _reject(tmp_path, doc)
    assert err.reason == reason and needle in err.detail and err.reason in SKIP_REASONS


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda q: q.__setitem__("t", 40), "query_out_of_range"),
        (lambda q: q.__setitem__("events", ["collision"]), "unknown_event"),
        (lambda q: q["reference_poses"].pop(), "invalid_record"),
        (lambda q: q["reference_stop"].__setitem__(0, 2), "invalid_record"),
        (lambda q: q["reference_poses"][0].__setitem__(0, 0.4), "reference_mismatch"),
        (lambda q: q["reference_poses"][7].__setitem__(2, math.nan), "non_finite"),
    ],
)
def test_query_level_problems_reject_only_that_query(tmp_path, mutate, reason):
    doc = _episode_doc()
    good = json.loads(json.dumps(doc["queries"][0]))
    good["t"], good["reference_video"] = 6, "ref_6.mp4"
    good["reference_poses"], good["reference_stop"] = reference(6, None)
    mutate(doc["queries"][0])
    doc["queries"].append(good)
    _write(tmp_path, doc)
    ep = parse_episode(tmp_path, "e1")
    assert [q.t for q in ep.queries] == [6]
    ((t, err),) = ep.rejected_queries
    assert err.reason == reason


def test_collection_info_errors_name_the_field(tmp_path):
    with pytest.raises(CollectionError, match="not a directory"):
        read_collection_info(tmp_path / "nope")
    with pytest.raises(CollectionError, match="collection.json"):
        read_collection_info(tmp_path)
    write_collection_json(tmp_path, 1)
    info = read_collection_info(tmp_path)
    assert info.image_size == (16, 16) and info.history_frames == 33
    doc = json.loads((tmp_path / "collection.json").read_text())
    doc["target_frames"] = 17
    (tmp_path / "collection.json").write_text(json.dumps(doc))
    with pytest.raises(CollectionError, match="target_frames"):
        read_collection_info(tmp_path)


def test_episode_ids_are_sorted(tmp_path):
    for name in ("b", "a10", "a2"):
        (tmp_path / "episodes" / name).mkdir(parents=True)
    assert list_episode_ids(tmp_path) == ["a10", "a2", "b"]


def test_goal_object_bearing_is_optional_and_checked(tmp_path):
    doc = _episode_doc()
    _write(tmp_path, doc)
    assert parse_episode(tmp_path, "e1").queries[0].goal_object_bearing is None  # older records lack the field
    doc["queries"][0]["goal_object_bearing"] = 0.25
    _write(tmp_path, doc)
    assert parse_episode(tmp_path, "e1").queries[0].goal_object_bearing == 0.25
    doc["queries"][0]["goal_object_bearing"] = None  # recorded: not in view
    _write(tmp_path, doc)
    assert math.isnan(parse_episode(tmp_path, "e1").queries[0].goal_object_bearing)
    doc["queries"][0]["goal_object_distance"] = 1.5
    _write(tmp_path, doc)
    assert parse_episode(tmp_path, "e1").queries[0].goal_object_distance == 1.5
    for key, bad in (("goal_object_bearing", 4.0), ("goal_object_bearing", "left"), ("goal_object_bearing", True),
                     ("goal_object_distance", -0.5)):  # fmt: skip
        doc["queries"][0][key] = bad
        _write(tmp_path, doc)
        ep = parse_episode(tmp_path, "e1")
        ((_, err),) = ep.rejected_queries
        assert err.reason == "invalid_record" and key in str(err)
        doc["queries"][0][key] = 0.25
