"""All-or-nothing output directories for the data tools.

A tool builds its whole output in a hidden temporary directory beside ``--output-dir`` and renames it
into place only after everything (shards, manifest) is written. Readers therefore never see a
half-written dataset, and a failed or interrupted run leaves nothing behind but its own temp dir,
which is removed on the way out.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """``--output-dir`` already exists; the tools never overwrite outputs."""


def check_output_dir_free(output_dir: str | Path, flag: str = "--output-dir") -> Path:
    """Resolves ``output_dir`` and raises if it (or a file of that name) exists.

    Raises:
        OutputExistsError: naming the flag and path and what to do.
    """
    out = Path(output_dir).expanduser().resolve()
    if out.exists() or out.is_symlink():
        raise OutputExistsError(f"{flag} {out}: already exists; choose a new directory or remove the old one first")
    return out


@contextmanager
def staged_output_dir(output_dir: str | Path, flag: str = "--output-dir") -> Iterator[Path]:
    """Yields a fresh temp directory that becomes ``output_dir`` when the block succeeds.

    Args:
        output_dir: Final location; must not exist. Its parent is created if needed.
        flag: Command-line flag named in errors.

    Yields:
        The temporary directory to write into (same file system as the target, so the rename is atomic).

    Raises:
        OutputExistsError: the target exists before the run or appeared during it.
    """
    out = check_output_dir_free(output_dir, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        # A previous run of this very pid cannot be alive; its leftovers are garbage.
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() or out.is_symlink():
            raise OutputExistsError(f"{flag} {out}: appeared while this run was writing; the result was discarded")
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
