"""Reader of Stage-III datasets for the trainer: rows, deterministic epoch order, resumable position.

A dataset is opened from a ``manifest.json`` (or the directory holding it), from a directory of Parquet
shards without a manifest, or from a single Parquet file (the event-validation file). With a manifest,
shards are read in the recorded order after validation, and video paths resolve against the recorded
collection root unless another one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from verl_omni.data.frames import read_row_frames
from verl_omni.data.hashing import stable_unit
from verl_omni.data.manifest import (
    MANIFEST_NAME,
    ManifestError,
    read_manifest,
    shard_paths,
    validate_manifest,
)
from verl_omni.data.parquet_io import read_shards
from verl_omni.data.schema import SPLITS, Stage3Columns, Stage3Row, table_to_columns


class DatasetError(ValueError):
    """A dataset path cannot be opened as Stage-III data."""


def _locate(path: Path) -> tuple[list[Path], Path | None]:
    """Shard files and manifest (if any) for a manifest/directory/file argument."""
    if path.is_file() and path.suffix == ".parquet":
        manifest = path.parent / MANIFEST_NAME
        return [path], manifest if manifest.is_file() else None
    if path.is_file():
        return [], path
    if path.is_dir():
        manifest = path / MANIFEST_NAME
        if manifest.is_file():
            return [], manifest
        shards = sorted(path.glob("*.parquet"))
        if not shards:
            raise DatasetError(f"{path}: no manifest.json and no *.parquet files")
        return shards, None
    raise DatasetError(f"{path}: no such file or directory")


class Stage3Dataset:
    """In-memory columns of a Stage-III dataset with typed row access and frame decoding.

    Args:
        columns: Dense columns of all rows.
        source_root: Collection root for video references (None: frames unavailable).
        occupancy_root: Occupancy scenes root (None if unknown).
        manifest: The manifest, when the data came with one.
    """

    def __init__(
        self,
        columns: Stage3Columns,
        source_root: Path | None,
        occupancy_root: Path | None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.columns = columns
        self.source_root = source_root
        self.occupancy_root = occupancy_root
        self.manifest = manifest
        self._index = {sid: i for i, sid in enumerate(columns.strings["sample_id"])}
        if len(self._index) != len(columns):
            raise DatasetError("dataset has duplicate sample_id values")

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        split: str | None = None,
        source_root: str | Path | None = None,
        occupancy_root: str | Path | None = None,
        verify: bool = True,
    ) -> Stage3Dataset:
        """Opens a manifest, a dataset directory or a single Parquet file.

        Args:
            path: ``manifest.json``, its directory, a directory of shards, or one ``.parquet`` file.
            split: Keep only rows of this split.
            source_root: Overrides the manifest's collection root.
            occupancy_root: Overrides the manifest's occupancy root.
            verify: Validate the manifest (shard hashes, counts, schema) before reading.

        Raises:
            DatasetError: naming the path and each problem.
        """
        if split is not None and split not in SPLITS:
            raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")
        path = Path(path).expanduser()
        shards, manifest_path = _locate(path)
        manifest = None
        if manifest_path is not None:
            try:
                manifest = read_manifest(manifest_path)
            except ManifestError as e:
                raise DatasetError(str(e)) from e
            if verify:
                problems = validate_manifest(manifest_path, require_no_skipped=False)
                if problems:
                    raise DatasetError(f"{manifest_path}: invalid dataset:\n  " + "\n  ".join(problems))
            listed = shard_paths(manifest_path, manifest)
            if not shards:
                shards = listed
            elif shards[0].resolve() not in {p.resolve() for p in listed}:
                manifest = None  # a stray Parquet file next to someone else's manifest
        try:
            table = read_shards(shards)
        except (OSError, ValueError) as e:
            raise DatasetError(f"{path}: cannot read shards ({e})") from e
        if split is not None:
            import pyarrow.compute as pc

            table = table.filter(pc.equal(table.column("split"), split))
        src = source_root if source_root is not None else (manifest or {}).get("source_root")
        occ = occupancy_root if occupancy_root is not None else (manifest or {}).get("occupancy_root")
        return cls(table_to_columns(table), Path(src) if src else None, Path(occ) if occ else None, manifest)

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, i: int) -> Stage3Row:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        return self.columns.row(i % len(self))

    @property
    def sample_ids(self) -> list[str]:
        return self.columns.strings["sample_id"]

    def index_of(self, sample_id: str) -> int:
        """Position of a sample id (raises KeyError)."""
        return self._index[sample_id]

    def frames(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(history, target)`` uint8 ``[33, H, W, 3]`` frames of row ``i``."""
        if self.source_root is None:
            raise DatasetError("no collection root known for video references; pass source_root")
        return read_row_frames(self[i], self.source_root)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """Row positions in the order of epoch ``epoch`` for ``seed``."""
        return epoch_order(self.sample_ids, seed, epoch)


def epoch_order(sample_ids: list[str], seed: int, epoch: int) -> np.ndarray:
    """Deterministic permutation of rows for ``(seed, epoch)``, keyed on sample ids.

    Keys are ``stable_unit(seed, f"{epoch}:{sample_id}")``: the order is identical on every machine and
    numpy version, and does not depend on how rows were split into shards.

    Returns:
        ``int64 [N]`` permutation of ``range(N)``.
    """
    keys = [(stable_unit(seed, f"{epoch}:{sid}"), sid) for sid in sample_ids]
    return np.asarray(sorted(range(len(sample_ids)), key=keys.__getitem__), dtype=np.int64)


@dataclass
class DataPosition:
    """Where an epoch-ordered pass over ``num_rows`` rows stands; saved with checkpoints for resume.

    Attributes:
        num_rows: Dataset size (a resumed run must see the same dataset).
        seed: Ordering seed.
        epoch: Current epoch (0-based).
        position: Rows of the current epoch already handed out.
    """

    num_rows: int
    seed: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"DataPosition.num_rows must be >= 1, got {self.num_rows}")
        if self.epoch < 0 or not 0 <= self.position <= self.num_rows:
            raise ValueError(f"DataPosition: epoch {self.epoch} / position {self.position} out of range")

    def state_dict(self) -> dict[str, int]:
        return {"num_rows": self.num_rows, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state_dict(cls, state: dict[str, int], num_rows: int | None = None) -> DataPosition:
        """Restores a position; ``num_rows`` (if given) must match the saved one."""
        if num_rows is not None and state["num_rows"] != num_rows:
            raise ValueError(
                f"saved data position is for {state['num_rows']} rows but the dataset has {num_rows}; "
                f"resume with the same dataset"
            )
        return cls(**{k: int(state[k]) for k in ("num_rows", "seed", "epoch", "position")})


class EpochSampler:
    """Hands out row positions in deterministic per-epoch order, resumable from a :class:`DataPosition`.

    Args:
        sample_ids: Row ids of the dataset (fix the order of every epoch).
        seed: Ordering seed.
        position: Saved position to resume from.
    """

    def __init__(self, sample_ids: list[str], seed: int, position: DataPosition | None = None) -> None:
        self.sample_ids = list(sample_ids)
        self.position = position or DataPosition(num_rows=len(self.sample_ids), seed=seed)
        if self.position.num_rows != len(self.sample_ids) or self.position.seed != seed:
            raise ValueError(
                f"position {self.position.state_dict()} does not match {len(self.sample_ids)} rows / seed {seed}"
            )
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = epoch_order(self.sample_ids, self.position.seed, epoch)
            self._order_epoch = epoch
        return self._order

    def next_indices(self, count: int) -> np.ndarray:
        """The next ``count`` row positions, continuing into the next epoch when one runs out.

        Returns:
            ``int64 [count]``.
        """
        out = []
        pos = self.position
        while count > 0:
            if pos.position == pos.num_rows:
                pos.epoch, pos.position = pos.epoch + 1, 0
            take = min(count, pos.num_rows - pos.position)
            out.append(self._order_for(pos.epoch)[pos.position : pos.position + take])
            pos.position += take
            count -= take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()
