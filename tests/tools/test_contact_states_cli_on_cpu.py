"""tools/eval/contact_states.py: blocked-step streaks and clearance of the visited and blocked states, by hand."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from verl_omni.data.occupancy import OccupancyMap

ROOT = Path(__file__).resolve().parents[2]


def _cli():
    spec = importlib.util.spec_from_file_location("contact_states_cli", ROOT / "tools/eval/contact_states.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _world(tmp_path: Path) -> tuple[Path, Path]:
    # A 2 x 2 m map at 5 cm with a wall along its left edge (x < 0.05 m): clearance is about x at height 1 m.
    occupied = np.zeros((40, 40), bool)
    occupied[:, 0] = True
    scenes = tmp_path / "scenes"
    OccupancyMap.from_grid(occupied, 0.05, scene_id="s0").save(scenes / "s0")

    def episode(xs, blocked):
        return {"episode_id": f"s0_ev{len(xs)}{sum(blocked)}", "scene_id": "s0", "success": False,
                "poses": [[x, 1.0, 0.0] for x in xs], "blocked": blocked}  # fmt: skip

    eps = [
        episode([0.3, 0.3, 0.3, 1.0, 1.0], [True, True, True, False]),  # one contact of 3 steps near the wall
        episode([1.0, 1.0, 1.0, 1.0, 1.0], [False, True, False, True]),  # two single-step contacts in the open
    ]
    report = tmp_path / "eval" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"format": "wnm-closed-loop-eval/1", "runs": {"checkpoint": {"episodes": eps}}}))
    return report, scenes


def test_streak_share_by_hand():
    cli = _cli()
    assert cli.streak_share([True, True, True, False, True], 3) == (4, 3)
    assert cli.streak_share([False, False], 3) == (0, 0)
    assert cli.streak_share([True, False, True], 1) == (2, 2)


def test_contacts_and_clearances_by_hand(tmp_path, capsys):
    cli = _cli()
    report, scenes = _world(tmp_path)
    out = tmp_path / "contacts.json"
    assert cli.main([str(report), "--scenes", str(scenes), "--thresholds", "0.5", "--output", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["eval/checkpoint"]
    # 5 blocked steps in 2 episodes, in 1 + 2 contacts; 3 of them in the run of 3.
    assert run["blocked_per_episode"] == pytest.approx(2.5) and run["contacts_per_episode"] == pytest.approx(1.5)
    assert run["blocked_in_streaks"] == pytest.approx(3 / 5)
    # The states the policy was at before each step: 3 of 8 at x = 0.3 m (< 0.5 m), the rest at 1 m; the blocked
    # steps: 3 of 5 from x = 0.3 m.
    assert run["states"] == 8 and run["states_closer_than"]["0.5"] == pytest.approx(3 / 8)
    assert run["blocked_closer_than"]["0.5"] == pytest.approx(3 / 5)
    assert "| eval/checkpoint | 2 | 2.50 | 1.50 | 60.0% | 37.5% | 60.0% |" in capsys.readouterr().out
    # Never overwritten; a report without per-step records and a missing scene are named.
    with pytest.raises(cli.CliError, match="already exists"):
        cli.main([str(report), "--scenes", str(scenes), "--output", str(out)])
    with pytest.raises(cli.CliError, match="--scenes .*no folder for scene 's0'"):
        cli.main([str(report), "--scenes", str(tmp_path / "none")])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"runs": {"c": {"episodes": [{"episode_id": "x", "scene_id": "s0"}]}}}))
    with pytest.raises(cli.CliError, match="no per-step poses/blocked"):
        cli.main([str(bare), "--scenes", str(scenes)])


def test_start_clearances_by_hand(tmp_path):
    cli = _cli()
    _, scenes = _world(tmp_path)
    occ = OccupancyMap.load(scenes / "s0")
    summary = cli.start_clearances(
        [("s0", [0.3, 1.0, 0.0]), ("s0", [1.0, 1.0, 2.0])], lambda s, xy: occ.clearance_at(xy)
    )
    # The wall is the column of cells x < 0.05 m, and off the 2 x 2 m map counts as blocked too: the first start
    # is 0.25-0.3 m from the wall, the second 0.95-1.0 m from the wall and 1 m from the map's other edges.
    assert summary["prompts"] == 2 and 0.2 < summary["min_clearance"] < 0.31
    assert 0.9 < summary["clearances"][1] <= 1.0
