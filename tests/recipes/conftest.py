"""Session fixture of the recipe tests: a small synthesized Stage-III workspace.

Built once per session by the real user commands (synthesize -> tiny checkpoint -> convert -> sample ->
event val): 2 scenes x 2 episodes at 64 x 64 pixels (the tiny checkpoint's frame size), a tiny checkpoint
without SFT.
"""

from __future__ import annotations

import pytest
from recipe_test_helpers import REPO, TOOLS, TRAIN_SIZE, Workspace, run_tool


@pytest.fixture(scope="session")
def stage3_workspace(tmp_path_factory) -> Workspace:
    missing = [str(p.relative_to(REPO)) for p in TOOLS.values() if not p.is_file()]
    if missing:
        pytest.skip(f"workspace tools not written yet: {missing}")
    root = tmp_path_factory.mktemp("recipes_stage3_ws")
    ws = Workspace(root, root / "gn0", root / "occ", root / "ckpt", root / "converted", root / "train", root / "val")
    run_tool(
        "synthesize",
        "--output-dir",
        str(ws.gn0),
        "--occupancy-dir",
        str(ws.occupancy),
        "--num-scenes",
        "2",
        "--episodes-per-scene",
        "2",
        "--image-size",
        "64",
        "--seed",
        "0",
    )
    run_tool("checkpoint", "--output-dir", str(ws.checkpoint), "--no-progress")
    run_tool(
        "convert",
        "--input-root",
        str(ws.gn0),
        "--output-dir",
        str(ws.converted),
        "--checkpoint",
        str(ws.checkpoint),
        "--occupancy-root",
        str(ws.occupancy),
        "--shard-size",
        "64",
        "--val-fraction",
        "0",
        "--split-seed",
        "42",
        "--workers",
        "1",
        "--worker-prefetch",
        "1",
    )
    run_tool(
        "sample",
        "--source-manifest",
        str(ws.converted / "manifest.json"),
        "--output-dir",
        str(ws.train),
        "--train-size",
        str(TRAIN_SIZE),
        "--shard-size",
        "64",
        "--seed",
        "42",
    )
    run_tool(
        "event_val",
        "--input-root",
        str(ws.gn0),
        "--output-dir",
        str(ws.val),
        "--checkpoint",
        str(ws.checkpoint),
        "--exclude-parquet-dir",
        str(ws.train),
        "--occupancy-root",
        str(ws.occupancy),
        "--per-event",
        "1",
        "--workers",
        "1",
    )
    return ws
