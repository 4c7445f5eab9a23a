"""The data CLIs start without torch or the model package: their refusals come at once, not after ~9 s of imports.

Each case runs a tool in a fresh interpreter up to an early exit and reports whether ``torch``, ``diffusers`` or
``verl_omni.models`` were imported on the way.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = [
    "synthesize_gn0_collection",
    "convert_interiorgs_dagger_to_rlhf",
    "sample_stage3_train",
    "build_vggt_stage3_event_val",
    "collect_dagger",
]
PROBE = """
import json, runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "diffusers", "verl_omni.models") if m in sys.modules)
print(json.dumps({{"code": code, "heavy": heavy}}))
"""


def _probe(argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


@pytest.mark.parametrize("tool", TOOLS)
def test_help_imports_neither_torch_nor_the_model(tool):
    out = _probe([f"tools/data/{tool}.py", "--help"])
    assert out["code"] == 0 and out["heavy"] == [], out


def test_collect_dagger_refuses_a_bad_level_before_importing_the_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")  # the tool only checks that the folder looks like a checkpoint here
    argv = ["tools/data/collect_dagger.py", "--policy-checkpoint", str(ckpt), "--beta", "0", "--level", "nowhere"]
    out = _probe([*argv, "--output-dir", str(tmp_path / "out"), "--occupancy-dir", str(tmp_path / "occ")])
    assert out["code"] == 2 and "--level: unknown task level 'nowhere'" in out["stderr"]
    assert out["heavy"] == [], out
