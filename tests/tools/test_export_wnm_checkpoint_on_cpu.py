"""tools/checkpoint/export_wnm_checkpoint.py and verl_omni.models.wnm.export.

Two kinds of actor checkpoints:

- small ones written here in the trainer's layout (``verl_omni.trainer.checkpointing``) by a single-process
  DCP save of a tiny DiT with hand-made weight changes: every refusal and the file-level promises;
- the real FSDP checkpoint of the ``trained_run`` session fixture (2 CPU actor ranks, 2 steps): the export
  must give bit-for-bit the model the actor had at that step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import (
    WNMConfig,
    WNMModel,
    check_contract_compatibility,
    contract_of,
    load_wnm_checkpoint,
    read_checkpoint_contract,
    save_wnm_checkpoint,
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "checkpoint" / "export_wnm_checkpoint.py"
NORM = ActionNormalization(mean=(0.1, 0.0, 0.01, 0.0), std=(0.05, 0.02, 0.1, 1.0))
# Two tensors changed by hand: one by a constant, one elementwise (index 0 of its last dim only).
SHIFTED, SPIKED = "blocks.0.attn1.to_q.weight", "action_proj_out.bias"


def _tool():
    spec = importlib.util.spec_from_file_location("export_wnm_checkpoint", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


def write_actor_checkpoint(run: Path, step: int, model_state: dict, contract: dict, hot_save: bool = False) -> Path:
    """The files the trainer writes for a checkpoint (see verl_omni/trainer/checkpointing.py)."""
    actor = run / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    optim = {"state": {}, "param_groups": [{"lr": 1e-5}]}
    with warnings.catch_warnings():  # DCP warns that a save without a process group is single-process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model_state, "optimizer": optim}, checkpoint_id=str(actor), no_dist=True)
    (actor / "model_contract.json").write_text(json.dumps(contract))
    state = {"step": step, "hot_save": hot_save, "config": {"trainer": {"output_dir": str(run)}}}
    (actor.parent / "trainer_state.json").write_text(json.dumps(state))
    return actor.parent


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=2), NORM)
    # 128 KiB shards: the transformer (about 2.5 MB fp32) is stored as several files plus an index.
    path = save_wnm_checkpoint(model, tmp_path_factory.mktemp("base") / "ckpt", {"tool": "test"}, 128 * 1024)
    return path


@pytest.fixture(scope="module")
def actor_run(base, tmp_path_factory):
    """A run directory whose step 3 checkpoint holds the base DiT with two tensors changed."""
    state = {k: v.clone() for k, v in load_wnm_checkpoint(base).transformer.state_dict().items()}
    assert SHIFTED in state and SPIKED in state
    state[SHIFTED] += 0.25
    state[SPIKED][..., 0] -= 1.5
    contract = {**read_checkpoint_contract(base), "initial_checkpoint": str(base)}
    run = tmp_path_factory.mktemp("run")
    return write_actor_checkpoint(run, 3, state, contract), state


def test_export_changes_only_the_transformer_files_holding_changed_tensors(base, actor_run, tmp_path, capsys):
    step_dir, state = actor_run
    out = tmp_path / "exported"
    rc = _tool().main(["--base-vln", str(base), "--actor-checkpoint", str(step_dir), "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "changed 2" in printed and f"wrote {out}" in printed

    index = json.loads((base / "transformer" / "model.safetensors.index.json").read_text())["weight_map"]
    touched = {f"transformer/{index[SHIFTED]}", f"transformer/{index[SPIKED]}"}
    base_files, out_files = _files(base), _files(out)
    assert set(out_files) == set(base_files) | {"README.md"}  # this base has no card; the export writes its own
    differing = {n for n in base_files if base_files[n] != out_files[n]}
    assert differing == touched | {"checkpoint_manifest.json"}  # config, normalization, frozen parts identical
    card = (out / "README.md").read_text()
    assert card.startswith("# exported\n") and "after Stage III" in card
    assert f"run `{step_dir.parent.name}`, step 3; 2 of {len(state)} DiT tensors changed" in card
    assert "## Licence" in card and "## Lineage" not in card  # the base has no card to quote
    assert len(set(index.values())) > 2  # the base's shard layout is kept (and the index is byte-identical)

    loaded = load_wnm_checkpoint(out)  # verifies every sha256 of the new manifest
    got = loaded.transformer.state_dict()
    assert set(got) == set(state)
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    assert check_contract_compatibility(out, base).ok

    manifest = json.loads((out / "checkpoint_manifest.json").read_text())
    prov = manifest["provenance"]
    assert prov["base_manifest_sha256"] == _sha(base / "checkpoint_manifest.json")
    assert prov["step"] == 3 and prov["run_output_dir"] == str(step_dir.parent)
    assert prov["actor_checkpoint"] == str(step_dir / "actor") and prov["hot_save"] is False
    assert prov["changed_tensors"] == 2 and prov["tensors"] == len(state)
    assert prov["base_provenance"] == {"tool": "test"} and prov["initial_checkpoint"] == str(base)
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == out_files[name]
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # no staging directory left behind


def test_dry_run_lists_every_tensor_with_its_change_and_writes_nothing(base, actor_run, tmp_path, capsys):
    step_dir, state = actor_run
    out = tmp_path / "never"
    rc = _tool().main(
        ["--base-vln", str(base), "--actor-checkpoint", str(step_dir), "--output-dir", str(out), "--dry-run"]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert list(tmp_path.iterdir()) == []
    rows = {line.split()[0]: line.split() for line in printed.splitlines() if line.split() and line.split()[0] in state}
    assert set(rows) == set(state)
    for name, cols in rows.items():
        shape = "x".join(str(d) for d in state[name].shape) or "scalar"
        assert cols[1] == shape and cols[2] == "float32", cols
        assert cols[-1] == ("yes" if name in (SHIFTED, SPIKED) else "no"), cols
    # Hand values: +0.25 everywhere and -1.5 at one index (float32 rounding of w + 0.25 stays within 1e-6).
    assert float(rows[SHIFTED][3]) == pytest.approx(0.25, abs=1e-6)
    assert float(rows[SPIKED][3]) == pytest.approx(1.5, abs=1e-6)
    assert f"tensors     {len(state)} " in printed and "changed 2" in printed


def test_cli_refuses_an_existing_output_dir(base, actor_run, tmp_path):
    step_dir, _ = actor_run
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--base-vln", str(base), "--actor-checkpoint", str(step_dir)]
        + ["--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "already exists" in proc.stderr and "nothing was written" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def _refused(base: Path, step_dir: Path, tmp_path: Path, capsys) -> str:
    out = tmp_path / "out"
    rc = _tool().main(["--base-vln", str(base), "--actor-checkpoint", str(step_dir), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not out.exists() and "nothing was written" in err
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    return err


def test_refuses_shards_from_a_different_model_config(base, actor_run, tmp_path, capsys):
    _, state = actor_run
    other = contract_of(WNMConfig.from_size("tiny", num_layers=3), NORM)
    run = write_actor_checkpoint(tmp_path / "run", 1, state, {**other, "initial_checkpoint": "/elsewhere"})
    err = _refused(base, run, tmp_path, capsys)
    assert "different contract" in err and "model_config.num_layers: 3 != 2" in err


def test_refuses_a_missing_shard_file(base, actor_run, tmp_path, capsys):
    step_dir, _ = actor_run
    copy = tmp_path / "run" / step_dir.name
    shutil.copytree(step_dir, copy)
    shards = sorted((copy / "actor").glob("*.distcp"))
    assert shards
    shards[0].unlink()
    err = _refused(base, copy, tmp_path, capsys)
    assert f"{shards[0]}: DCP shard file is missing" in err


def test_checks_the_checkpoint_file_manifest_before_reading_shards(base, actor_run, tmp_path, capsys):
    from verl_omni.trainer import checkpointing as run_layout

    step_dir, _ = actor_run
    copy = tmp_path / "run" / step_dir.name
    shutil.copytree(step_dir, copy)
    run_layout.write_files_manifest(copy, 3)  # what the trainer writes before the rename
    shard = sorted((copy / "actor").glob("*.distcp"))[0]
    size = shard.stat().st_size
    data = shard.read_bytes()
    # Same size, one byte changed: the DCP length check cannot see it, the manifest's sha256 does.
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    err = _refused(base, copy, tmp_path, capsys)
    assert f"--actor-checkpoint {copy}: its files do not match checkpoint_files.json" in err
    assert f"{shard}: sha256 differs from the manifest (the file is corrupted or replaced)" in err
    # Cut short by 1 byte: named with both sizes from the manifest, before any shard is read.
    shard.write_bytes(data[:-1])
    err = _refused(base, copy, tmp_path, capsys)
    assert f"{shard}: {size - 1} bytes, the manifest records {size} (truncated or replaced)" in err
    assert "DCP shard file is truncated" not in err  # the manifest check came first


def test_refuses_missing_unexpected_and_reshaped_tensors(base, actor_run, tmp_path, capsys):
    _, state = actor_run
    contract = {**read_checkpoint_contract(base), "initial_checkpoint": str(base)}
    bad = dict(state)
    dropped = sorted(bad)[0]
    del bad[dropped]
    bad["extra_head.weight"] = torch.zeros(3)
    bad[SHIFTED] = state[SHIFTED][:, :-1].clone()
    err = _refused(base, write_actor_checkpoint(tmp_path / "run", 1, bad, contract), tmp_path, capsys)
    assert "missing in the actor" in err and dropped in err
    assert "not in the base transformer" in err and "extra_head.weight" in err
    shape = list(state[SHIFTED].shape)
    assert f"tensor {SHIFTED!r}: actor shape {[shape[0], shape[1] - 1]}, base shape {shape}" in err


def test_refuses_non_finite_weights(base, actor_run, tmp_path, capsys):
    _, state = actor_run
    contract = {**read_checkpoint_contract(base), "initial_checkpoint": str(base)}
    bad = {k: v.clone() for k, v in state.items()}
    bad[SPIKED][0] = float("nan")
    err = _refused(base, write_actor_checkpoint(tmp_path / "run", 1, bad, contract), tmp_path, capsys)
    assert f"tensor {SPIKED!r} holds NaN or inf" in err


def test_refuses_an_incomplete_checkpoint(base, actor_run, tmp_path, capsys):
    step_dir, _ = actor_run
    copy = tmp_path / "run" / step_dir.name
    shutil.copytree(step_dir, copy)
    (copy / "trainer_state.json").unlink()
    err = _refused(base, copy, tmp_path, capsys)
    assert "trainer_state.json is missing" in err


def test_bf16_base_receives_the_fp32_master_weights_cast_back(tmp_path, capsys):
    torch.manual_seed(1)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=1), NORM).to(torch.bfloat16)
    base = save_wnm_checkpoint(model, tmp_path / "base16", {"tool": "test"})
    # The actor loads the base as fp32 and trains fp32 master weights.
    master = {k: v.float() for k, v in model.transformer.state_dict().items()}
    master[SHIFTED] = master[SHIFTED] + 1e-4 * torch.arange(master[SHIFTED].numel()).reshape(master[SHIFTED].shape)
    contract = {**read_checkpoint_contract(base), "initial_checkpoint": str(base)}
    run = write_actor_checkpoint(tmp_path / "run", 5, master, contract)
    out = tmp_path / "out"
    assert _tool().main(["--base-vln", str(base), "--actor-checkpoint", str(run), "--output-dir", str(out)]) == 0
    assert "cast from the actor's fp32 master weights" in capsys.readouterr().out
    from safetensors.torch import load_file

    written = load_file(str(out / "transformer" / "model.safetensors"))
    for name, tensor in master.items():
        assert written[name].dtype == torch.bfloat16
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
    prov = json.loads((out / "checkpoint_manifest.json").read_text())["provenance"]
    assert len(prov["dtype_casts"]) == len(master)
    assert check_contract_compatibility(out, base).ok


# ----- the real FSDP checkpoint of a trained run ----------------------------------------------------------
@pytest.fixture(scope="module")
def exported_step2(trained_run, tmp_path_factory) -> Path:
    """The trained run's global_step_2 exported with the command-line tool."""
    out = tmp_path_factory.mktemp("export_trained") / "stage3_step2"
    step_dir = Path(trained_run["output_dir"]) / "global_step_2"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--base-vln", str(trained_run["workspace"]["ckpt"])]
        + ["--actor-checkpoint", str(step_dir), "--output-dir", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _reference_transformer_state(actor_dir: Path, tmp_path: Path) -> dict:
    """The actor's DiT through torch's own DCP -> torch.save converter (an independent reading path)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(actor_dir), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    return full["model"]


def test_export_of_trained_run_reproduces_the_actor_bit_for_bit(trained_run, exported_step2, tmp_path):
    from verl_omni.data.dataset import Stage3Dataset
    from verl_omni.data.frames import read_row_frames
    from verl_omni.pipelines.wnm_shared import (
        NativeBackendConfig,
        NativeRolloutBackend,
        SamplerConfig,
        stratified_requests,
    )

    run = Path(trained_run["output_dir"])
    base = Path(trained_run["workspace"]["ckpt"])
    exported = load_wnm_checkpoint(exported_step2)
    assert check_contract_compatibility(exported_step2, base).ok
    prov = json.loads((exported_step2 / "checkpoint_manifest.json").read_text())["provenance"]
    assert prov["step"] == 2 and Path(prov["run_output_dir"]) == run.resolve()
    assert prov["changed_tensors"] > 0, "two GRPO steps must have changed the DiT"

    # Independent model: base checkpoint + the actor's DiT read by torch's DCP converter.
    reference = load_wnm_checkpoint(base)
    reference.transformer.load_state_dict(
        _reference_transformer_state(run / "global_step_2" / "actor", tmp_path), strict=True
    )
    ref_state, exp_state = reference.transformer.state_dict(), exported.transformer.state_dict()
    for name in ref_state:
        assert torch.equal(ref_state[name], exp_state[name]), name

    ds = Stage3Dataset.open(trained_run["workspace"]["train"])
    rows = [ds[i] for i in range(2)]
    frames = [read_row_frames(r, ds.source_root) for r in rows]
    history = torch.from_numpy(np.stack([h for h, _ in frames]))
    instructions = [r.instruction for r in rows]
    sampler = SamplerConfig(num_steps=4, window_strategy="random", window_size=2, window_range=(0, 3))
    requests = stratified_requests([r.sample_id for r in rows], 1234, 3, 2, 2)
    outs = []
    for model in (reference, exported):
        with torch.no_grad():
            ctx = model.encode_context(history, instructions)
        backend = NativeRolloutBackend.from_model(model, sampler, NativeBackendConfig())
        outs.append(backend.generate(requests, ctx))
    for field in ("actions", "actions_normalized", "video_latents", "window_states", "logprobs"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field
    assert torch.isfinite(outs[1].logprobs).all()


def test_export_reproduces_the_validation_the_actor_logged_at_that_step(trained_run, exported_step2):
    """The run keeps no rollout tensors, only metrics. Its step-2 validation ran ODE rollouts of the first
    ``val_max_samples`` held-out rows right after step 2's update, i.e. with the weights of global_step_2; the
    same requests on the export, grouped per rank as the driver groups them, must give the same scores."""
    from verl_omni.data.dataset import Stage3Dataset
    from verl_omni.data.frames import read_row_frames
    from verl_omni.pipelines.wnm_shared import NativeBackendConfig, NativeRolloutBackend, stratified_requests
    from verl_omni.trainer.config import trainer_config_from_dict
    from verl_omni.trainer.ray_trainer import VAL_STEP_KEY
    from verl_omni.trainer.rollout_batch import shard_requests
    from verl_omni.utils.reward_score import RewardBatch, build_reward_set

    run = Path(trained_run["output_dir"])
    cfg = trainer_config_from_dict(json.loads((run / "resolved_config.json").read_text()))
    logged = next(m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["step"] == 2)
    assert "val/all/visual" in logged, "the fixture run must validate at step 2"
    model = load_wnm_checkpoint(exported_step2)
    backend = NativeRolloutBackend.from_model(
        model,
        cfg.rollout.sampler_config(),
        NativeBackendConfig(deterministic=cfg.trainer.deterministic, chunk_size=cfg.rollout.micro_batch_size),
    )
    train = Stage3Dataset.open(cfg.data.train_root)
    val = Stage3Dataset.open(cfg.data.val_file)
    rows = [val[i] for i in range(cfg.data.val_max_samples)]
    requests = stratified_requests([r.sample_id for r in rows], cfg.trainer.seed, VAL_STEP_KEY, 1, 1)
    assert len(requests) % cfg.topology.world_size == 0  # no padding request to reproduce
    reward_set = build_reward_set({**cfg.reward.reward_set, "occupancy_root": str(train.occupancy_root)})
    scores, events = [], []
    for shard in shard_requests(requests, rows, cfg.topology.world_size):
        frames = [read_row_frames(r, train.source_root) for r in shard.rows]
        with torch.no_grad():
            ctx = model.encode_context(
                torch.from_numpy(np.stack([h for h, _ in frames])), [r.instruction for r in shard.rows]
            )
            target = model.encode_video(torch.from_numpy(np.stack([t for _, t in frames])))
        res = backend.generate(shard.requests, ctx, ode=True)
        rr = [shard.rows[int(i)] for i in res.context_rows]
        batch = RewardBatch.from_rollouts(rr, res.actions, res.request_ids, res.video_latents, target[res.context_rows])
        scores.append(reward_set.score(batch).as_matrix())
        events += [set(r.events) for r in rr]
    scores = np.concatenate(scores)
    recomputed = {"all": (scores[:, 1:5].sum(1).mean(), scores[:, 5:9].sum(1).mean(), scores[:, 0].mean())}
    for ev in {e for evs in events for e in evs}:
        mask = np.array([ev in evs for evs in events])
        s = scores[mask]
        recomputed[ev] = (s[:, 1:5].sum(1).mean(), s[:, 5:9].sum(1).mean(), s[:, 0].mean())
    assert {k.split("/")[1] for k in logged if k.startswith("val/")} == set(recomputed)
    for group, (nav, stop, visual) in recomputed.items():
        # Rollouts are bit-identical; only the order of the float32 sums over rollouts may differ.
        assert float(nav) == pytest.approx(logged[f"val/{group}/nav_total"], rel=1e-6, abs=1e-6), group
        assert float(stop) == pytest.approx(logged[f"val/{group}/stop_total"], rel=1e-6, abs=1e-6), group
        assert float(visual) == pytest.approx(logged[f"val/{group}/visual"], rel=1e-6, abs=1e-6), group


def test_export_card_quotes_the_base_card_and_the_training_settings(tmp_path):
    """A base with a card: the export's card repeats its Data/Training/Lineage bullets and names the trainer's
    settings from the checkpoint's saved config; the manifest lists the new card."""
    torch.manual_seed(0)
    model = WNMModel(WNMConfig.from_size("tiny", num_layers=2), NORM)
    base_card = "# stage2_r1\n\n## Data\n- round 0: 400 scenes.\n\n## Training\n- lr 0.0005.\n  - nested\n"
    base_card += "\n## Licence\nnot quoted\n"
    base = save_wnm_checkpoint(model, tmp_path / "stage2_r1", {"tool": "test"}, readme=base_card)
    state = load_wnm_checkpoint(base).transformer.state_dict()
    contract = {**read_checkpoint_contract(base), "initial_checkpoint": str(base)}
    step_dir = write_actor_checkpoint(tmp_path / "run", 5, state, contract)
    trainer_state = json.loads((step_dir / "trainer_state.json").read_text())
    trainer_state["config"].update(actor={"lr": 1e-4}, algorithm={"baseline": "stratum", "layer_conditioned": True})
    (step_dir / "trainer_state.json").write_text(json.dumps(trainer_state))
    out = tmp_path / "stage3_export"
    assert _tool().main(["--base-vln", str(base), "--actor-checkpoint", str(step_dir), "--output-dir", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "step 5; 0 of" in card and "AdamW lr 0.0001" in card and "baseline stratum" in card
    assert "layer-conditioned advantages True" in card
    lineage = card.split("## Lineage: `stage2_r1`, as its own README gives it\n", 1)[1].split("\n\n", 1)[0]
    assert lineage.splitlines() == ["  - round 0: 400 scenes.", "  - lr 0.0005.", "    - nested"]
    manifest = json.loads((out / "checkpoint_manifest.json").read_text())
    assert manifest["files"]["README.md"]["sha256"] == _sha(out / "README.md")
    load_wnm_checkpoint(out)  # every sha256 of the manifest verifies, the card's included
