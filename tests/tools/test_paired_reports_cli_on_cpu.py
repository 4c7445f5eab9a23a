"""tools/eval/paired_reports.py: runs of several reports side by side, paired by episode id."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli():
    spec = importlib.util.spec_from_file_location("paired_reports_cli", ROOT / "tools/eval/paired_reports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _episode(i, success, collisions):
    return {"episode_id": i, "success": success, "oracle_success": success, "collisions": collisions, "steps": 8,
            "path_length": 1.0, "spl": 0.5 if success else 0.0, "ne": 1.0, "collided": collisions > 0}  # fmt: skip


def test_paired_differences_by_episode_id_with_hand_values(tmp_path, capsys):
    cli = _cli()
    # base: a closed_loop_eval report (runs under "runs"), successes on e0 only, collisions 4, 2, 0.
    base = {"episodes": [], "runs": {"ckpt": {"episodes": [_episode("e0", True, 4), _episode("e1", False, 2),
                                                             _episode("e2", False, 0)]}}}  # fmt: skip
    (tmp_path / "base.json").write_text(json.dumps(base))
    # other: a train_stage2 per-checkpoint report, same label, episodes in another order; successes e0 and e1,
    # collisions 1, 1, 0.
    other = {"label": "ckpt", "episodes": [_episode("e1", True, 1), _episode("e2", False, 0), _episode("e0", True, 1)]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    out = tmp_path / "paired.json"
    argv = [f"x8={tmp_path / 'base.json'}", f"x4={tmp_path / 'other.json'}", "--output", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "| x4 |" in table and "Paired differences, run - x8" in table
    result = json.loads(out.read_text())
    assert result["base"] == "x8"
    assert result["runs"]["x8"]["success"]["mean"] == pytest.approx(1 / 3)
    assert result["runs"]["x4"]["success"]["mean"] == pytest.approx(2 / 3)
    # per episode (e0, e1, e2): success differences 0, +1, 0 -> mean 1/3; collisions -3, -1, 0 -> mean -4/3.
    diff = result["paired"]["x4"]
    assert diff["success"]["mean"] == pytest.approx(1 / 3)
    assert diff["collisions"]["mean"] == pytest.approx(-4 / 3)
    # Student-t with 2 degrees of freedom: sd of (-3, -1, 0) is sqrt(7/3), t(0.975, 2) = 4.302653.
    half = 4.302653 * (7 / 3) ** 0.5 / 3**0.5
    assert diff["collisions"]["low"] == pytest.approx(-4 / 3 - half, rel=1e-5)
    # the output is never overwritten
    assert cli.main(argv) == 2
    assert "exists" in capsys.readouterr().err


def test_refuses_other_episodes_and_ambiguous_names(tmp_path, capsys):
    cli = _cli()
    a = {"label": "ckpt", "episodes": [_episode("e0", True, 0), _episode("e1", False, 0)]}
    b = {"label": "ckpt", "episodes": [_episode("e0", True, 0), _episode("e9", False, 0)]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert cli.main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}"]) == 2
    assert "covers other episodes" in capsys.readouterr().err
    # the same label twice without NAME=: the error says how to name it
    assert cli.main([str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 2
    assert "NAME=" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main([str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().err


def test_premature_stops_binned_by_distance_beyond_the_radius_by_hand(tmp_path, capsys):
    cli = _cli()
    # Radius 0.5 m everywhere. Premature STOPs end 0.6 m (0.1 beyond: first bin), 1.0 m (0.5 beyond: still the
    # first bin, edges are inclusive above), 1.9 m (1.4 beyond: second) and 3.0 m (2.5 beyond: third) from the
    # goal; a success at 0.3 m and a timeout at 2.0 m are not premature STOPs and are not counted.
    ends = {"e0": (0.6, True), "e1": (1.0, True), "e2": (1.9, True), "e3": (3.0, True), "e4": (0.3, False),
            "e5": (2.0, False)}  # fmt: skip
    episodes = [{**_episode(i, ne < 0.5, 0), "ne": ne, "premature_stop": prem} for i, (ne, prem) in ends.items()]
    specs = [{"episode_id": i, "success_radius": 0.5} for i in ends]
    (tmp_path / "a.json").write_text(json.dumps({"episodes": specs, "runs": {"a": {"episodes": episodes}}}))
    assert cli.premature_stop_bins(episodes, {i: 0.5 for i in ends}, (0.5, 1.5)) == [2, 1, 1]
    out = tmp_path / "p.json"
    assert cli.main([str(tmp_path / "a.json"), "--output", str(out)]) == 0
    assert "| a | 2 | 1 | 1 | 4 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["premature_stop_bins"]["counts"] == {"a": [2, 1, 1]}
    # One edge: (0, 1] and beyond.
    assert cli.premature_stop_bins(episodes, {i: 0.5 for i in ends}, (1.0,)) == [2, 2]
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "a.json"), "--stop-bins", "1.5,0.5"])
    # Specs without a success radius: a clear refusal that names the file, nothing written.
    bad = {"episodes": [{"episode_id": i} for i in ends], "runs": {"a": {"episodes": episodes}}}
    (tmp_path / "b.json").write_text(json.dumps(bad))
    assert cli.main([str(tmp_path / "b.json"), "--output", str(tmp_path / "q.json")]) == 2
    assert "success_radius" in capsys.readouterr().err and not (tmp_path / "q.json").exists()
