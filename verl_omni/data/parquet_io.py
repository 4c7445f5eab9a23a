"""Writing and reading Stage-III Parquet shards.

Shards are written under a ``.tmp`` name and renamed when complete, so a shard file that exists is
whole. Writer settings are fixed (zstd, one row group per shard, statistics on) so that equal rows
give byte-identical files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from verl_omni.data.hashing import file_sha256
from verl_omni.data.schema import STAGE3_SCHEMA, Stage3Row, rows_to_table, schema_problems

COMPRESSION = "zstd"


@dataclass(frozen=True)
class ShardInfo:
    """A written shard.

    Attributes:
        file: File name relative to the output directory.
        split: Split of all its rows.
        rows: Row count.
        sha256: Hex sha256 of the file bytes.
    """

    file: str
    split: str
    rows: int
    sha256: str

    def to_dict(self) -> dict:
        return {"file": self.file, "split": self.split, "rows": self.rows, "sha256": self.sha256}


def write_table_atomic(table: pa.Table, path: str | Path) -> None:
    """Writes ``table`` to ``path`` via ``<path>.tmp`` + rename; refuses to replace an existing file."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: already exists; refusing to overwrite")
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(
            table, tmp, compression=COMPRESSION, row_group_size=max(1, table.num_rows), write_statistics=True
        )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class ShardWriter:
    """Streams rows of one split into ``<prefix>-NNNNN.parquet`` shards of ``shard_size`` rows.

    Args:
        out_dir: Existing directory to write into.
        prefix: File name prefix (the split name).
        split: Split recorded for every shard.
        shard_size: Rows per shard (the last shard may be shorter).
    """

    def __init__(self, out_dir: str | Path, prefix: str, split: str, shard_size: int) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.split = split
        self.shard_size = shard_size
        self._buffer: list[Stage3Row] = []
        self.shards: list[ShardInfo] = []

    def add(self, rows: Iterable[Stage3Row]) -> None:
        for row in rows:
            self._buffer.append(row)
            if len(self._buffer) >= self.shard_size:
                self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        name = f"{self.prefix}-{len(self.shards):05d}.parquet"
        path = self.out_dir / name
        write_table_atomic(rows_to_table(self._buffer), path)
        self.shards.append(ShardInfo(file=name, split=self.split, rows=len(self._buffer), sha256=file_sha256(path)))
        self._buffer = []

    def close(self) -> list[ShardInfo]:
        """Writes the last partial shard and returns every shard written."""
        self._flush()
        return list(self.shards)

    @property
    def rows_written(self) -> int:
        return sum(s.rows for s in self.shards) + len(self._buffer)


def write_table_shards(
    table: pa.Table, out_dir: str | Path, prefix: str, split: str, shard_size: int
) -> list[ShardInfo]:
    """Writes ``table`` (rows in order) as ``<prefix>-NNNNN.parquet`` shards of ``shard_size`` rows."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    problems = schema_problems(table.schema)
    if problems:
        raise ValueError("table does not follow the Stage-III row schema: " + "; ".join(problems))
    table = table.cast(STAGE3_SCHEMA).combine_chunks()
    shards = []
    for k, start in enumerate(range(0, table.num_rows, shard_size)):
        name = f"{prefix}-{k:05d}.parquet"
        part = table.slice(start, shard_size)
        write_table_atomic(part, Path(out_dir) / name)
        shards.append(ShardInfo(file=name, split=split, rows=part.num_rows, sha256=file_sha256(Path(out_dir) / name)))
    return shards


def read_shard(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Reads a shard and checks its schema (all columns, or the named ones).

    Raises:
        ValueError: naming the file and the schema differences.
    """
    table = pq.read_table(path, columns=columns)
    if columns is None:
        problems = schema_problems(table.schema)
    else:
        expected = {f.name: f.type for f in STAGE3_SCHEMA}
        problems = [
            f"column {f.name!r} has type {f.type}, expected {expected.get(f.name)}"
            for f in table.schema
            if expected.get(f.name) != f.type
        ]
    if problems:
        raise ValueError(f"{path}: not a Stage-III shard ({'; '.join(problems)})")
    return table


def read_shards(paths: Iterable[str | Path], columns: list[str] | None = None) -> pa.Table:
    """Concatenates shards in the given order."""
    tables = [read_shard(p, columns) for p in paths]
    if not tables:
        schema = STAGE3_SCHEMA if columns is None else pa.schema([STAGE3_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pa.concat_tables(tables)
