"""FlashAttention-4 forward tiles (``flash_attention4_tiles.py``): the setting's forms and the ``fit`` rule, by hand.

How the op passes a tile to the kernel is tested in ``test_wnm_flash_attention4_on_cpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_omni.models.wnm import flash_attention4_tiles as tiles

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "tile"),
    [("128x160", (128, 160)), (" 192X128 ", (192, 128)), ("64x16", (64, 16)), ("", None), ("default", None)],
)
def test_parse_forward_tile(text, tile):
    assert tiles.parse_forward_tile(text) == tile


@pytest.mark.parametrize("text", ["128", "128x", "x160", "96x128", "128x100", "128x0", "128x-16", "axb"])
def test_parse_forward_tile_refuses_what_the_kernel_cannot_take(text):
    with pytest.raises(ValueError, match="forward tile .*expected MxN"):
        tiles.parse_forward_tile(text)


@pytest.mark.parametrize(
    ("keys", "tile_n"),
    [
        # padded key counts by hand, widths 128 / 144 / 160 / 176 / 192:
        (4640, 160),  # 4736 / 4752 / 4640 / 4752 / 4800: 160 divides it (29 tiles)
        (545, 144),  # 640 / 576 / 640 / 704 / 576: 144 and 192 tie at 576, the first wins
        (4608, 128),  # 4608 / 4608 / 4640 / 4752 / 4608: three exact, the first wins
        (100, 128),  # one tile of any width; 128 pads least
        (300, 160),  # 384 / 432 / 320 / 352 / 384
    ],
)
def test_fit_tile_n_pads_the_key_count_least(keys, tile_n):
    assert tiles.fit_tile_n(keys) == tile_n


def test_a_bad_variable_is_reported_by_the_contract_check_not_raised_by_an_import():
    # A fresh process with the variable set, as launch.sh runs the check: importing the op's module would stop at the
    # bad value, so the check must validate it from this module and leave the op unimported.
    code = (
        "import os, sys\n"
        "from verl_omni.trainer.contract_env import Report, check_environment\n"
        "report = Report()\n"
        "check_environment(dict(os.environ), report, '')\n"
        "print(dict(report.failures)['WAM_FA4_FORWARD_TILE'])\n"
        "print('op imported:', 'verl_omni.models.wnm.flash_attention4' in sys.modules)\n"
    )
    env = {**os.environ, "WAM_FA4_FORWARD_TILE": "128x100", "WAM_ATTENTION_BACKEND": "fa4", "WAM_GPUS_PER_NODE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WAM_FA4_FORWARD_TILE: forward tile '128x100': expected MxN" in proc.stdout
    assert "op imported: False" in proc.stdout
    # And the op's module itself refuses the value by the variable's name, as each worker would.
    proc = subprocess.run(
        [sys.executable, "-c", "import verl_omni.models.wnm.flash_attention4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "environment variable WAM_FA4_FORWARD_TILE: forward tile '128x100'" in proc.stderr
