"""Session fixture of the recipe tests: a small synthesized Stage-III workspace.

Built once per session by the real user commands (synthesize -> tiny checkpoint -> convert -> sample ->
event val, through ``stage3_e2e_helpers.build_workspace``): 2 scenes x 2 episodes at 64 x 64 pixels (the
tiny checkpoint's frame size), a tiny checkpoint without SFT.
"""

from __future__ import annotations

import pytest
from recipe_test_helpers import TRAIN_SIZE, Workspace
from stage3_e2e_helpers import build_workspace


@pytest.fixture(scope="session")
def stage3_workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("recipes_stage3_ws")
    ws = build_workspace(root, scenes=2, episodes=2, seed=0, train_size=TRAIN_SIZE)
    return Workspace(root, ws["collection"], ws["scenes"], ws["ckpt"], ws["converted"], ws["train"], ws["eventval"])
