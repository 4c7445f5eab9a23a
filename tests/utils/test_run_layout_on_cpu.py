"""run_layout: locating one checkpoint (complete, files matching their manifest) and DCP data-file presence."""

import json
from collections import namedtuple
from types import SimpleNamespace

import pytest

from verl_omni.utils import run_layout
from verl_omni.utils.run_layout import CheckpointLayoutError, dcp_data_file_problem, locate_checkpoint


def _checkpoint(root, step=3, state=None):
    ckpt = root / f"global_step_{step}"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "actor" / ".metadata").write_text("m")
    (ckpt / "actor" / "__0_0.distcp").write_bytes(b"0123456789")
    (ckpt / "trainer_state.json").write_text(json.dumps(state if state is not None else {"step": step}))
    return ckpt


def test_locate_checkpoint_from_the_step_or_the_actor_dir(tmp_path):
    ckpt = _checkpoint(tmp_path)
    run_layout.write_files_manifest(ckpt, 3)
    for path in (ckpt, ckpt / "actor"):
        found = locate_checkpoint(path)
        assert (found.checkpoint_dir, found.actor_dir, found.step) == (ckpt, ckpt / "actor", 3)


def test_locate_checkpoint_refusals_name_the_path(tmp_path):
    with pytest.raises(CheckpointLayoutError, match="directory does not exist"):
        locate_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointLayoutError, match=r"no \.metadata in it"):
        locate_checkpoint(tmp_path)
    part = _checkpoint(tmp_path, step=4)
    part = part.rename(tmp_path / "global_step_4.partial")
    with pytest.raises(CheckpointLayoutError, match="a .partial checkpoint is incomplete"):
        locate_checkpoint(part)
    ckpt = _checkpoint(tmp_path, step=5, state={"step": -1})
    with pytest.raises(CheckpointLayoutError, match="field 'step' must be a non-negative integer, got -1"):
        locate_checkpoint(ckpt)
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(CheckpointLayoutError, match=f"{ckpt}: trainer_state.json is missing"):
        locate_checkpoint(ckpt)
    ckpt = _checkpoint(tmp_path, step=6)
    run_layout.write_files_manifest(ckpt, 6)
    (ckpt / "actor" / "__0_0.distcp").write_bytes(b"012345678")  # one byte short
    with pytest.raises(CheckpointLayoutError, match="its files do not match checkpoint_files.json"):
        locate_checkpoint(ckpt)


def test_dcp_data_file_problem(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)

    index = namedtuple("MetadataIndex", "fqn")  # hashable, like torch's MetadataIndex

    def chunk(fqn, rel, offset, length):
        return index(fqn), SimpleNamespace(relative_path=rel, offset=offset, length=length)

    data = dict([chunk("model.w", "a.distcp", 4, 6), chunk("optim.m", "b.distcp", 0, 5)])
    assert dcp_data_file_problem(tmp_path, data, "model.") is None  # 4 + 6 = 10 bytes; b only holds optim.*
    assert "b.distcp: DCP shard file is missing (it holds 'optim.m'" in dcp_data_file_problem(tmp_path, data)
    data = dict([chunk("model.w", "a.distcp", 4, 7)])
    assert "truncated (10 bytes, 'model.w' needs 11)" in dcp_data_file_problem(tmp_path, data, "model.")
