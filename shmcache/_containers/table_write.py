"""A pyarrow Table (a ``save_to_disk`` folder's mapped Arrow streams) written into a
version as a table entry, its encoding pipelined with the copy into tmpfs.

The files are those :func:`~shmcache._containers.table_arrow.encode_arrow_parts` gives,
byte for byte. Every column :func:`~shmcache._containers.table_chunks.column_stream`
takes (numbers, strings, lists of numbers, no nulls: what ``datasets`` writes) is sized
first from its chunks' end offsets, so the whole entry's bytes are reserved before any
is written, as before; then its files' headers are known, and the table is written a
group of record batches (~8 MiB) at a time: while a thread (``write_behind``) copies one
group's buffers (views of the mapped streams, and the group's rebased offsets) into the
files, this thread encodes the next and checksums the one handed over. Any other column
(nulls, bools, timestamps, dictionaries) is encoded whole and written first, as before.

Profile of the serial put this replaces (66 MiB folder, 2-core VM): 31 ms of
``write()``s after 4 ms of mapping and reading the streams and 6 ms of encoding
(offsets rebased per 1,000-row batch), one core busy, the other idle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._disk.array_parts import FileArray
from .._disk.checksum import crc32
from .._disk.npy import NpyHeader, build_header, parse_header_bytes
from .._disk.write_behind import WriteBehind
from .._disk.writer import VersionWriter
from ..errors import UnsupportedDataError
from .table_arrow import column_errors, encode_arrow_parts
from .table_chunks import ColumnStream, column_stream
from .table_encode import table_meta

__all__ = ["write_arrow_table"]

GROUP_BYTES = 8 << 20
"""About the bytes of one group of record batches: smaller groups start the copy sooner
but hand over more often (a thread wake-up and a file open per file per group)."""

FIRST_GROUP_BYTES = 1 << 20
"""The first group's: the copy waits for it alone."""
THREAD_BYTES = 4 << 20
"""Smaller tables are written by the calling thread alone (a 1 MiB folder's put: 5.3 ms
with the thread, 4.6 ms before it; the thread and its hand-overs cost more than they
overlap)."""
FILE_BYTES = 256 << 10
"""At least this much a file in a group (a group's bytes grow with the number of files):
each group opens every file once (``O_APPEND``; no descriptor is held between groups, so
a table of a thousand columns stays under the usual limit of open files)."""

Reserve = Callable[[int, int], None]
"""``reserve(nbytes, files)``: the entry's data bytes and file count, before any is written."""


def write_arrow_table(
    table: Any, what: str, writer: VersionWriter, version: str, reserve: Reserve
) -> tuple[dict[str, NpyHeader], dict[str, int], dict[str, Any]]:
    """Write ``table``'s files into ``version`` (not published); returns every file's
    header and CRC-32 (by part name, ``c0.values``) and the table's meta."""
    names = list(table.column_names)
    if len(set(names)) != len(names):
        raise UnsupportedDataError(f"{what}: the table has duplicate column names")
    streams: dict[int, ColumnStream] = {}
    whole: dict[str, FileArray] = {}
    descriptions = []
    for i, name in enumerate(names):
        with column_errors(what, name):
            column = table.column(i)
            stream = None if _is_dictionary(column.type) else column_stream(column)
        if stream is not None:
            streams[i] = stream
            descriptions.append(stream.desc)
            continue
        files, meta = encode_arrow_parts(table.select([i]), what)  # checks dictionaries first
        whole |= {f"c{i}{part.removeprefix('c0')}": array for part, array in files.items()}
        descriptions.append(meta["columns"][0] | {"name": name})
    planned = {f"c{i}.{part}": shape for i, s in streams.items() for part, shape in s.files.items()}
    nbytes = sum(int(a.nbytes) for a in whole.values()) + sum(s.nbytes for s in streams.values())
    reserve(nbytes, len(whole) + len(planned))
    headers: dict[str, NpyHeader] = {}
    crcs: dict[str, int] = {}
    for name, array in whole.items():
        crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
    if streams:
        _write_streams(table, what, streams, planned, nbytes, writer, version, headers, crcs)
    return headers, crcs, table_meta(names, descriptions, table.num_rows)


def _is_dictionary(kind: Any) -> bool:
    from pyarrow.types import is_dictionary

    return bool(is_dictionary(kind))


def _write_streams(
    table: Any,
    what: str,
    streams: dict[int, ColumnStream],
    planned: dict[str, tuple[np.dtype[Any], tuple[int, ...]]],
    nbytes: int,
    writer: VersionWriter,
    version: str,
    headers: dict[str, NpyHeader],
    crcs: dict[str, int],
) -> None:
    """The streamed columns' files: headers first, then each group's parts, in order."""
    paths, first = {}, {}
    for name, (dtype, shape) in planned.items():
        paths[name] = str(writer.path(version, f"{name}.npy"))
        header = build_header(dtype, shape, False)
        headers[name] = NpyHeader(*parse_header_bytes(header, len(header), paths[name]))
        crcs[name], first[name] = crc32(header), [header]
        os.close(writer.create_file(version, f"{name}.npy"))
    names = table.column_names
    with WriteBehind(threaded=nbytes >= THREAD_BYTES) as behind:
        for group in _groups(table, nbytes, len(planned) * FILE_BYTES):
            parts: dict[str, list[np.ndarray]] = {}
            for i, stream in streams.items():
                with column_errors(what, names[i]):
                    encoded = stream.encode([batch.column(i) for batch in group])
                parts |= {f"c{i}.{part}": arrays for part, arrays in encoded.items()}
            _hand_over(behind, paths, first, parts, crcs)
            first = {}
        ends: dict[str, list[np.ndarray]] = {}
        for i, stream in streams.items():
            with column_errors(what, names[i]):
                ends |= {f"c{i}.{part}": arrays for part, arrays in stream.close().items()}
        _hand_over(behind, paths, first, ends, crcs)
        behind.finish()


def _hand_over(
    behind: WriteBehind,
    paths: dict[str, str],
    first: dict[str, list[bytes]],
    parts: dict[str, list[np.ndarray]],
    crcs: dict[str, int],
) -> None:
    """Append ``parts`` (after ``first``: the headers, with the first group) to their
    files on the writer thread, then chain their CRC-32s here, meanwhile (reading the
    same pages as the copy, at the same time: checksumming a group before handing it
    over made the copies ~10% slower on 2 cores)."""
    data = {}
    for name in [*first, *(name for name in parts if name not in first)]:
        data[name] = [a.reshape(-1).view(np.uint8) for a in parts.get(name, []) if a.size]
    behind.append([(paths[name], [*first.get(name, []), *pieces]) for name, pieces in data.items()])
    for name, pieces in data.items():
        crc = crcs[name]
        for piece in pieces:
            crc = crc32(piece, crc)
        crcs[name] = crc


def _groups(table: Any, nbytes: int, least: int) -> Iterator[list[Any]]:
    """The table's non-empty record batches in runs of about :data:`GROUP_BYTES` (the
    first of about :data:`FIRST_GROUP_BYTES`: the copy starts sooner), or ``least``."""
    rows = max(1, table.num_rows * max(FIRST_GROUP_BYTES, least) // max(1, nbytes))
    group: list[Any] = []
    count = 0
    for batch in table.to_batches():
        if not batch.num_rows:
            continue
        group.append(batch)
        count += batch.num_rows
        if count >= rows:
            yield group
            group, count = [], 0
            rows = max(1, table.num_rows * max(GROUP_BYTES, least) // max(1, nbytes))
    if group:
        yield group
