"""scripts/train_stage2.py at its smallest: SFT round, one DAgger round, evaluations, probes, resume."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_two_rounds_then_resume(tmp_path):
    work = tmp_path / "s2"
    cmd = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--workdir", str(work), "--level", "one_room",
           "--scenes", "2", "--episodes-per-scene", "1", "--rounds", "2", "--dagger-scenes", "1", "--sft-steps", "2",
           "--round-steps", "1", "--batch-size", "2", "--eval-scenes", "1", "--eval-episodes", "2",
           "--probe-states", "4", "--workers", "1", "--no-progress", "--dagger-share", "0.5",
           "--profile-sft-steps", "1", "--encode-batch", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 1: the round's own rows are" in proc.stdout and "each SFT batch draws 50.0% from them" in proc.stdout
    # Round 0 (2 steps) is profiled over its last step; round 1 (1 step) is too short to profile.
    profile = (work / "profile" / "r0_sft.txt").read_text()
    assert "1 SFT steps after 0" in profile and "## host, top-level operators (ms/step)" in profile
    assert "aten::" in profile and (work / "profile" / "r0_sft.json").is_file()
    assert not (work / "profile" / "r1_sft.txt").exists()
    summary = json.loads((work / "summary.json").read_text())
    assert set(summary["evaluations"]) == {
        "expert",
        "object_expert",
        "goal_bearing",
        "straight",
        "stop",
        "stage2_r0",
        "stage2_r1",
    }
    assert summary["evaluations"]["expert"]["success"]["mean"] == 1.0
    assert set(summary["probes"]["stage2_r1"]) == {
        "mean_action_baseline", "full", "shuffled_instruction", "static_history", "shuffled_views"
    }  # fmt: skip
    meta = json.loads((work / "data" / "r1" / "collection.json").read_text())
    assert meta["policy"]["type"] == "dagger" and meta["policy"]["beta"] == 0.5 and meta["level"] == "one_room"
    for rnd in (0, 1):
        ckpt = work / "ckpt" / f"stage2_r{rnd}"
        manifest = json.loads((ckpt / "checkpoint_manifest.json").read_text())
        assert "README.md" in manifest["files"]  # the model card is part of the verified checkpoint
        assert f"round {rnd}" in (ckpt / "README.md").read_text()
    assert "| stage2_r1 |" in (work / "summary.md").read_text()
    # A rerun finds every stage's output and reuses it (nothing is retrained or overwritten).
    before = (work / "ckpt" / "stage2_r1" / "checkpoint_manifest.json").read_bytes()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reusing" in proc.stdout
    # Finished rounds come back from their saved rows: no episode is decoded or encoded again.
    assert "round 0: reusing stage2_r0" in proc.stdout and "round 1: reusing stage2_r1" in proc.stdout
    assert "decoding and encoding" not in proc.stdout
    assert (work / "ckpt" / "stage2_r1" / "checkpoint_manifest.json").read_bytes() == before


def test_bad_flags_are_refused_before_any_work(tmp_path):
    base = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--workdir", str(tmp_path / "w")]
    for extra, needle in ((["--level", "castle"], "one_room"), (["--rounds", "0"], "--rounds"),
                          (["--beta0", "1.5"], "--beta0"), (["--probe-states", "1"], "--probe-states"),
                          (["--sft-snapshot-s", "-1"], "--sft-snapshot-s"),
                          (["--no-eval-plain"], "--eval-stop-gate"),
                          (["--sft-steps", "0"], "--init-checkpoint"),
                          (["--dagger-share", "1.5"], "--dagger-share"),
                          (["--profile-sft-steps", "-1"], "--profile-sft-steps"),
                          (["--encode-batch", "0"], "--encode-batch")):  # fmt: skip
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_round_cache_that_cannot_be_used_is_encoded_again(tmp_path, capsys):
    import runpy

    ns = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint_manifest.json").write_text("{}")
    cache = tmp_path / "r0.rows.pt"
    cache.write_bytes(b"not a torch file")  # e.g. a copy cut short
    assert ns["_load_round_cache"](cache, ckpt) is None
    assert "unreadable" in capsys.readouterr().out
    # A cache written for another checkpoint is not used either.
    ns["_save_round_cache"](cache, ckpt, ns["RoundState"](steps_total=3))
    assert ns["_load_round_cache"](cache, ckpt).steps_total == 3
    (ckpt / "checkpoint_manifest.json").write_text('{"other": 1}')
    assert ns["_load_round_cache"](cache, ckpt) is None
    assert "belongs to another" in capsys.readouterr().out


@pytest.fixture(scope="module")
def gated_one_room(tmp_path_factory):
    """One one_room round with the view head kept as a STOP gate, evaluated with and without it; also the init
    checkpoint of the curriculum test (one training run serves both, to keep the suite short)."""
    work = tmp_path_factory.mktemp("gated") / "s2"
    cmd = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--workdir", str(work), "--level", "one_room",
           "--scenes", "4", "--episodes-per-scene", "1", "--rounds", "1", "--sft-steps", "2", "--batch-size", "2",
           "--eval-scenes", "1", "--eval-episodes", "2", "--probe-states", "4", "--workers", "1", "--no-progress",
           "--skip-baselines", "--view-aux-weight", "1", "--face-goal-object", "--goal-point", "nearest",
           "--eval-stop-gate", "--eval-stop-votes", "1", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


def test_view_head_is_saved_as_stop_gate_and_evaluated(gated_one_room):
    work = gated_one_room
    ckpt = work / "ckpt" / "stage2_r0"
    manifest = json.loads((ckpt / "checkpoint_manifest.json").read_text())
    assert "stop_gate/model.safetensors" in manifest["files"]
    gate = manifest["provenance"]["stop_gate"]
    # The expert faces the object before STOP, so its STOP states see it: the distance is a real one (in metres).
    assert 0.0 < gate["stop_distance_m"] < 4.0 and gate["quantile"] == 0.9 and gate["within_steps"] == 8
    assert "stop_gate/" in (ckpt / "README.md").read_text()
    summary = json.loads((work / "summary.json").read_text())
    assert set(summary["evaluations"]) == {"stage2_r0", "stage2_r0_votes2", "stage2_r0_gate_votes2"}
    report = json.loads((work / "eval" / "stage2_r0_gate_votes2.json").read_text())
    assert report["aggregate"]["episodes"] == 2
    # The episode specs travel with the results (ids alone repeat across seeds and levels).
    assert [s["episode_id"] for s in report["specs"]] == [e["episode_id"] for e in report["episodes"]]


def test_stop_gate_without_view_head_is_refused(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--workdir", str(tmp_path / "w"), "--eval-stop-gate"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--view-aux-weight" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_init_checkpoint_starts_round_0_from_another_level(tmp_path, gated_one_room):
    """A curriculum over task levels: two_rooms round 0 from a one_room checkpoint (weights, normalization, gate)."""
    import torch

    from verl_omni.models.wnm.checkpoint import read_state_dict

    common = ["--episodes-per-scene", "1", "--rounds", "1", "--batch-size", "2", "--eval-scenes", "1",
              "--eval-episodes", "2", "--probe-states", "4", "--workers", "1", "--no-progress", "--skip-baselines",
              "--view-aux-weight", "1", "--face-goal-object", "--goal-point", "nearest"]  # fmt: skip
    script = [sys.executable, str(REPO / "scripts/train_stage2.py")]
    init = gated_one_room / "ckpt" / "stage2_r0"
    # One step at a learning rate far below float32 resolution: the weights must come out as they went in.
    second = tmp_path / "two_rooms"
    cmd = [*script, "--workdir", str(second), "--level", "two_rooms", "--scenes", "4", "--sft-steps", "1",
           "--lr", "1e-30", "--init-checkpoint", str(init), *common]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = second / "ckpt" / "stage2_r0"
    before, after = read_state_dict(init / "transformer"), read_state_dict(out / "transformer")
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6, msg=name)
    assert json.loads((out / "action_normalization.json").read_text()) == json.loads(
        (init / "action_normalization.json").read_text()
    )  # the init's statistics, not refitted on the new level
    prov = json.loads((out / "checkpoint_manifest.json").read_text())["provenance"]
    init_sha = hashlib.sha256((init / "checkpoint_manifest.json").read_bytes()).hexdigest()
    assert prov["init_checkpoint"]["manifest_sha256"] == init_sha
    card = (out / "README.md").read_text()
    assert "started from `stage2_r0`" in card
    assert "goal point `nearest`" in card
    # The card names the model it really holds (the init's dims, not --size's) and the init's own data and training.
    cfg = json.loads((init / "config.json").read_text())["model_config"]
    assert f"({cfg['num_layers']} layers, {cfg['num_heads']} heads x {cfg['head_dim']}, FFN {cfg['ffn_dim']})" in card
    assert "model: that of `stage2_r0`" in card and "device cpu, float32." in card
    lineage = card.split("## Lineage: `stage2_r0`, as its own README gives it", 1)[1].split("## Evaluation")[0]
    init_card = (init / "README.md").read_text()
    assert "one_room" in init_card and "  - round 0: noisy-expert collection" in lineage
    assert all(line.strip() in init_card for line in lineage.strip().splitlines())
    # Refused before any work: a folder that is not a checkpoint, or model settings beside it.
    for extra, needle in ((["--init-checkpoint", str(tmp_path)], "checkpoint_manifest.json"),
                          (["--init-checkpoint", str(init), "--set", "num_layers=2"], "--size/--set")):  # fmt: skip
        proc = subprocess.run([*script, "--workdir", str(tmp_path / "w"), *extra], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_call_stopped_during_sft_resumes_from_its_encoded_rows_and_sft_snapshot(tmp_path, capsys):
    """A GPU call cut off during SFT: the next call skips decoding and encoding and goes on from the last SFT
    snapshot.

    The uninterrupted run of the same flags is the reference: on CPU, with the same seeds, the resumed run must
    produce the same transformer weights bit for bit (the fresh model's random init, latent statistics and action
    normalization come back from the cache with the rows; weights, optimizer and random state from the snapshot).
    """
    import runpy

    import torch

    from verl_omni.models.wnm.checkpoint import read_state_dict
    from verl_omni.models.wnm.sft_resume import SFTResume

    ns = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    flags = ["--level", "one_room", "--scenes", "2", "--episodes-per-scene", "1", "--rounds", "1", "--sft-steps", "3",
             "--batch-size", "2", "--eval-scenes", "1", "--eval-episodes", "2", "--probe-states", "4", "--workers",
             "1", "--no-progress", "--skip-baselines", "--sft-snapshot-s", "0", "--eval-rounds"]  # fmt: skip
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    (resumed / "data").mkdir(parents=True)
    assert ns["main"](["--workdir", str(reference), *flags]) == 0
    # The same collection in both folders (synthesis is seeded; copying it keeps the test short).
    import shutil

    for name in ("r0", "r0_occ"):
        shutil.copytree(reference / "data" / name, resumed / "data" / name)

    real_save = SFTResume.save

    def save_then_cut_off(self, fingerprint, snapshot):
        real_save(self, fingerprint, snapshot)
        if snapshot["step"] == 2:
            raise TimeoutError("the call's time limit")

    SFTResume.save = save_then_cut_off
    try:
        with pytest.raises(TimeoutError):
            ns["main"](["--workdir", str(resumed), *flags])
    finally:
        SFTResume.save = real_save
    encoded = resumed / "data" / "r0.encoded"
    assert (encoded / "rest.pt").is_file() and (encoded / "sft.pt").is_file()
    assert not (resumed / "ckpt" / "stage2_r0").exists()
    capsys.readouterr()
    assert ns["main"](["--workdir", str(resumed), *flags]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 part(s) reused from r0.encoded" in out and "decoding and encoding" not in out
    assert "sft.pt: resuming SFT after step 2" in out
    assert not encoded.exists()  # the round cache holds the rows now; the snapshot went with the folder
    a = read_state_dict(reference / "ckpt" / "stage2_r0" / "transformer")
    b = read_state_dict(resumed / "ckpt" / "stage2_r0" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --eval-rounds given alone: no closed-loop evaluation and no probe were run.
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["evaluations"] == {} and summary["probes"] == {}
    assert not list((resumed / "eval").glob("*.json"))


def test_eval_rounds_must_name_existing_rounds(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--workdir", str(tmp_path / "w"), "--rounds", "2",
           "--eval-rounds", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--eval-rounds" in proc.stderr and "0..1" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_curriculum_script_runs_one_room_then_two_rooms_from_it(tmp_path):
    """scripts/stage2_curriculum.sh at its smallest: both levels' collections, one_room round 0, then a two_rooms
    round 0 whose provenance names the one_room checkpoint; a rerun reuses everything."""
    import os

    run = tmp_path / "cur"
    env = {**os.environ, "DEVICE": "cpu", "WORKERS": "1", "SYN_WORKERS": "1", "ONE_ROOM_SCENES": "2",
           "TWO_ROOMS_SCENES": "2", "ROUNDS": "1", "ONE_ROOM_STEPS": "1", "TWO_ROOMS_STEPS": "1",
           "PYTHON": sys.executable, "STAGE2_MODEL": "--set num_layers=1 --set text_max_length=64",
           "ONE_ROOM_EVAL": "0"}  # fmt: skip
    tiny = ["--episodes-per-scene", "1", "--goal-variants", "1", "--batch-size", "2", "--eval-scenes", "1",
            "--eval-episodes", "2", "--probe-states", "4"]  # fmt: skip
    # A relative RUN_DIR means the caller's folder (the script changes to the repository root).
    cmd = ["bash", str(REPO / "scripts/stage2_curriculum.sh"), "cur", *tiny]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for level, rooms in (("one_room", 1), ("two_rooms", 2)):
        meta = json.loads((run / level / "data" / "r0" / "collection.json").read_text())
        assert meta["generator"]["floorplan"]["max_rooms"] == rooms
    manifest = json.loads((run / "two_rooms" / "ckpt" / "stage2_r0" / "checkpoint_manifest.json").read_text())
    init = manifest["provenance"]["init_checkpoint"]
    assert init["path"] == str(run / "one_room" / "ckpt" / "stage2_r0")
    one_room = run / "one_room" / "ckpt" / "stage2_r0" / "checkpoint_manifest.json"
    assert init["manifest_sha256"] == hashlib.sha256(one_room.read_bytes()).hexdigest()
    summary = json.loads((run / "two_rooms" / "summary.json").read_text())
    # The recipe's checkpoints replan every 3 steps (EVAL_EXECUTE_STEPS); the reports say so in name and field.
    assert set(summary["evaluations"]) == {"stage2_r0_x3", "stage2_r0_gate_x3"}
    report = json.loads((run / "two_rooms" / "eval" / "stage2_r0_gate_x3.json").read_text())
    assert report["execute_steps"] == 3
    assert all(e["policy_calls"] >= -(-e["steps"] // 3) for e in report["episodes"])
    assert not list((run / "one_room" / "eval").glob("*.json"))  # ONE_ROOM_EVAL=0
    # The rerun evaluates the two_rooms round with its STOP gate only (one closed-loop pass a round less).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**env, "TWO_ROOMS_EVAL_PLAIN": "0"},
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decoding and encoding" not in proc.stdout and proc.stdout.count("reusing") >= 3
    summary = json.loads((run / "two_rooms" / "summary.json").read_text())
    assert set(summary["evaluations"]) == {"stage2_r0_gate_x3"}

    # DAgger rounds from a carried checkpoint: round 0 is the two_rooms checkpoint unchanged (bit for bit), its
    # replay collection is encoded, and round 1 is a DAgger round driven from it, evaluated with its gate only.
    import torch

    from verl_omni.models.wnm.checkpoint import read_state_dict

    carried = run / "two_rooms" / "ckpt" / "stage2_r0"
    dagger_env = {**env, "TWO_ROOMS_FROM": str(carried), "ROUNDS": "2", "ROUND_STEPS": "1", "DAGGER_SCENES": "1",
                  "REPLAY_SCENES": "2", "TWO_ROOMS_EVAL_PLAIN": "0"}  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dagger_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = run / "two_rooms_dagger"
    before, after = (
        read_state_dict(carried / "transformer"),
        read_state_dict(out / "ckpt" / "stage2_r0" / "transformer"),
    )
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    r1 = json.loads((out / "ckpt" / "stage2_r1" / "checkpoint_manifest.json").read_text())["provenance"]
    assert r1["round"] == 1 and r1["sft_steps_total"] == 1
    assert (
        "unchanged: this run trained only the DAgger rounds" in (out / "ckpt" / "stage2_r1" / "README.md").read_text()
    )
    assert set(json.loads((out / "summary.json").read_text())["evaluations"]) == {"stage2_r1_gate_x3"}
    assert not (run / "one_room" / "ckpt" / "stage2_r1").exists()  # nothing of the curriculum's own steps ran
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**dagger_env, "TWO_ROOMS_FROM": str(tmp_path / "nowhere")})  # fmt: skip
    assert bad.returncode == 2 and "TWO_ROOMS_FROM" in bad.stderr and "checkpoint_manifest.json" in bad.stderr
    bad = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**dagger_env, "ROUNDS": "1"}
    )
    assert bad.returncode == 2 and "ROUNDS >= 2" in bad.stderr

    # Chained rounds: round k is a run of its own whose round 0 is round k-1's checkpoint (named by manifest sha256
    # in its provenance), and the replay collection is synthesized once and hard-linked into round 2, which takes
    # over round 1's encoded replay rows; with CHAINED_EVAL=last only round 2 is evaluated.
    chain_env = {**dagger_env, "CHAINED_ROUNDS": "2", "CHAINED_EVAL": "last"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=chain_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chain1, chain2 = run / "two_rooms_chain_1", run / "two_rooms_chain_2"
    assert proc.stdout.count("round 0: took over") == 1 and f"{chain1}/data/r0.rows.pt" in proc.stdout
    evaluated = {chain1: set(), chain2: {"stage2_r1_gate_x3"}}
    for k, (chain, start) in enumerate(((chain1, carried), (chain2, chain1 / "ckpt" / "stage2_r1")), 1):
        init = json.loads((chain / "ckpt" / "stage2_r0" / "checkpoint_manifest.json").read_text())["provenance"][
            "init_checkpoint"]  # fmt: skip
        sha = hashlib.sha256((start / "checkpoint_manifest.json").read_bytes()).hexdigest()
        assert init["path"] == str(start) and init["manifest_sha256"] == sha, k
        assert f"(manifest sha256 {sha[:12]}), unchanged" in (chain / "ckpt" / "stage2_r1" / "README.md").read_text()
        assert set(json.loads((chain / "summary.json").read_text())["evaluations"]) == evaluated[chain]
    shard = next(p for p in sorted((chain1 / "data" / "r0").rglob("*")) if p.is_file())
    assert (chain2 / "data" / "r0" / shard.relative_to(chain1 / "data" / "r0")).stat().st_ino == shard.stat().st_ino
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**chain_env, "CHAINED_ROUNDS": "two"})  # fmt: skip
    assert bad.returncode == 2 and "CHAINED_ROUNDS" in bad.stderr
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**chain_env, "CHAINED_EVAL": "first"})  # fmt: skip
    assert bad.returncode == 2 and "CHAINED_EVAL" in bad.stderr
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**chain_env, "TWO_ROOMS_EVAL_ROUNDS": "1"})  # fmt: skip
    assert bad.returncode == 2 and "TWO_ROOMS_EVAL_ROUNDS" in bad.stderr

    # From a carried one_room checkpoint: the one_room steps are skipped, the two_rooms round 0 starts from it.
    # With CHAINED_ROUNDS the two_rooms run trains round 0 only (under ROUND0_SFT_AUTOCAST) and the chained round
    # starts from it (float32).
    one_ckpt = run / "one_room" / "ckpt" / "stage2_r0"
    cmd2 = ["bash", str(REPO / "scripts/stage2_curriculum.sh"), "cur2", *tiny]
    env2 = {**env, "ONE_ROOM_FROM": str(one_ckpt), "TWO_ROOMS_EVAL_PLAIN": "0", "CHAINED_ROUNDS": "1",
            "ROUND0_SFT_AUTOCAST": "bfloat16", "REPLAY_SCENES": "2", "DAGGER_SCENES": "1",
            "ROUND_STEPS": "1", "TWO_ROOMS_EVAL_ROUNDS": "none"}  # fmt: skip
    proc = subprocess.run(cmd2, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run2 = tmp_path / "cur2"
    assert not (run2 / "one_room").exists()
    # The replay collection was synthesized in the background beside round 0, and the chained round used it.
    assert "replay collection (2 scenes) in the background" in proc.stdout
    assert "--synthesize-only" in (run2 / "replay_synthesis.log").read_text()
    assert f"reusing {run2 / 'two_rooms_chain_1' / 'data' / 'r0'}" in proc.stdout
    r0 = run2 / "two_rooms" / "ckpt" / "stage2_r0"
    prov = json.loads((r0 / "checkpoint_manifest.json").read_text())["provenance"]
    init = prov["init_checkpoint"]
    assert init["path"] == str(one_ckpt)
    assert init["manifest_sha256"] == hashlib.sha256((one_ckpt / "checkpoint_manifest.json").read_bytes()).hexdigest()
    assert prov["arguments"]["sft_autocast"] == "bfloat16"
    assert not (run2 / "two_rooms" / "ckpt" / "stage2_r1").exists()
    # TWO_ROOMS_EVAL_ROUNDS=none: the round 0 is not evaluated; the chained round is (CHAINED_EVAL=all).
    assert json.loads((run2 / "two_rooms" / "summary.json").read_text())["evaluations"] == {}
    assert not list((run2 / "two_rooms" / "eval").glob("*.json"))
    chained_summary = json.loads((run2 / "two_rooms_chain_1" / "summary.json").read_text())
    assert set(chained_summary["evaluations"]) == {"stage2_r1_gate_x3"}
    chained = run2 / "two_rooms_chain_1" / "ckpt"
    init = json.loads((chained / "stage2_r0" / "checkpoint_manifest.json").read_text())["provenance"]["init_checkpoint"]
    assert init["path"] == str(r0)
    prov = json.loads((chained / "stage2_r1" / "checkpoint_manifest.json").read_text())["provenance"]
    assert prov["round"] == 1 and prov["arguments"]["sft_autocast"] == "none"
    assert prov["arguments"]["compile_blocks"] is False  # SFT_COMPILE=auto compiles on a GPU only
    bad = subprocess.run(cmd2, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**env, "ONE_ROOM_FROM": str(tmp_path / "nowhere")})  # fmt: skip
    assert bad.returncode == 2 and "ONE_ROOM_FROM" in bad.stderr and "checkpoint_manifest.json" in bad.stderr
    bad = subprocess.run(cmd2, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**env, "SFT_COMPILE": "yes"})  # fmt: skip
    assert bad.returncode == 2 and "SFT_COMPILE=yes" in bad.stderr


def test_call_stopped_while_encoding_keeps_the_parts_it_finished(tmp_path, capsys, gated_one_room):
    """A curriculum round (a fixed model) encodes in parts: a call cut off in part 2 keeps part 1, the next call
    encodes only the rest, and the trained weights equal those of an uninterrupted run bit for bit (CPU)."""
    import runpy
    import shutil

    import torch

    from verl_omni.models.wnm import sft
    from verl_omni.models.wnm.checkpoint import read_state_dict

    ns = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    ns["main"].__globals__["SHARD_EPISODES"] = 2  # several parts from a few episodes
    flags = ["--level", "two_rooms", "--scenes", "3", "--episodes-per-scene", "2", "--rounds", "1", "--sft-steps",
             "2", "--batch-size", "2", "--eval-scenes", "1", "--eval-episodes", "2", "--probe-states", "4",
             "--workers", "1", "--no-progress", "--skip-baselines", "--view-aux-weight", "1", "--face-goal-object",
             "--goal-point", "nearest", "--eval-rounds", "--init-checkpoint",
             str(gated_one_room / "ckpt" / "stage2_r0")]  # fmt: skip
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert ns["main"](["--workdir", str(reference), *flags]) == 0
    (resumed / "data").mkdir(parents=True)
    for name in ("r0", "r0_occ"):
        shutil.copytree(reference / "data" / name, resumed / "data" / name)
    real, calls, armed = sft.encode_examples, [], [True]

    def cut_off_in_part_two(*args, **kwargs):
        calls.append(1)
        if armed[0] and len(calls) == 2:
            raise TimeoutError("the call's time limit")
        return real(*args, **kwargs)

    sft.encode_examples = cut_off_in_part_two
    try:
        with pytest.raises(TimeoutError):
            ns["main"](["--workdir", str(resumed), *flags])
        parts = sorted(p.name for p in (resumed / "data" / "r0.encoded").glob("part_*.pt"))
        assert parts == ["part_0000.pt"]
        capsys.readouterr()
        calls.clear()
        armed[0] = False
        assert ns["main"](["--workdir", str(resumed), *flags]) == 0
    finally:
        sft.encode_examples = real
    out = capsys.readouterr().out
    import re

    reused, total = map(int, re.search(r"(\d+) of (\d+) part\(s\) reused", out).groups())
    assert total >= 3 and reused == 1
    assert len(calls) == total  # the total - 1 parts not saved, then the held-out rows
    assert not (resumed / "data" / "r0.encoded").exists()
    a = read_state_dict(reference / "ckpt" / "stage2_r0" / "transformer")
    b = read_state_dict(resumed / "ckpt" / "stage2_r0" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chained_round_takes_over_the_replay_encoding_of_the_round_before(tmp_path, gated_one_room):
    """A chained DAgger round replays the collection the round before it encoded: with --reuse-encoded it takes
    those rows over, recomputing only the trained encoders' features, and gets what encoding them again gives."""
    import os
    import shutil

    import torch

    base = [sys.executable, str(REPO / "scripts/train_stage2.py"), "--level", "one_room", "--scenes", "2",
            "--episodes-per-scene", "1", "--batch-size", "2", "--eval-rounds", "--skip-baselines", "--probe-states",
            "4", "--workers", "1", "--no-progress", "--eval-scenes", "1", "--eval-episodes", "2", "--dagger-scenes",
            "1", "--view-aux-weight", "1", "--face-goal-object", "--goal-point", "nearest"]  # fmt: skip

    def run(*extra):
        proc = subprocess.run([*base, *map(str, extra)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    def replay_from(src, work):  # the replay collection, hard-linked as stage2_curriculum.sh does
        (work / "data").mkdir(parents=True)
        for sub in ("r0", "r0_occ"):
            shutil.copytree(src / "data" / sub, work / "data" / sub, copy_function=os.link)

    # The round before: round 0 = the one_room checkpoint over a 2-scene replay collection, then one DAgger step
    # that trains the encoders (so the next round's features differ from the rows it encoded).
    before = tmp_path / "chain_1"
    run("--workdir", before, "--init-checkpoint", gated_one_room / "ckpt" / "stage2_r0", "--sft-steps", "0",
        "--rounds", "2", "--round-steps", "1")  # fmt: skip
    start = before / "ckpt" / "stage2_r1"
    outs = {}
    for name, extra in (("adopted", ["--reuse-encoded", before]), ("encoded", [])):
        replay_from(before, tmp_path / name)
        outs[name] = run("--workdir", tmp_path / name, "--init-checkpoint", start, "--sft-steps", "0", "--rounds", "1",
                         *extra)  # fmt: skip
    assert "round 0: took over" in outs["adopted"] and "decoding and encoding" not in outs["adopted"]
    assert "decoding and encoding" in outs["encoded"]

    def state(name):
        return torch.load(tmp_path / name / "data" / "r0.rows.pt", map_location="cpu", weights_only=False)

    adopted, encoded, old = state("adopted"), state("encoded"), state("chain_1")
    for key in ("accumulated", "heldout_rows"):
        a, e, o = adopted[key], encoded[key], old[key]
        for field in ("history_latents", "target_latents", "actions", "row_example", "text_ids", "text_mask", "views"):
            assert torch.equal(getattr(a, field), getattr(e, field)), (key, field)
        for field in ("text", "image", "geometry"):
            torch.testing.assert_close(getattr(a, field), getattr(e, field), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(getattr(o, field), getattr(e, field)), f"{key}.{field} was not recomputed"
    assert adopted["round0_rows"] == encoded["round0_rows"]
    assert [p.episode_id for p in adopted["probe_examples"]] == [p.episode_id for p in encoded["probe_examples"]]
    # The one_room run's round 0 encoded another collection: its rows are not taken over.
    replay_from(before, tmp_path / "refused")
    out = run("--workdir", tmp_path / "refused", "--init-checkpoint", start, "--sft-steps", "0", "--rounds", "1",
              "--reuse-encoded", gated_one_room)  # fmt: skip
    assert "--reuse-encoded not used:" in out and "another collection" in out and "decoding and encoding" in out


def test_reuse_encoded_falls_back_to_encoding_with_the_reason(tmp_path, capsys):
    import runpy

    import torch

    from verl_omni.models.wnm import WNMConfig, WNMModel

    ns = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1))
    run = tmp_path / "other"
    (run / "data").mkdir(parents=True)
    assert ns["_adopt_round0"](run, "abc", model, ("text_encoder",)) is None
    assert "is not there" in capsys.readouterr().out
    (run / "data" / "r0.rows.pt").write_bytes(b"cut short")
    assert ns["_adopt_round0"](run, "abc", model, ("text_encoder",)) is None
    assert "is unreadable" in capsys.readouterr().out
    torch.save({"checkpoint_sha256": "x", "steps_total": 1}, run / "data" / "r0.rows.pt")  # written before the field
    assert ns["_adopt_round0"](run, "abc", model, ("text_encoder",)) is None
    assert "predates the rows fingerprint" in capsys.readouterr().out


def test_model_card_says_how_the_sft_ran():
    """The checkpoint README's training line names the precision and, when on, the compiled DiT blocks."""
    import runpy

    ns = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    parser = ns["build_parser"]()
    base = ["--workdir", "w", "--level", "two_rooms"]
    provenance = {"sft_steps_total": 2000}
    eager = ns["_readme"]("stage2_r0", parser.parse_args([*base, "--sft-autocast", "bfloat16"]), 0, provenance, None)
    compiled = ns["_readme"]("stage2_r0", parser.parse_args([*base, "--compile-blocks"]), 0, provenance, None)
    assert "steps: 2000 in all; seed 0; device cpu, autocast bfloat16.\n" in eager and "compiled" not in eager
    assert "device cpu, float32, DiT blocks compiled (--compile-blocks).\n" in compiled
    averaged = ns["_readme"]("stage2_r0", parser.parse_args([*base, "--sft-ema-decay", "0.999"]), 0, provenance, None)
    assert "device cpu, float32; weights: moving average, decay 0.999.\n" in averaged
    with pytest.raises(SystemExit):  # refused before anything is written
        ns["main"]([*base, "--sft-ema-decay", "1"])
