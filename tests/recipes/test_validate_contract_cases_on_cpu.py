"""Bad inputs of validate.sh that need the checkpoints and data, run through its Python entry point.

``validate.sh`` is ``source paths.env; exec python -m verl_omni.trainer.contract_check --config-dir ...``;
these cases call that ``main`` in-process (the checkpoint/model imports cost several seconds per process)
with the environment validate.sh would export. Every case starts from the valid synthesized workspace,
breaks one thing in a copy, and expects the named message and no OK token.
"""

from __future__ import annotations

import json
import shutil

import pytest
from recipe_test_helpers import CONFIG_DIR, SCRIPT_VARS, TRAIN_SIZE

from verl_omni.data.hashing import file_sha256
from verl_omni.trainer import contract_check

TOKEN = contract_check.OK_TOKEN


@pytest.fixture
def check(stage3_workspace, tmp_path, monkeypatch, capsys):
    """Returns ``run(**overrides) -> (exit code, output)`` with the workspace's paths.env values set."""

    def run(config_dir=CONFIG_DIR, **overrides):
        for key in list(__import__("os").environ):
            if key.startswith(SCRIPT_VARS):
                monkeypatch.delenv(key)
        values = stage3_workspace.paths_env(tmp_path / "run")
        values.update({k: str(v) for k, v in overrides.items()})
        for key, value in values.items():
            monkeypatch.setenv(key, value)
        rc = contract_check.main(["--config-dir", str(config_dir)])
        captured = capsys.readouterr()
        return rc, captured.out + captured.err

    return run


def _rewrite_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _copy_train(stage3_workspace, tmp_path):
    dest = tmp_path / "train_copy"
    shutil.copytree(stage3_workspace.train, dest)
    return dest


def test_valid_workspace_prints_token(check):
    rc, out = check()
    assert rc == 0 and out.strip().splitlines()[-1] == TOKEN, out


def test_manifest_with_skipped_records(check, stage3_workspace, tmp_path):
    train = _copy_train(stage3_workspace, tmp_path)

    def edit(m):
        m["counts"]["skipped"] = 1
        m["counts"]["skipped_by_reason"]["unreadable_video"] = 1

    _rewrite_json(train / "manifest.json", edit)
    rc, out = check(WAM_DATA_ROOT=train)
    assert rc == 1 and TOKEN not in out
    assert "WAM_DATA_ROOT" in out and "counts.skipped is 1" in out and "needs 0" in out


def test_train_row_count_mismatch(check):
    rc, out = check(WAM_EXPECTED_TRAIN_SIZE=TRAIN_SIZE + 2)
    assert rc == 1 and TOKEN not in out
    assert f"counts.rows is {TRAIN_SIZE}, expected exactly {TRAIN_SIZE + 2}" in out
    assert "set WAM_EXPECTED_TRAIN_SIZE" in out


def test_too_few_validation_rows(check):
    rc, out = check(WAM_VAL_MAX_SAMPLES=100)
    assert rc == 1 and TOKEN not in out
    assert "WAM_EVENT_VAL_FILE" in out and "need at least 100" in out and "lower WAM_VAL_MAX_SAMPLES" in out


def _renormalized_checkpoint(stage3_workspace, tmp_path):
    """A copy of the checkpoint whose action normalization differs (std of dx 1.0 -> 0.5), manifest updated."""
    ckpt = tmp_path / "ckpt_renorm"
    shutil.copytree(stage3_workspace.checkpoint, ckpt)
    norm_path = ckpt / "action_normalization.json"
    _rewrite_json(norm_path, lambda n: n["std"].__setitem__(0, 0.5))

    def fix_manifest(m):
        m["files"]["action_normalization.json"]["sha256"] = file_sha256(norm_path)
        m["files"]["action_normalization.json"]["bytes"] = norm_path.stat().st_size

    _rewrite_json(ckpt / "checkpoint_manifest.json", fix_manifest)
    return ckpt


def test_initial_and_contract_checkpoints_with_different_normalization(check, stage3_workspace, tmp_path):
    ckpt = _renormalized_checkpoint(stage3_workspace, tmp_path)
    rc, out = check(WNM3D_INITIAL_CHECKPOINT=ckpt)
    assert rc == 1 and TOKEN not in out
    assert "WNM3D_INITIAL_CHECKPOINT" in out and "is not contract-compatible" in out
    assert "action_normalization.std[0]" in out


def test_data_converted_with_another_contract(check, stage3_workspace, tmp_path):
    ckpt = _renormalized_checkpoint(stage3_workspace, tmp_path)
    rc, out = check(WNM3D_INITIAL_CHECKPOINT=ckpt, WAM_DATA_CONTRACT_CHECKPOINT=ckpt)
    assert rc == 1 and TOKEN not in out
    assert "WAM_DATA_ROOT" in out and "data contract differs from checkpoint" in out


def test_manifest_shard_hash_mismatch(check, stage3_workspace, tmp_path):
    train = _copy_train(stage3_workspace, tmp_path)
    _rewrite_json(train / "manifest.json", lambda m: m["shards"][0].__setitem__("sha256", "0" * 64))
    rc, out = check(WAM_DATA_ROOT=train)
    assert rc == 1 and TOKEN not in out
    assert "sha256 differs from the manifest" in out


def test_manifest_checkpoint_hash_mismatch(check, stage3_workspace, tmp_path):
    train = _copy_train(stage3_workspace, tmp_path)
    _rewrite_json(train / "manifest.json", lambda m: m["checkpoint"].__setitem__("model_config_hash", "f" * 64))
    rc, out = check(WAM_DATA_ROOT=train)
    assert rc == 1 and TOKEN not in out
    assert "records checkpoint.model_config_hash 'ffff" in out and "convert the data again" in out


def test_source_manifest_changed_after_sampling(check, stage3_workspace, tmp_path):
    train = _copy_train(stage3_workspace, tmp_path)
    source = tmp_path / "converted_manifest.json"
    shutil.copy(stage3_workspace.converted / "manifest.json", source)
    _rewrite_json(train / "manifest.json", lambda m: m["provenance"].__setitem__("source_manifest", str(source)))
    _rewrite_json(source, lambda m: m["args"].__setitem__("split_seed", 7))
    rc, out = check(WAM_DATA_ROOT=train)
    assert rc == 1 and TOKEN not in out
    assert "changed after sampling" in out and "resample" in out


def _train_with_roots(stage3_workspace, tmp_path, *, source_root=None, occupancy_root=None):
    train = _copy_train(stage3_workspace, tmp_path)

    def edit(m):
        if source_root is not None:
            m["source_root"] = str(source_root)
        if occupancy_root is not None:
            m["occupancy_root"] = str(occupancy_root)

    _rewrite_json(train / "manifest.json", edit)
    return train


def test_unresolvable_video(check, stage3_workspace, tmp_path):
    import pyarrow.parquet as pq

    gn0 = tmp_path / "gn0"
    shutil.copytree(stage3_workspace.gn0, gn0)
    video = pq.read_table(next(stage3_workspace.train.glob("*.parquet"))).column("target_video")[0].as_py()
    (gn0 / video).unlink()
    rc, out = check(WAM_DATA_ROOT=_train_with_roots(stage3_workspace, tmp_path, source_root=gn0))
    assert rc == 1 and TOKEN not in out
    assert "referenced video(s) not found" in out and video in out


def test_missing_occupancy_scene(check, stage3_workspace, tmp_path):
    import pyarrow.parquet as pq

    occ = tmp_path / "occ"
    shutil.copytree(stage3_workspace.occupancy, occ)
    scene = pq.read_table(next(stage3_workspace.train.glob("*.parquet"))).column("occupancy")[0].as_py()
    shutil.rmtree(occ / scene)
    rc, out = check(WAM_DATA_ROOT=_train_with_roots(stage3_workspace, tmp_path, occupancy_root=occ))
    assert rc == 1 and TOKEN not in out
    assert "occupancy scene(s) not found" in out and scene in out


def test_topology_cannot_divide(check):
    rc, out = check(WAM_CPU_WORKERS=3)
    assert rc == 1 and TOKEN not in out
    assert "topology cannot divide" in out and "multiple of 3" in out


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  strata: 4\n", "  strata: 2\n", "locked constant rollout.strata is 2"),
        ("  lr: 1.0e-5\n", "  lr: 3.0e-5\n", "locked constant actor.lr is 3e-05"),
        (
            "        hard_penalty: 1.0\n",
            "        hard_penalty: 0.5\n",
            "locked constant reward.reward_set.rewards.collision.hard_penalty is 0.5",
        ),
    ],
)
def test_changed_locked_constant(check, tmp_path, old, new, message):
    config = tmp_path / "config"
    shutil.copytree(CONFIG_DIR, config)
    text = (config / "locked.yaml").read_text()
    assert old in text
    (config / "locked.yaml").write_text(text.replace(old, new))
    rc, out = check(config_dir=config)
    assert rc == 1 and TOKEN not in out
    assert message in out and "makes a different recipe" in out


def test_locked_constant_overridden_in_tunable_file(check, tmp_path):
    # stage3.yaml cannot change a locked value either: locked.yaml is composed last and the result is compared.
    config = tmp_path / "config"
    shutil.copytree(CONFIG_DIR, config)
    text = (config / "stage3.yaml").read_text()
    text = text.replace("defaults:\n  - _self_\n  - locked\n", "defaults:\n  - locked\n  - _self_\n")
    assert "\nalgorithm:\n" in text
    (config / "stage3.yaml").write_text(text.replace("\nalgorithm:\n", "\nalgorithm:\n  clip_eps: 0.2\n"))
    rc, out = check(config_dir=config)
    assert rc == 1 and TOKEN not in out
    assert "locked constant algorithm.clip_eps is 0.2" in out


def test_collection_frame_size_differs_from_checkpoint(check, stage3_workspace, tmp_path):
    train = _copy_train(stage3_workspace, tmp_path)
    _rewrite_json(train / "manifest.json", lambda m: m["collection"].__setitem__("image_size", [32, 32]))
    rc, out = check(WAM_DATA_ROOT=train)
    assert rc == 1 and TOKEN not in out
    assert "has image_size [32, 32] but the checkpoint's transform_metadata.image_size is [64, 64]" in out


def test_event_val_as_the_parquet_file_the_reference_documents(check, stage3_workspace):
    rc, out = check(WAM_EVENT_VAL_FILE=stage3_workspace.val / "event_val.parquet")
    assert rc == 0 and out.strip().splitlines()[-1] == TOKEN, out
    rc, out = check(WAM_EVENT_VAL_FILE=stage3_workspace.val / "manifest.json")
    assert rc == 0 and out.strip().splitlines()[-1] == TOKEN, out


def test_event_val_parquet_not_listed_or_without_manifest(check, stage3_workspace, tmp_path):
    val = tmp_path / "val_copy"
    shutil.copytree(stage3_workspace.val, val)
    stray = val / "other.parquet"
    shutil.copy(val / "event_val.parquet", stray)
    rc, out = check(WAM_EVENT_VAL_FILE=stray)
    assert rc == 1 and TOKEN not in out
    assert f"WAM_EVENT_VAL_FILE={stray}: not a shard listed in {val / 'manifest.json'}" in out
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(val / "event_val.parquet", alone / "event_val.parquet")
    rc, out = check(WAM_EVENT_VAL_FILE=alone / "event_val.parquet")
    assert rc == 1 and TOKEN not in out
    assert "no manifest.json beside the Parquet file" in out
