"""Checkpoint file manifests, the choice of the checkpoint to resume from, and run-directory provenance.

Pure file-system tests (no Ray): checkpoints are directories with small hand-written files, so every
expected size and message follows from the bytes written here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from verl_omni.trainer import checkpointing as ck


def _fake_checkpoint(out: Path, step: int, payload: bytes = b"abc") -> Path:
    """A committed checkpoint whose actor holds .metadata and one 3-byte shard."""
    part = ck.begin(out, step)
    (part / "actor" / ".metadata").write_bytes(b"meta")
    (part / "actor" / "__0_0.distcp").write_bytes(payload)
    return ck.commit(out, step, {"step": step})


def test_commit_writes_sizes_and_hashes_before_the_rename(tmp_path):
    final = _fake_checkpoint(tmp_path, 1)
    manifest = json.loads((final / ck.FILES_MANIFEST).read_text())
    assert manifest["format"] == ck.FILES_FORMAT and manifest["step"] == 1
    assert sorted(manifest["files"]) == ["actor/.metadata", "actor/__0_0.distcp", "trainer_state.json"]
    shard = manifest["files"]["actor/__0_0.distcp"]
    # sha256("abc") is the FIPS 180-2 test vector.
    assert shard == {"size": 3, "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"}
    assert manifest["files"]["actor/.metadata"]["size"] == 4
    assert not (tmp_path / "global_step_1.partial").exists()
    assert (tmp_path / ck.POINTER).read_text() == "1\n"
    assert ck.verify_checkpoint(final) == []


def test_verify_names_truncated_corrupted_and_missing_files(tmp_path):
    final = _fake_checkpoint(tmp_path, 1)
    shard = final / "actor" / "__0_0.distcp"
    shard.write_bytes(b"ab")  # cut short
    assert ck.verify_checkpoint(final) == [f"{shard}: 2 bytes, the manifest records 3 (truncated or replaced)"]
    shard.write_bytes(b"abd")  # same size, other bytes
    corrupted = f"{shard}: sha256 differs from the manifest (the file is corrupted or replaced)"
    assert ck.verify_checkpoint(final) == [corrupted]
    assert ck.verify_checkpoint(final, hashes=False) == []
    shard.unlink()
    assert ck.verify_checkpoint(final) == [f"{shard}: missing (the manifest lists 3 bytes)"]
    (final / ck.FILES_MANIFEST).unlink()
    assert "checkpoint_files.json: missing" in ck.verify_checkpoint(final)[0]


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "global_step_3" / "actor" / "__0_0.distcp").write_bytes(b"a")
    (tmp_path / "global_step_2" / "trainer_state.json").write_text("{}")  # 2 bytes instead of 14
    choice = ck.choose_resume(tmp_path)
    assert choice.step == 1 and choice.path == tmp_path / "global_step_1" and choice.fell_back
    assert [s for s, _ in choice.damaged] == [3, 2]
    text = choice.describe_damage()
    assert "global_step_3 is damaged" in text and "__0_0.distcp: 1 bytes, the manifest records 3" in text
    assert ck.latest_intact(tmp_path) == tmp_path / "global_step_1"
    # The pointer still says 3; the presence-only check would have taken it.
    assert ck.latest_step(tmp_path) == 3


def test_no_intact_checkpoint_refuses_with_the_way_out_and_names_none_as_good(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    (tmp_path / "global_step_1" / "actor" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ck.CheckpointIntegrityError) as e:
        ck.choose_resume(tmp_path)
    msg = str(e.value)
    assert "no intact checkpoint" in msg and "__0_0.distcp: 0 bytes, the manifest records 3" in msg
    assert "mv" in msg and "new WAM_OUTPUT_DIR" in msg and "resume from" not in msg
    assert ck.latest_intact(tmp_path) is None
    assert ck.choose_resume(tmp_path / "empty").step is None


def test_recommit_of_a_step_keeps_the_damaged_copy_aside(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    (tmp_path / "global_step_1" / "actor" / "__0_0.distcp").write_bytes(b"a")
    _fake_checkpoint(tmp_path, 1, payload=b"xyz")
    assert (tmp_path / "global_step_1.replaced").is_dir()
    assert ck.verify_checkpoint(tmp_path / "global_step_1") == []


def _items(**changes):
    base = {"recipe": "r", "locked:rollout.eta": 0.7, "setting:trainer.total_steps": 2, "dataset:data.train_root": "a"}
    base.update(changes)
    return base


def test_provenance_records_then_refuses_each_difference_with_both_ways_out(tmp_path):
    first = ck.check_provenance(tmp_path, _items())
    assert first.action == "new"
    ck.write_provenance(tmp_path, first.record)
    assert ck.check_provenance(tmp_path, _items()).action == "same"
    # Without a checkpoint nothing can be resumed onto: a changed launch replaces the record.
    assert ck.check_provenance(tmp_path, _items(recipe="other")).action == "replaced"
    _fake_checkpoint(tmp_path, 1)
    with pytest.raises(ck.ProvenanceError) as e:
        ck.check_provenance(tmp_path, _items(**{"locked:rollout.eta": 0.5, "dataset:data.train_root": "b"}), env={})
    msg = str(e.value)
    assert "locked:rollout.eta: recorded 0.7, now 0.5" in msg
    assert 'dataset:data.train_root: recorded "a", now "b"' in msg
    assert "set WAM_OUTPUT_DIR to a new directory" in msg and "WAM_RESUME_OVERRIDE" in msg


def test_resumable_knob_needs_an_explicit_override_which_is_logged(tmp_path):
    ck.write_provenance(tmp_path, ck.check_provenance(tmp_path, _items()).record)
    _fake_checkpoint(tmp_path, 1)
    changed = _items(**{"setting:trainer.total_steps": 5})
    with pytest.raises(ck.ProvenanceError) as e:
        ck.check_provenance(tmp_path, changed, env={})
    msg = str(e.value)
    assert "setting:trainer.total_steps [may change on resume]: recorded 2, now 5" in msg
    assert "WAM_RESUME_OVERRIDE=trainer.total_steps bash recipes/wnm_3d/stage3/launch.sh" in msg
    # The variable name is accepted as well as the config key.
    result = ck.check_provenance(tmp_path, changed, env={"WAM_RESUME_OVERRIDE": "WAM_TOTAL_STEPS"})
    assert result.action == "override"
    assert result.messages == ["WAM_RESUME_OVERRIDE: accepted setting:trainer.total_steps: 2 -> 5"]
    assert result.record["history"][-1]["override"] == {"setting:trainer.total_steps": {"recorded": 2, "now": 5}}
    # An override never unlocks a locked constant.
    with pytest.raises(ck.ProvenanceError):
        ck.check_provenance(tmp_path, _items(**{"locked:rollout.eta": 0.5}), env={"WAM_RESUME_OVERRIDE": "rollout.eta"})


def test_checkpoint_blocks_may_change_on_resume_and_runs_from_before_the_field_resume_with_an_override(tmp_path):
    """actor.checkpoint_blocks changes memory and recomputation, not the optimisation: a resumable knob. A run
    recorded before the field existed has no such item; the new launch records null, which is an overridable
    difference."""
    ck.write_provenance(tmp_path, ck.check_provenance(tmp_path, _items()).record)
    _fake_checkpoint(tmp_path, 1)
    now = _items(**{"setting:actor.checkpoint_blocks": None})
    with pytest.raises(ck.ProvenanceError) as e:
        ck.check_provenance(tmp_path, now, env={})
    assert 'setting:actor.checkpoint_blocks [may change on resume]: recorded "<absent>", now null' in str(e.value)
    result = ck.check_provenance(tmp_path, now, env={"WAM_RESUME_OVERRIDE": "actor.checkpoint_blocks"})
    assert result.action == "override"
    ck.write_provenance(tmp_path, result.record)
    changed = _items(**{"setting:actor.checkpoint_blocks": 20})
    assert ck.check_provenance(tmp_path, changed, env={"WAM_RESUME_OVERRIDE": "actor.checkpoint_blocks"}).messages == [
        "WAM_RESUME_OVERRIDE: accepted setting:actor.checkpoint_blocks: null -> 20"
    ]


def test_foreign_checkpoint_is_named(tmp_path):
    ck.write_provenance(tmp_path, ck.check_provenance(tmp_path, _items()).record)
    final = _fake_checkpoint(tmp_path, 1)
    ck.record_checkpoint(tmp_path, 1, final)
    assert ck.foreign_checkpoint_problem(tmp_path, 1, final) is None
    recorded = hashlib.sha256((final / ck.FILES_MANIFEST).read_bytes()).hexdigest()
    assert ck.read_provenance(tmp_path)["checkpoints"] == {"1": recorded}
    _fake_checkpoint(tmp_path, 1, payload=b"xyz")  # another checkpoint at the same step
    problem = ck.foreign_checkpoint_problem(tmp_path, 1, final)
    assert problem is not None and f"recorded {recorded}" in problem and "not the checkpoint this run" in problem
