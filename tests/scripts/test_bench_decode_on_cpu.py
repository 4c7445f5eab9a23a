"""scripts/bench_decode.py at its smallest: a one-scene collection decoded by both RGB converters."""

import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_both_converters_decode_the_same_states(tmp_path, capsys):
    stage2 = runpy.run_path(str(REPO / "scripts/train_stage2.py"), run_name="train_stage2")
    work = tmp_path / "syn"
    assert stage2["main"](["--workdir", str(work), "--level", "one_room", "--scenes", "1", "--episodes-per-scene",
                           "1", "--workers", "1", "--synthesize-only", "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    bench = runpy.run_path(str(REPO / "scripts/bench_decode.py"), run_name="bench_decode")
    argv = ["--collection", str(work / "data" / "r0"), "--workers", "1", "--threads", "1", "--states", "3"]
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    # Every file was read once before the rows (counted here from the file system, not by the script).
    files = [f for f in (work / "data" / "r0").rglob("*") if f.is_file()]
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    assert f"# page cache warmed: {len(files)} files, {megabytes:.0f} MB read" in out
    rows = [line for line in out.splitlines() if line.startswith("| one a")]
    assert [r.split("|")[1].strip() for r in rows] == ["one a clip", "one a frame"]
    assert all(int(r.split("|")[4]) == 3 for r in rows)  # the states column: each row decoded the same 3 states
    from verl_omni.data import video

    assert video.REUSE_RGB_CONVERTER is True and video.DECODE_THREADS == 1  # the defaults are back
    with pytest.raises(SystemExit):
        bench["main"]([*argv, "--converter", "none"])
    assert "--converter" in capsys.readouterr().err
