"""A table entry written one record batch (or Parquet row group) at a time: each column's
files grow by appending (``npy_append``), so a table decoded from a file never exists
whole in memory, only the batch being written.

Each chunk goes through the same per-array encoding as a whole column
(``table_arrow.arrow_column``), so the files are those ``encode_arrow`` writes: numbers
appended; strings' and lists' int64 offsets rebased by a running total (as
``table_chunks`` does for chunked columns); the validity bitmap packed across batch
boundaries, begun (all valid before) at the first batch with a null. A batch that needs
another layout than the first (a fixed-size list column that meets a null: stored as a
list with offsets) raises :class:`ChangedLayout`; the caller then decodes the table whole.

Each chunk is encoded before it is written, so a caller can reserve the bytes it really
adds (``add(batch, before_write)``): a dictionary column's strings, decoded, can be far
more than its Arrow size. No descriptor is held between batches (``npy_append``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._disk.npy import NpyHeader
from .._disk.npy_append import NpyAppender
from ..errors import UnsupportedDataError
from .table_arrow import arrow_column, column_errors
from .table_encode import table_meta

__all__ = ["ChangedLayout", "TableAppender"]

_ONES = 1 << 20  # bytes of an all-valid bitmap written at once
_PAGE = 4096  # what a new file takes at least (its header's page)

CreateFile = Callable[[str], tuple[int, str]]
"""``create(name)``: a new, empty file for part ``name`` (``c0.values``): its descriptor
(the appender closes it) and its path (reopened for each append)."""


class ChangedLayout(Exception):
    """A batch's column needs files the first batch's did not: decode the table whole."""


class TableAppender:
    """A table entry's column files and meta from batches of one schema, in order."""

    def __init__(self, schema: Any, create: CreateFile, what: str) -> None:
        names = list(schema.names)
        if len(set(names)) != len(names):
            raise UnsupportedDataError(f"{what}: the table has duplicate column names")
        self.schema, self.what = schema, what
        self.rows = 0
        self._create = create
        self._columns = [_Column(f"c{i}", name) for i, name in enumerate(names)]

    @property
    def nbytes(self) -> int:
        """Bytes written so far (the data, without headers)."""
        return sum(a.nbytes for c in self._columns for a in c.files.values())

    @property
    def file_count(self) -> int:
        return sum(len(c.files) for c in self._columns)

    def add(self, batch: Any, before_write: Callable[[int], None] | None = None) -> None:
        """Append a pyarrow Table or RecordBatch of the schema's columns; ``before_write(n)``
        is told the bytes each column chunk, encoded, is about to add (a page for each new
        file included) before they are written: to reserve them."""
        for column, values in zip(self._columns, batch.columns, strict=True):
            for chunk in getattr(values, "chunks", [values]):
                encoded = column.encode(chunk, self.what)
                if before_write is not None:
                    before_write(encoded.nbytes)
                column.write(encoded, self._create)
        self.rows += batch.num_rows

    def finish(self) -> tuple[dict[str, NpyHeader], dict[str, int], dict[str, Any]]:
        """Headers written: every file's header and CRC-32 (by part name), and the meta."""
        headers: dict[str, NpyHeader] = {}
        crcs: dict[str, int] = {}
        for i, column in enumerate(self._columns):
            if column.desc is None:  # no batch at all: the column's type, empty
                empty = self.schema.empty_table().column(i).combine_chunks()
                column.write(column.encode(empty, self.what), self._create)
            for name, (crc, header) in column.finish().items():
                crcs[name], headers[name] = crc, header
        descriptions = [c.desc or {} for c in self._columns]
        return headers, crcs, table_meta([c.name for c in self._columns], descriptions, self.rows)


@dataclass
class _Encoded:
    """A column chunk's files (``arrow_column``), not written yet."""

    files: dict[str, np.ndarray]
    desc: dict[str, Any]
    count: int
    valid: np.ndarray | None
    nbytes: int  # what writing it adds to the column's files


class _Column:
    def __init__(self, prefix: str, name: str) -> None:
        self.prefix, self.name = prefix, name
        self.desc: dict[str, Any] | None = None
        self.files: dict[str, NpyAppender] = {}
        self.rows = 0
        self._parts: set[str] = set()
        self._base = 0  # offsets: the items of earlier chunks
        self._pending: np.ndarray | None = None  # validity bits not yet a whole byte

    def encode(self, chunk: Any, what: str) -> _Encoded:
        with column_errors(what, self.name):
            files, desc = arrow_column(chunk)
        count = len(chunk)
        valid = files.pop("valid", None)
        nbytes = sum(int(a.nbytes) for part, a in files.items() if part != "offsets")
        nbytes += 8 * count if "offsets" in files else 0
        parts = set(files)
        if valid is not None or self._pending is not None:
            parts.add("valid")
            nbytes += count // 8 + 1 + (self.rows // 8 if self._pending is None else 0)
        nbytes += _PAGE * len(parts - set(self.files))
        return _Encoded(files, desc, count, valid, nbytes)

    def write(self, encoded: _Encoded, create: CreateFile) -> None:
        files, desc, count, valid = dict(encoded.files), encoded.desc, encoded.count, encoded.valid
        if self.desc is None:
            self.desc, self._parts = desc, set(files)
        elif desc != self.desc or set(files) != self._parts:
            raise ChangedLayout(f"column {self.name!r}: {desc} after {self.desc}")
        offsets = files.pop("offsets", None)
        for part, array in files.items():  # values, or a string column's bytes
            self._file(part, array.dtype, array.shape[1:], create).append(array)
        if offsets is not None:  # rebased to 0 for this chunk: shifted by the items before
            self._file("offsets", np.dtype(np.int64), (), create).append(offsets[:count] + self._base)
            self._base += int(offsets[count])
        if valid is not None or self._pending is not None:
            bits = np.ones(count, np.bool_)
            if valid is not None:
                bits = np.unpackbits(valid, count=count, bitorder="little").view(np.bool_)
            valid_file = self._file("valid", np.dtype(np.uint8), (), create)
            if self._pending is None:  # the first null: the rows before were all valid
                full, rest = divmod(self.rows, 8)
                for start in range(0, full, _ONES):  # in pieces: flat for any number of rows
                    valid_file.append(np.full(min(_ONES, full - start), 0xFF, np.uint8))
                self._pending = np.ones(rest, np.bool_)
            bits = np.concatenate([self._pending, bits])
            whole = len(bits) // 8 * 8
            valid_file.append(np.packbits(bits[:whole], bitorder="little"))
            self._pending = bits[whole:]
        self.rows += count

    def _file(
        self, part: str, dtype: np.dtype[Any], tail: tuple[int, ...], create: CreateFile
    ) -> NpyAppender:
        found = self.files.get(part)
        if found is None:
            fd, path = create(f"{self.prefix}.{part}")
            found = self.files[part] = NpyAppender(fd, path, dtype, tail)  # (closes fd)
        return found

    def finish(self) -> dict[str, tuple[int, NpyHeader]]:
        if "offsets" in self.files:
            self.files["offsets"].append(np.array([self._base], np.int64))
        if self._pending is not None and len(self._pending):
            self.files["valid"].append(np.packbits(self._pending, bitorder="little"))
        return {f"{self.prefix}.{part}": file.finish() for part, file in self.files.items()}
