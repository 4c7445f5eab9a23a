"""tools/data/collect_dagger.py with a real (random) tiny WNM checkpoint as the learner."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_tool(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    maker = _load_tool("tools/checkpoint/make_tiny_wnm_checkpoint.py", "make_tiny_wnm_checkpoint")
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert maker.main(["--output-dir", str(out), "--no-progress"]) == 0
    return out


def test_collects_a_readable_round(tiny_checkpoint, tmp_path, capsys):
    tool = _load_tool("tools/data/collect_dagger.py", "collect_dagger")
    out, occ = tmp_path / "r1", tmp_path / "r1_occ"
    args = ["--policy-checkpoint", str(tiny_checkpoint), "--beta", "0.5", "--level", "one_room"]
    args += ["--num-scenes", "1", "--episodes-per-scene", "2", "--max-steps", "16", "--num-steps", "2", "--seed", "1"]
    args += ["--no-progress"]
    assert tool.main([*args, "--output-dir", str(out), "--occupancy-dir", str(occ)]) == 0
    meta = json.loads((out / "collection.json").read_text())
    assert meta["policy"]["type"] == "dagger" and meta["policy"]["beta"] == 0.5 and meta["level"] == "one_room"
    assert meta["policy"]["learner"]["manifest_sha256"]
    assert meta["dagger_summary"]["episodes"] == 2
    assert len(list((out / "episodes").iterdir())) == 2 and (occ / "s0000").is_dir()
    from verl_omni.data.gn0 import parse_episode

    for ep in ("s0000_d000", "s0000_d001"):
        parsed = parse_episode(out, ep)  # the converter's own parser accepts the round
        assert parsed.queries
    # Never overwritten: a second run into the same folders is refused and leaves them as they were.
    with pytest.raises(SystemExit, match="not empty"):
        tool.main([*args, "--output-dir", str(out), "--occupancy-dir", str(tmp_path / "other")])
    with pytest.raises(SystemExit):
        tool.main([*args[:2], "--beta", "1.5", *args[4:], "--output-dir", str(tmp_path / "x"), "--occupancy-dir",
                   str(tmp_path / "y")])  # fmt: skip


def test_behaviour_policy_replans_every_execute_steps(tiny_checkpoint, tmp_path):
    """--execute-steps 2: the behaviour policy is asked again after every 2 executed steps, so an episode of m
    motion steps made at least ceil(m / 2) policy calls (with one chunk of 8 a call it could make ceil(m / 8))."""
    tool = _load_tool("tools/data/collect_dagger.py", "collect_dagger")
    out, occ = tmp_path / "r1", tmp_path / "r1_occ"
    args = ["--policy-checkpoint", str(tiny_checkpoint), "--beta", "1.0", "--level", "one_room", "--num-scenes", "1",
            "--episodes-per-scene", "2", "--max-steps", "16", "--num-steps", "2", "--seed", "1", "--no-progress",
            "--execute-steps", "2", "--output-dir", str(out), "--occupancy-dir", str(occ)]  # fmt: skip
    assert tool.main(args) == 0

    def no_constant(name):  # NaN/Infinity: not JSON; the converter's manifest would refuse the collection
        raise AssertionError(f"collection.json holds {name}")

    summary = json.loads((out / "collection.json").read_text(), parse_constant=no_constant)["dagger_summary"]
    assert summary["execute_steps"] == 2
    assert summary["learner_only_episodes"] == 0 and summary["learner_only_success_rate"] is None  # beta 1
    for ep in sorted((out / "episodes").iterdir()):
        record = json.loads((ep / "episode.json").read_text())
        steps = len(record["poses"]) - 1  # the start pose, then one per executed motion step
        calls = record["behaviour"]["expert_calls"] + record["behaviour"]["learner_calls"]
        assert steps > 8, "the expert (beta 1) drives more than one chunk, so the bound below bites"
        assert calls >= -(-steps // 2), (steps, calls)
