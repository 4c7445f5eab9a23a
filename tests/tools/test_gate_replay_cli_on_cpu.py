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


def _old_note(call, distance, allowed, logit=1.0):
    """A note as reports written before ``stop_step`` was recorded have it."""
    note = _note(call, distance, allowed, logit=logit)
    del note["stop_step"]
    return note


def _report(path, episodes, sha=None, specs=None, **arguments):
    args = {"stop_gate": True, "stop_votes": 1, "execute_steps": 3, "seed": 2000, "synthesize": 40,
            "level": "two_rooms", "goal_point": "nearest", "max_steps": 128, "num_steps": 10, **arguments}  # fmt: skip
    run = {"episodes": episodes}
    if sha is not None:
        run["checkpoint"] = {"path": f"/ck/{sha[:4]}", "manifest_sha256": sha}
    specs = [{"episode_id": e["episode_id"]} for e in episodes] if specs is None else specs
    path.write_text(json.dumps({"arguments": args, "episodes": specs, "runs": {"checkpoint": run}}))
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


def test_affected_reads_reports_without_stop_step_and_counts_them(tmp_path, capsys):
    tool = load_script("tools/eval/gate_replay.py")
    old = [
        # Ended by a STOP let through at 1.5 m: vetoed at 1.27 m -> replayed; its step is not needed to say so.
        _episode("o0", "stop", False, [_old_note(3, 1.5, True)]),
        # A STOP vetoed at 1.8 m, then one let through at 1.1 m ended it: unchanged at 1.27 m.
        _episode("o1", "stop", True, [_old_note(2, 1.8, False), _old_note(6, 1.1, True)]),
        # Never asked for a STOP.
        _episode("o2", "max_steps", False, None),
        # A newer note, with its step: ended at 1.4 m -> replayed.
        _episode("o3", "stop", True, [_note(4, 1.4, True)]),
    ]
    report = _report(tmp_path / "old.json", old)
    out = tmp_path / "ids.txt"
    assert tool.main(["affected", str(report), "--stop-gate-distance", "1.27", "--output", str(out)]) == 0
    assert out.read_text() == "o0\no3\n"
    printed = capsys.readouterr().out
    # 2 affected of 4 (o0 failed, o3 succeeded); o2 never asked; o0 and o1 have notes without stop_step.
    assert "2 of 4 episodes" in printed and "1 successes, 1 failures" in printed
    assert "1 episodes never asked for a STOP" in printed and "2 have STOP notes without 'stop_step'" in printed
    # At 2.0 m o1's vetoed 1.8 m STOP would pass, and without its step nobody can tell whether it was executed:
    # refused with a message, not a KeyError.
    assert tool.run_cli(tool.main, ["affected", str(report), "--stop-gate-distance", "2.0", "--output",
                                    str(tmp_path / "b")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "episode o1 call 2" in err and "'stop_step'" in err and "tighter" in err
    assert not (tmp_path / "b").exists()


def test_merge_refuses_other_settings_naming_each_and_checks_the_replay_checkpoint(tmp_path, capsys):
    tool = load_script("tools/eval/gate_replay.py")
    base_sha, cal_sha = "a" * 64, "b" * 64
    base = _report(tmp_path / "base.json", BASE, sha=base_sha)
    replayed = [_episode("e0", "stop", True, [_note(9, 1.0, True)])]

    def merge(replay, name, *extra):
        return tool.run_cli(tool.main, ["merge", str(base), str(replay), "--label", "cal", "--output",
                                        str(tmp_path / name), *extra])  # fmt: skip

    # Two settings differ: both are named, nothing is written.
    other = _report(tmp_path / "other.json", replayed, sha=cal_sha, seed=1000, goal_point="random")
    assert merge(other, "m1") == 2
    err = capsys.readouterr().err
    assert "seed: base 2000, replay 1000" in err and "goal_point: base 'nearest', replay 'random'" in err
    assert not (tmp_path / "m1").exists()
    # Same flags but an episode drawn otherwise (another noise seed) is refused too.
    drawn = _report(tmp_path / "drawn.json", replayed, sha=cal_sha, specs=[{"episode_id": "e0", "noise_seed": 7}])
    assert merge(drawn, "m2") == 2 and "['e0']" in capsys.readouterr().err
    # The replay's checkpoint differs from the base's, as it should (calibrated gate): accepted, both recorded.
    replay = _report(tmp_path / "replay.json", replayed, sha=cal_sha, stop_gate_distance=1.27)
    assert merge(replay, "m3", "--expect-checkpoint-sha", "BBBB") == 0
    assert "base aaaaaaaaaaaa, replay bbbbbbbbbbbb" in capsys.readouterr().out
    ckpts = json.loads((tmp_path / "m3").read_text())["merged_from"]["checkpoints"]
    assert ckpts == {"base": {"path": "/ck/aaaa", "manifest_sha256": base_sha},
                     "replay": {"path": "/ck/bbbb", "manifest_sha256": cal_sha}}  # fmt: skip
    # --expect-checkpoint-sha: another prefix, a non-hex prefix, a replay that records no sha: refused.
    assert merge(replay, "m4", "--expect-checkpoint-sha", "aaaa") == 2
    assert "bbbbbbbbbbbb..., not aaaa..." in capsys.readouterr().err
    assert merge(replay, "m5", "--expect-checkpoint-sha", "xyz") == 2
    assert "hex digits" in capsys.readouterr().err
    unsigned = _report(tmp_path / "unsigned.json", replayed)
    assert merge(unsigned, "m6", "--expect-checkpoint-sha", "bbbb") == 2
    assert "records no checkpoint manifest_sha256" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in ("m2", "m4", "m5", "m6"))
