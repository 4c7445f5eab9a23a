"""tools/eval/episode_strata.py: draws the evaluation's episodes again and splits a report's success by stratum."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--level", "one_room", "--goal-point", "nearest", "--synthesize", "2", "--seed", "7", "--episodes", "6"]


def _cli():
    spec = importlib.util.spec_from_file_location("episode_strata_cli", ROOT / "tools/eval/episode_strata.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(path: Path, ids) -> Path:
    # Episode ids as the evaluators name them (<scene>_ev<k>, round-robin over h0000, h0001); even k succeed.
    eps = [{"episode_id": i, "success": k % 2 == 0} for k, i in enumerate(ids)]
    path.write_text(json.dumps({"label": "ckpt", "episodes": eps}))
    return path


def test_rates_cover_every_episode_and_output_is_not_overwritten(tmp_path, capsys):
    cli = _cli()
    ids = [f"h{k % 2:04d}_ev{k:03d}" for k in range(6)]
    report = _report(tmp_path / "r.json", ids)
    out = tmp_path / "strata.json"
    assert cli.main([str(report), *ARGS, "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| same_room (" in table and "ckpt: yes" in table
    rates = json.loads(out.read_text())["rates"]["ckpt"]
    for name, sides in rates.items():
        assert sides["yes"]["episodes"] + sides["no"]["episodes"] == 6, name
        assert sides["yes"]["count"] + sides["no"]["count"] == 3, name  # three of the six succeeded
    # one_room has one room: every goal object is in the start room.
    assert rates["same_room"]["yes"]["episodes"] == 6
    assert cli.main([str(report), *ARGS, "--output", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


def test_report_from_other_episodes_is_refused_naming_one(tmp_path, capsys):
    report = _report(tmp_path / "r.json", ["h0000_ev000", "h0005_ev042"])
    assert _cli().main([str(report), *ARGS]) == 2
    assert "h0005_ev042" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", json.dumps({"runs": {}})])
def test_unreadable_report_is_refused_naming_the_file(tmp_path, capsys, text):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert _cli().main([str(bad), *ARGS]) == 2
    assert str(bad) in capsys.readouterr().err


def _specs(seed):
    from verl_omni.sim.collector import CollectorConfig
    from verl_omni.sim.heldout import sample_episode_specs, synthesize_heldout_scenes
    from verl_omni.sim.levels import get_level

    level = get_level("one_room")
    task = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point="nearest")
    plans = synthesize_heldout_scenes(2, seed, level.floorplan(), task=task)
    return [s.to_dict() for s in sample_episode_specs(plans, 6, seed, task)]


def test_carried_specs_must_be_the_episodes_drawn_here(tmp_path, capsys):
    """The same ids name other episodes under another seed: a report that carries its specs is checked."""
    ids = [f"h{k % 2:04d}_ev{k:03d}" for k in range(6)]
    report = _report(tmp_path / "r.json", ids)
    data = json.loads(report.read_text())
    for seed, code in ((7, 0), (8, 2)):  # ARGS draw with seed 7
        data["specs"] = _specs(seed)
        report.write_text(json.dumps(data))
        assert _cli().main([str(report), *ARGS]) == code
        err = capsys.readouterr().err
        assert ("another start or goal" in err) == (code == 2) and "no episode specs" not in err


def test_metric_that_is_not_a_boolean_field_is_refused(tmp_path, capsys):
    report = _report(tmp_path / "r.json", [f"h{k % 2:04d}_ev{k:03d}" for k in range(6)])
    assert _cli().main([str(report), *ARGS, "--metric", "spl"]) == 2
    assert "'spl'" in capsys.readouterr().err
