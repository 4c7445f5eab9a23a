"""tools/eval/gate_replay.py: which episodes a tighter STOP-gate distance changes, and the merged run."""

import json

from stage3_e2e_helpers import load_script


def _note(call, distance, allowed, stop_step=0, logit=1.0):
    return {"call": call, "step": 3 * call, "stop_asked": True, "stop_step": stop_step, "stop_allowed": allowed,
            "gate_visible_logit": logit, "gate_distance_m": distance}  # fmt: skip


def _episode(eid, end, success, notes):
    ep = {"episode_id": eid, "end_reason": end, "success": success, "ne": 0.3 if success else 1.0}
    if notes is not None:
        ep["policy_notes"] = notes
    return ep


def _report(path, episodes, **arguments):
    args = {"stop_gate": True, "stop_votes": 1, "execute_steps": 3, "seed": 2000, "synthesize": 40,
            "level": "two_rooms", "goal_point": "nearest", "max_steps": 128, "num_steps": 10, **arguments}  # fmt: skip
    path.write_text(json.dumps({"arguments": args, "episodes": [{"episode_id": e["episode_id"]} for e in episodes],
                                "runs": {"checkpoint": {"episodes": episodes}}}))  # fmt: skip
    return path


BASE = [
    # Ended by a STOP let through at a predicted 1.5 m: a 1.27 m gate vetoes it -> replayed.
    _episode("e0", "stop", False, [_note(2, 1.8, False), _note(5, 1.5, True)]),
    # Ended by a STOP at 1.1 m: still passes at 1.27 m.
    _episode("e1", "stop", True, [_note(4, 1.1, True)]),
    # A STOP let through at 1.6 m but at chunk step 5, beyond the 3 executed: nothing ended; timed out later.
    _episode("e2", "max_steps", False, [_note(1, 1.6, True, stop_step=5)]),
    # Never asked for a STOP (no notes at all).
    _episode("e3", "max_steps", False, None),
    # Ended by a successful STOP at 1.4 m: vetoed at 1.27 m -> replayed (a success the tighter gate may lose).
    _episode("e4", "stop", True, [_note(7, 1.4, True)]),
]


def test_affected_are_the_episodes_ended_by_a_stop_beyond_the_new_distance(tmp_path, capsys):
    tool = load_script("tools/eval/gate_replay.py")
    report = _report(tmp_path / "base.json", BASE)
    out = tmp_path / "ids.txt"
    assert tool.main(["affected", str(report), "--stop-gate-distance", "1.27", "--output", str(out)]) == 0
    assert out.read_text() == "e0\ne4\n"
    printed = capsys.readouterr().out
    assert "2 of 5 episodes" in printed and "1 successes, 1 failures" in printed
    # At 1.0 m the 1.1 m STOP of e1 goes too; at 2.0 m (not tighter than what passed) nothing changes.
    assert tool.main(["affected", str(report), "--stop-gate-distance", "1.0", "--output", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a").read_text() == "e0\ne1\ne4\n"
    # A looser distance that would let e0's vetoed 1.8 m STOP (step 0, executed) through is refused.
    assert tool.run_cli(tool.main, ["affected", str(report), "--stop-gate-distance", "2.0", "--output",
                                    str(tmp_path / "b")]) != 0  # fmt: skip
    assert "tighter" in capsys.readouterr().err and not (tmp_path / "b").exists()
    # Several STOP votes, or a run without the gate, cannot be replayed this way.
    votes = _report(tmp_path / "votes.json", BASE, stop_votes=3)
    assert tool.run_cli(tool.main, ["affected", str(votes), "--stop-gate-distance", "1.0", "--output",
                                    str(tmp_path / "c")]) != 0  # fmt: skip
    assert "--stop-votes 3" in capsys.readouterr().err
    # Outputs are never overwritten.
    assert tool.run_cli(tool.main, ["affected", str(report), "--stop-gate-distance", "1.27", "--output",
                                    str(out)]) != 0  # fmt: skip
    assert "never overwritten" in capsys.readouterr().err


def test_merge_swaps_in_the_replayed_episodes(tmp_path, capsys):
    tool = load_script("tools/eval/gate_replay.py")
    base = _report(tmp_path / "base.json", BASE)
    replayed = [_episode("e0", "stop", True, [_note(9, 1.0, True)]), _episode("e4", "max_steps", False, [])]
    replay = _report(tmp_path / "replay.json", replayed, stop_gate_distance=1.27)
    out = tmp_path / "merged.json"
    assert tool.main(["merge", str(base), str(replay), "--label", "cal", "--output", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["label"] == "cal" and merged["merged_from"]["replayed"] == ["e0", "e4"]
    assert merged["merged_from"]["replay_stop_gate_distance"] == 1.27
    assert [e["episode_id"] for e in merged["episodes"]] == ["e0", "e1", "e2", "e3", "e4"]
    assert [e["success"] for e in merged["episodes"]] == [True, True, False, False, False]
    assert merged["episodes"][1] == BASE[1] and merged["episodes"][0] == replayed[0]
    # paired_reports reads the merged file like a train_stage2.py report.
    from verl_omni.sim.eval_metrics import report_runs

    runs, specs = report_runs(out)
    assert list(runs) == ["cal"] and len(runs["cal"]) == 5 and specs == [{"episode_id": e["episode_id"]} for e in BASE]
    # A replay with other settings, or of episodes the base run does not have, is refused.
    other = _report(tmp_path / "other.json", replayed, execute_steps=8)
    assert tool.run_cli(tool.main, ["merge", str(base), str(other), "--label", "x", "--output",
                                    str(tmp_path / "m2")]) != 0  # fmt: skip
    assert "execute_steps" in capsys.readouterr().err
    stranger = _report(tmp_path / "stranger.json", [_episode("e9", "stop", True, [])])
    assert tool.run_cli(tool.main, ["merge", str(base), str(stranger), "--label", "x", "--output",
                                    str(tmp_path / "m3")]) != 0  # fmt: skip
    assert "e9" in capsys.readouterr().err
