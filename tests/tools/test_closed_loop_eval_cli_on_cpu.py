"""tools/eval/closed_loop_eval.py end to end on the real tiny checkpoint (make_tiny_wnm_checkpoint, no SFT)."""

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
FAST = ["--episodes", "2", "--max-steps", "8", "--num-steps", "2", "--seed", "4", "--no-progress"]


def _load_tool(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    return _load_tool("tools/eval/closed_loop_eval.py", "closed_loop_eval")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    maker = _load_tool("tools/checkpoint/make_tiny_wnm_checkpoint.py", "make_tiny_wnm_checkpoint")
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert maker.main(["--output-dir", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def compared(tool, tiny_checkpoint, tmp_path_factory):
    """The checkpoint compared with itself on one synthesized held-out scene."""
    out = tmp_path_factory.mktemp("eval") / "run"
    args = ["--checkpoint", str(tiny_checkpoint), "--compare", str(tiny_checkpoint), "--synthesize", "1", *FAST]
    assert tool.main([*args, "--output-dir", str(out)]) == 0
    return out


def test_compare_writes_report_plot_and_scenes(compared, capsys):
    report = json.loads((compared / "report.json").read_text())
    assert report["format"] == "wnm-closed-loop-eval/1"
    assert [e["episode_id"] for e in report["episodes"]] == ["h0000_ev000", "h0000_ev001"]
    runs = report["runs"]
    assert set(runs) == {"checkpoint", "compare"}
    for run in runs.values():
        agg = run["aggregate"]
        assert agg["episodes"] == 2
        for name in ("success", "oracle_success", "spl", "ne", "collisions", "collided"):
            assert {"mean", "low", "high", "method"} <= set(agg[name])
        for ep in run["episodes"]:
            assert ep["end_reason"] in ("stop", "max_steps", "collision")
            assert len(ep["poses"]) == ep["steps"] + 1 and len(ep["actions"]) == ep["steps"]
            assert ep["steps"] <= 8
    # The same checkpoint on the same episodes and noise seeds behaves identically.
    assert runs["checkpoint"]["episodes"] == runs["compare"]["episodes"]
    cmp = report["comparison"]
    assert cmp["contract_compatible"] and cmp["same_initial_noise"]
    assert all(cmp["paired_differences"][m]["mean"] == 0.0 for m in ("success", "spl", "ne", "collisions"))
    with Image.open(compared / "trajectories.png") as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 300
    assert (compared / "scenes" / "h0000" / "occupancy.png").is_file()
    assert (compared / "scenes" / "h0000" / "semantics.json").is_file()
    assert sorted(p.name for p in compared.iterdir()) == ["report.json", "scenes", "trajectories.png"]


def test_saved_scenes_reproduce_the_episodes(tool, tiny_checkpoint, compared, tmp_path, capsys):
    out = tmp_path / "again"
    # Episode k depends only on (scenes, seed, k): one episode reproduces the first of the earlier run.
    args = ["--checkpoint", str(tiny_checkpoint), "--scenes", str(compared / "scenes"), *FAST, "--episodes", "1"]
    assert tool.main([*args, "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SR" in printed and "SPL" in printed and "NE (m)" in printed and "report.json" in printed
    first = json.loads((compared / "report.json").read_text())
    second = json.loads((out / "report.json").read_text())
    assert second["episodes"] == first["episodes"][:1]
    assert second["runs"]["checkpoint"]["episodes"] == first["runs"]["checkpoint"]["episodes"][:1]
    assert second["comparison"] is None


def test_refuses_to_overwrite(tool, tiny_checkpoint, compared, capsys):
    before = {p.name: p.read_bytes() for p in compared.iterdir() if p.is_file()}
    args = ["--checkpoint", str(tiny_checkpoint), "--synthesize", "1", *FAST, "--output-dir", str(compared)]
    from verl_omni.data.cli_common import run_cli

    assert run_cli(tool.main, args) == 2
    assert "already exist" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in compared.iterdir() if p.is_file()} == before


def test_bad_inputs_exit_non_zero(tool, tiny_checkpoint, tmp_path, capsys):
    from verl_omni.data.cli_common import run_cli

    base = ["--output-dir", str(tmp_path / "o"), "--no-progress"]
    assert run_cli(tool.main, ["--checkpoint", str(tiny_checkpoint), *base]) == 2
    assert "--synthesize" in capsys.readouterr().err
    assert run_cli(tool.main, ["--checkpoint", str(tmp_path / "missing"), "--synthesize", "1", *base]) == 2
    assert "not a WNM checkpoint" in capsys.readouterr().err
    assert run_cli(tool.main, ["--checkpoint", str(tiny_checkpoint), "--scenes", str(tmp_path), *base]) == 2
    assert "neither a scene" in capsys.readouterr().err
    # The STOP gate needs the checkpoint's stop_gate/ (a view-head run); this one has none: the message says so.
    assert run_cli(tool.main, ["--checkpoint", str(tiny_checkpoint), "--synthesize", "1", "--stop-gate", *base]) == 2
    assert "stop_gate" in capsys.readouterr().err
    gate_distance = ["--checkpoint", str(tiny_checkpoint), "--synthesize", "1", "--stop-gate-distance", "1.0", *base]
    assert run_cli(tool.main, gate_distance) == 2
    assert "--stop-gate-distance needs --stop-gate" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        tool.main(["--checkpoint", str(tiny_checkpoint), "--episodes", "0", *base])


def test_scripted_policies_on_a_level(tool, tmp_path, capsys):
    """--policy without a checkpoint: the expert succeeds, STOP-at-once fails, both on the same episodes."""
    out = tmp_path / "baselines"
    args = ["--policy", "expert", "stop", "--level", "one_room", "--synthesize", "1", "--episodes", "3", "--seed", "2"]
    assert tool.main([*args, "--no-progress", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["runs"]) == {"policy:expert", "policy:stop"}
    assert report["settings"]["level"] == "one_room" and report["settings"]["floorplan"]["max_rooms"] == 1
    expert, stop = report["runs"]["policy:expert"], report["runs"]["policy:stop"]
    assert expert["aggregate"]["success"]["mean"] == 1.0 and stop["aggregate"]["success"]["mean"] == 0.0
    assert stop["aggregate"]["premature_stop"]["mean"] == 1.0 and stop["aggregate"]["progress"]["mean"] == 0.0
    assert [e["episode_id"] for e in expert["episodes"]] == [e["episode_id"] for e in stop["episodes"]]
    assert "premature STOP" in capsys.readouterr().out


def test_policy_and_level_errors(tool, tmp_path, capsys):
    from verl_omni.data.cli_common import run_cli

    base = ["--synthesize", "1", "--output-dir", str(tmp_path / "o"), "--no-progress"]
    assert run_cli(tool.main, base) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert run_cli(tool.main, ["--policy", "compass", *base]) == 2
    assert "goal_bearing" in capsys.readouterr().err
    assert run_cli(tool.main, ["--policy", "stop", "--level", "castle", *base]) == 2
    assert "one_room" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_stop_gate_decisions_are_reported(tool, tiny_checkpoint, tmp_path, capsys):
    # The tiny checkpoint with a gate whose head answers "object in view at 0 m" for every input (last layer's
    # weights 0, bias (10, 1, 0, 0)): every STOP the chunks ask for is let through, and the report says how many,
    # at which true distances, for every call that asked (each call note names its motion step).
    import torch

    from verl_omni.models.wnm.checkpoint import load_wnm_checkpoint, save_wnm_checkpoint
    from verl_omni.models.wnm.goal_probe import ObjectViewProbe
    from verl_omni.models.wnm.stop_gate import StopGate

    model = load_wnm_checkpoint(tiny_checkpoint)
    head = ObjectViewProbe(model.config.dim)
    with torch.no_grad():
        head.net[-1].weight.zero_()
        head.net[-1].bias.copy_(torch.tensor([10.0, 1.0, 0.0, 0.0]))
    gated = save_wnm_checkpoint(model, tmp_path / "gated", {"test": "gate"}, stop_gate=StopGate(head, 0.5))
    out = tmp_path / "eval"
    fast = ["--episodes", "4", "--max-steps", "24", "--num-steps", "2", "--seed", "4", "--no-progress"]
    args = ["--checkpoint", str(gated), "--synthesize", "1", "--stop-gate", "--execute-steps", "3", *fast]
    assert tool.main([*args, "--output-dir", str(out)]) == 0
    run = json.loads((out / "report.json").read_text())["runs"]["checkpoint"]
    notes = [(ep, n) for ep in run["episodes"] for n in ep.get("policy_notes", [])]
    notes = [(ep, n) for ep, n in notes if n["stop_step"] < 3]  # STOPs this call would execute (3 steps a call)
    assert notes, "the untrained tiny model asks for no STOP in these episodes: nothing to report"
    gate = run["stop_gate"]
    assert gate["stop_asked"] == len(notes) and gate["allowed"] == len(notes) and gate["blocked"] == 0
    for ep, n in notes:
        assert n["stop_allowed"] and n["gate_distance_m"] == pytest.approx(0.0)
        assert 0 <= n["step"] <= ep["steps"] and 0 <= n["call"] < ep["policy_calls"]
    # Every let-through STOP ends its episode at that call, so the allowed ones are the episodes ended by STOP.
    assert gate["allowed"] == sum(ep["end_reason"] == "stop" for ep in run["episodes"])
    outside = sum(ep["geodesic"][n["step"]] > 0.5 for ep, n in notes)
    assert gate["allowed_outside_radius"] == outside
    assert "STOP gate:" in capsys.readouterr().out


def test_only_episodes_keeps_each_episode_as_drawn(tool, tmp_path, capsys):
    """--only-episodes: the listed episodes of the drawn set, each with its own start, goal and seed."""
    base = ["--policy", "expert", "--level", "one_room", "--synthesize", "1", "--episodes", "3", "--seed", "2",
            "--no-progress"]  # fmt: skip
    assert tool.main([*base, "--output-dir", str(tmp_path / "all")]) == 0
    everything = json.loads((tmp_path / "all" / "report.json").read_text())
    ids = tmp_path / "ids.txt"
    ids.write_text("h0000_ev002\n\nh0000_ev000\n")
    assert tool.main([*base, "--only-episodes", str(ids), "--output-dir", str(tmp_path / "some")]) == 0
    some = json.loads((tmp_path / "some" / "report.json").read_text())
    drawn = {e["episode_id"]: e for e in everything["episodes"]}
    assert [e["episode_id"] for e in some["episodes"]] == ["h0000_ev000", "h0000_ev002"]  # the drawn order
    assert some["episodes"] == [drawn["h0000_ev000"], drawn["h0000_ev002"]]
    runs = everything["runs"]["policy:expert"]["episodes"]
    assert some["runs"]["policy:expert"]["episodes"] == [runs[0], runs[2]]
    ids.write_text("h0000_ev009\n")
    assert tool.run_cli(tool.main, [*base, "--only-episodes", str(ids), "--output-dir", str(tmp_path / "x")]) != 0
    assert "h0000_ev009" in capsys.readouterr().err and not (tmp_path / "x").exists()
