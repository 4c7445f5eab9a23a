"""tools/eval/calibrate_stop_gate.py: the re-fitted distance by hand, the new checkpoint, and its refusals."""

import json

import pytest
from stage3_e2e_helpers import load_script

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMModel, load_wnm_checkpoint, save_wnm_checkpoint
from verl_omni.models.wnm.goal_probe import ObjectViewProbe
from verl_omni.models.wnm.stop_gate import StopGate, load_stop_gate


@pytest.fixture(scope="module")
def gated_checkpoint(tmp_path_factory):
    norm = ActionNormalization(mean=(0.1, 0.0, 0.0, 0.5), std=(0.02, 0.02, 0.05, 1.0))
    model = WNMModel(WNMConfig.from_size("tiny", variant="wnm_3d", image_size=(32, 32)), norm)
    gate = StopGate(ObjectViewProbe(model.config.dim), stop_distance_m=1.9)
    root = tmp_path_factory.mktemp("ckpt")
    return save_wnm_checkpoint(model, root / "r0", {"round": 0}, readme="# r0\n", stop_gate=gate)


def _call(geodesic, predicted, logit=1.0, episode="e0"):
    return {"checkpoint": "r0", "episode_id": episode, "call": 0, "geodesic_m": geodesic, "success_radius": 0.5,
            "gate_distance_m": predicted, "gate_visible_logit": logit}  # fmt: skip


_NO_SEED = object()


def _report(tmp_path, ckpt, calls, stop_gate=True, seed=1000):
    arguments = {"stop_gate": stop_gate, "level": "two_rooms"}
    if seed is not _NO_SEED:
        arguments["seed"] = seed
    report = {"format": "wnm-stop-probe/1", "arguments": arguments, "checkpoints": {"r0": str(ckpt)}, "calls": calls}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_distance_is_refit_on_predictions_at_the_goal_and_the_weights_stay(gated_checkpoint, tmp_path, capsys):
    tool = load_script("tools/eval/calibrate_stop_gate.py")
    # At the goal (geodesic <= 0.5 m) and in view: predictions 0.8, 1.0, 1.2, 1.6 -> 0.75 quantile = 1.3 m (1.2 +
    # 0.25 * 0.4). The unseen at-goal state (0.4 m, logit -2) and the states short of the goal do not count.
    calls = [_call(0.2, 0.8), _call(0.5, 1.0), _call(0.3, 1.2), _call(0.1, 1.6), _call(0.4, 0.4, logit=-2.0),
             _call(0.8, 1.5), _call(0.9, 2.0), _call(3.0, 3.0)]  # fmt: skip
    out = tmp_path / "r0_cal"
    args = ["--checkpoint", str(gated_checkpoint), "--probe-report", str(_report(tmp_path, gated_checkpoint, calls)),
            "--quantile", "0.75", "--output", str(out)]  # fmt: skip
    assert tool.main(args) == 0
    gate = load_stop_gate(out)
    assert gate.stop_distance_m == pytest.approx(1.3) and gate.quantile == 0.75
    assert gate.fitted_on == "predictions_at_goal"
    printed = capsys.readouterr().out
    # Pass rates by hand. At the goal (5 calls): 4 pass at 1.9 m, 3 at 1.3 m (0.8, 1.0, 1.2). 0-0.5 m short (2
    # calls: 1.5 and 2.0 m): 1 passes at 1.9, none at 1.3. Farther (3.0 m): none.
    assert "| <= rho (at the goal) | 5 | 0.80 | 0.60 |" in printed
    assert "| rho+0..0.5 m | 2 | 0.50 | 0.00 |" in printed
    assert "| > rho+1.5 m | 1 | 0.00 | 0.00 |" in printed
    for name in ("transformer/model.safetensors", "stop_gate/model.safetensors"):
        assert (out / name).read_bytes() == (gated_checkpoint / name).read_bytes()
    assert "## STOP gate calibration" in (out / "README.md").read_text()
    prov = json.loads((out / "checkpoint_manifest.json").read_text())["provenance"]["stop_gate_calibration"]
    assert prov["previous_stop_distance_m"] == pytest.approx(1.9) and prov["probe"]["seed"] == 1000
    load_wnm_checkpoint(out)
    # The output is never overwritten.
    before = (out / "checkpoint_manifest.json").read_bytes()
    assert tool.run_cli(tool.main, args) != 0
    assert "never overwritten" in capsys.readouterr().err
    assert (out / "checkpoint_manifest.json").read_bytes() == before


def test_refusals_name_what_to_change(gated_checkpoint, tmp_path, capsys):
    tool = load_script("tools/eval/calibrate_stop_gate.py")

    def fails(report, match, *extra):
        args = ["--checkpoint", str(gated_checkpoint), "--probe-report", str(report), "--output",
                str(tmp_path / "out"), *extra]  # fmt: skip
        assert tool.run_cli(tool.main, args) != 0
        assert match in capsys.readouterr().err
        assert not (tmp_path / "out").exists()

    fails(_report(tmp_path, gated_checkpoint, [_call(0.2, 1.0)], stop_gate=False), "--stop-gate")
    fails(_report(tmp_path, gated_checkpoint, [_call(2.0, 1.0)]), "no state within the success radius")
    fails(_report(tmp_path, gated_checkpoint, [_call(0.2, 1.0)]), "--label 'other'", "--label", "other")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    fails(bad, "wnm-stop-probe/1")


def test_probe_on_the_heldout_seed_is_refused_unless_allowed(gated_checkpoint, tmp_path, capsys):
    tool = load_script("tools/eval/calibrate_stop_gate.py")
    calls = [_call(0.2, 0.8), _call(0.3, 1.2)]

    def run(report, out, *extra):
        args = ["--checkpoint", str(gated_checkpoint), "--probe-report", str(report), "--output", str(out), *extra]
        return tool.run_cli(tool.main, args)

    # Seed 2000 is the default held-out seed: refused with exit 2, nothing written.
    assert run(_report(tmp_path, gated_checkpoint, calls, seed=2000), tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "seed 2000, the held-out evaluation seed" in err and "--allow-heldout-seed" in err
    assert not (tmp_path / "a").exists()
    # A report that does not record its seed cannot be checked: refused too.
    assert run(_report(tmp_path, gated_checkpoint, calls, seed=_NO_SEED), tmp_path / "b") == 2
    assert "'arguments.seed' is missing" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    # --heldout-seed moves the refusal: the validation seed 1000 named as held out is refused.
    assert run(_report(tmp_path, gated_checkpoint, calls, seed=1000), tmp_path / "c", "--heldout-seed", "1000") == 2
    assert "seed 1000, the held-out evaluation seed" in capsys.readouterr().err
    # Deliberate analysis: allowed with a warning, and the new checkpoint's provenance says so.
    out = tmp_path / "d"
    assert run(_report(tmp_path, gated_checkpoint, calls, seed=2000), out, "--allow-heldout-seed") == 0
    assert "warning:" in capsys.readouterr().err
    prov = json.loads((out / "checkpoint_manifest.json").read_text())["provenance"]["stop_gate_calibration"]
    assert prov["probe"]["seed"] == 2000 and prov["heldout_seed"] == 2000 and prov["allow_heldout_seed"] is True
