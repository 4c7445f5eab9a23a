"""tools/data/synthesize_gn0_collection.py: determinism, refusal of non-empty outputs, clear errors."""

import importlib.util
import json
from pathlib import Path

import pytest

from verl_omni.data.video import count_frames

TOOL = Path(__file__).resolve().parents[2] / "tools" / "data" / "synthesize_gn0_collection.py"
TINY = ["--num-scenes", "2", "--episodes-per-scene", "1", "--image-size", "16", "--seed", "3"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("synthesize_gn0_collection", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _json_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.json"))}


def test_collection_is_complete_and_deterministic_across_worker_counts(tool, tmp_path, capsys):
    assert tool.main(["--output-dir", str(tmp_path / "c1"), "--occupancy-dir", str(tmp_path / "o1"), *TINY]) == 0
    out = capsys.readouterr().out
    assert "scenes:        2" in out and "episodes:      2" in out and "seconds:" in out
    assert (
        tool.main(
            ["--output-dir", str(tmp_path / "c2"), "--occupancy-dir", str(tmp_path / "o2"), *TINY, "--workers", "2"]
        )
        == 0
    )
    a, b = _json_files(tmp_path / "c1"), _json_files(tmp_path / "c2")
    assert a == b and "collection.json" in a and len(a) == 3
    meta = json.loads(a["collection.json"])
    assert meta["format"] == "gn0-dagger/1" and meta["image_size"] == [16, 16] and meta["num_episodes"] == 2
    for ep in sorted((tmp_path / "c1" / "episodes").iterdir()):
        rec = json.loads((ep / "episode.json").read_text())
        assert count_frames(ep / "rgb.mp4") == len(rec["poses"])
        assert (tmp_path / "o1" / rec["scene_id"] / "occupancy.png").is_file()
        assert (tmp_path / "o1" / rec["scene_id"] / "occupancy.json").is_file()
    # Only the two outputs exist next to each other: no partial folders were left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1", "c2", "o1", "o2"]


def test_refuses_non_empty_output(tool, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        tool.main(["--output-dir", str(tmp_path / "c"), "--occupancy-dir", str(tmp_path / "o"), *TINY])
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_bad_arguments_exit_non_zero(tool, tmp_path, capsys):
    base = ["--output-dir", str(tmp_path / "c"), "--occupancy-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        tool.main([*base, "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tool.main([*base, "--scene-size-m", "0.5", "0.5"])
    assert e.value.code == 2 and "size_m" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tool.main([*base, "--image-size", "15"])
    assert e.value.code == 2 and "width" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unreachable_goal_distance_leaves_nothing(tool, tmp_path, capsys):
    # A single 2.4 m room cannot hold a start 3 m (geodesic) away from any goal.
    args = ["--output-dir", str(tmp_path / "c"), "--occupancy-dir", str(tmp_path / "o"), "--num-scenes", "1"]
    args += ["--scene-size-m", "2.6", "2.6", "--max-rooms", "1", "--image-size", "16"]
    assert tool.main(args) == 1
    assert "found no start" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_search_expert_labels_turn_in_place_where_they_differ_from_the_map_expert(tool, tmp_path):
    import math

    import numpy as np

    args = ["--num-scenes", "3", "--episodes-per-scene", "2", "--level", "one_room", "--seed", "1"]
    refs = {}
    for kind in ("map", "search"):
        out = tmp_path / kind
        assert tool.main(["--output-dir", str(out), "--occupancy-dir", str(tmp_path / f"{kind}_occ"), *args,
                          "--label-expert", kind]) == 0  # fmt: skip
        assert json.loads((out / "collection.json").read_text())["label_expert"] == kind
        for ep in sorted((out / "episodes").iterdir()):
            rec = json.loads((ep / "episode.json").read_text())
            for q in rec["queries"]:
                refs.setdefault((ep.name, q["t"]), {})[kind] = np.array(q["reference_poses"])
    differ = [k for k, r in refs.items() if not np.allclose(r["map"], r["search"])]
    assert differ, "the search expert changed no label (every goal already in view?)"
    for key in differ:  # the search expert's reference begins with a left turn in place (30 degrees per step)
        p = refs[key]["search"]
        assert np.allclose(p[1, :2], p[0, :2]), key
        assert math.isclose(math.remainder(p[1, 2] - p[0, 2], 2 * math.pi), math.pi / 6, abs_tol=1e-9), key


def test_face_goal_object_flag_reaches_the_collection(tool, tmp_path):
    out = tmp_path / "face"
    args = ["--num-scenes", "1", "--episodes-per-scene", "1", "--level", "one_room", "--seed", "1"]
    assert tool.main(["--output-dir", str(out), "--occupancy-dir", str(tmp_path / "face_occ"), *args,
                      "--face-goal-object"]) == 0  # fmt: skip
    info = json.loads((out / "collection.json").read_text())
    assert info["face_goal_object"] is True and info["label_expert"] == "map"
