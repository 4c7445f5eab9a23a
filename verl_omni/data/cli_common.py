"""Pieces shared by the three data command-line tools: errors/exit codes, checkpoint contract, summaries.

Exit codes (documented in each tool's ``--help``):
    0  output written and usable;
    2  bad arguments or inputs, nothing written;
    3  output written but not usable downstream as is (skipped records, unfilled event buckets).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_omni.data.actions import ActionNormalization
from verl_omni.data.gn0 import SKIP_REASONS
from verl_omni.data.schema import ACTION_CHANNELS, ACTION_STEPS, HISTORY_FRAMES, TARGET_FRAMES

EXIT_OK = 0
EXIT_INPUT = 2
EXIT_NOT_USABLE = 3
EXIT_CODES_HELP = (
    "exit codes: 0 output written and usable; 2 bad arguments or inputs, nothing written; "
    "3 output written but not usable downstream as is (see the summary)"
)
# Relative tolerance of the --action-scale assertion: JSON round trips keep floats exact, so any real
# difference is far larger than this.
ACTION_SCALE_RTOL = 1e-6


class CliError(Exception):
    """A user-facing failure: printed as ``error: <message>`` and mapped to an exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Runs ``main`` and turns :class:`CliError` into a message on stderr and its exit code."""
    try:
        return main(argv)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


def positive_int(text: str) -> int:
    """argparse type: integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fraction(text: str) -> float:
    """argparse type: float in ``[0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def existing_dir(flag: str, value: str | Path) -> Path:
    """Resolved directory or CliError naming the flag."""
    p = Path(value).expanduser().resolve()
    if not p.is_dir():
        raise CliError(f"{flag} {p}: not a directory")
    return p


def load_checkpoint_contract(checkpoint: str | Path) -> dict[str, Any]:
    """Reads the data contract of a checkpoint and checks the parts the data tools depend on.

    Raises:
        CliError: unreadable checkpoint, or frame counts / action layout that differ from the Stage-III rows.
    """
    path = Path(checkpoint).expanduser().resolve()
    if not path.is_dir():
        raise CliError(f"--checkpoint {path}: not a directory; pass a complete WNM checkpoint directory")
    from verl_omni.contracts import read_checkpoint_contract

    try:
        contract = read_checkpoint_contract(path)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"--checkpoint {path}: cannot read its data contract ({e})") from e
    meta = contract.get("transform_metadata") or {}
    expected = {"history_frames": HISTORY_FRAMES, "target_frames": TARGET_FRAMES}
    for key, want in expected.items():
        if meta.get(key) != want:
            raise CliError(
                f"--checkpoint {path}: transform_metadata.{key} is {meta.get(key)!r}; the Stage-III "
                f"rows carry {want} frames"
            )
    layout = meta.get("action_layout") or {}
    if layout.get("steps", ACTION_STEPS) != ACTION_STEPS or len(layout.get("channels", [0] * ACTION_CHANNELS)) != 4:
        raise CliError(
            f"--checkpoint {path}: transform_metadata.action_layout is {layout}; rows carry "
            f"{ACTION_STEPS} steps x {ACTION_CHANNELS} channels"
        )
    try:
        ActionNormalization.from_dict(contract["action_normalization"], source=f"{path}/action_normalization.json")
    except (KeyError, ValueError) as e:
        raise CliError(f"--checkpoint {path}: {e}") from e
    return contract


def parse_action_scale(text: str) -> tuple[float, ...]:
    """argparse type for ``--action-scale``: comma-separated std per channel (``dx,dy,dyaw[,stop]``)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if len(values) not in (3, 4) or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected 3 (dx,dy,dyaw) or 4 (dx,dy,dyaw,stop) positive numbers, got {text!r}"
        )
    return values


def check_action_scale(scale: Sequence[float] | None, normalization: Mapping[str, Any], checkpoint: Path) -> None:
    """Raises CliError when an ``--action-scale`` assertion differs from the checkpoint's std.

    The checkpoint's ``action_normalization.json`` always defines the normalization; the flag can only
    confirm it, never override it.
    """
    if scale is None:
        return
    std = [float(v) for v in normalization["std"]][: len(scale)]
    if any(abs(a - b) > ACTION_SCALE_RTOL * max(abs(a), abs(b)) for a, b in zip(scale, std)):
        channels = ",".join(normalization["channels"][: len(scale)])
        raise CliError(
            f"--action-scale {','.join(f'{v:g}' for v in scale)} differs from the std ({channels}) = "
            f"{','.join(f'{v:g}' for v in std)} in {checkpoint}/action_normalization.json; the checkpoint defines the "
            f"normalization: drop --action-scale or pass the checkpoint's values (nothing was written)"
        )


def print_skips(skipped: Sequence[Mapping[str, Any]], limit: int = 20) -> None:
    """Prints skipped records grouped by reason with what to do (first ``limit`` items)."""
    if not skipped:
        return
    print(f"skipped {len(skipped)} record(s):")
    for item in list(skipped)[:limit]:
        where = item["episode_id"] + ("" if item["t"] is None else f" t={item['t']}")
        print(f"  [{item['reason']}] {where}: {item['detail']}")
    if len(skipped) > limit:
        print(f"  ... and {len(skipped) - limit} more (see skipped_items in manifest.json)")
    for reason in sorted({item["reason"] for item in skipped}):
        print(f"  what to do about {reason}: {SKIP_REASONS[reason]}")


def rate(count: int, seconds: float) -> float:
    """Items per second (inf-safe for very short runs)."""
    return count / seconds if seconds > 0 else float("inf")
