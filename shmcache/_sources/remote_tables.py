"""Table objects from URLs (``.parquet``, ``.feather``/``.arrow``, ``.csv``, ``.jsonl``;
one object, or a prefix of them: one table) loaded with flat memory: neither the object's
bytes nor the decoded table is ever whole in the process.

Each object is streamed into a scratch file under the root's ``tmp/`` (a version of the
load's own writer: removed with it on success, failure or cancel, and by ``cleanup`` if
the process is killed), by ONE GET (what ``s3fs get`` does with one connection; a store
like moto copies the whole object for every ranged GET) or, with ``part_size``, parallel
ranged reads written at their offsets. That file is then decoded as a local table file is
(``table_batches``: read with ``pread`` one Parquet row group, Arrow record batch or CSV/JSON
block at a time, each batch appended to the entry's column files before the next is read).
The scratch file goes before the entry is published; while it exists its bytes count
against the budget with the files written (the reservation grows batch by batch).

Checks as for every remote object: the bytes that arrived are the size listed, size and
ETag are looked up again after the load (a change fails it: nothing published), errors
are typed and scrubbed of secrets. A table whose later batches need another layout than
its first (a CSV column that turns from ints to floats after the first block, a
fixed-size list column that meets a null) is decoded whole instead, as before this
module: correct, but not flat.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._containers.table_arrow import read_table_file
from .._containers.table_stream import ChangedLayout, TableAppender
from .._disk.fs import full_is_cache_full
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from ..errors import CorruptSourceError
from .remote import DEFAULT_WORKERS, RemoteItem, RemotePlan, check_objects_unchanged
from .remote_parts import pwrite_all, read_range, remote_errors
from .table_batches import (
    PAGE,
    LoadedTable,
    Reservation,
    Reserve,
    append_table_file,
    finish_table,
    has_pyarrow,
    write_table_files,
)

__all__ = ["LoadedTable", "load_remote_table"]


def load_remote_table(
    plan: RemotePlan,
    writer: VersionWriter,
    reserve: Reserve,
    advance: Callable[[int], None],
    part_size: int | None = None,
) -> LoadedTable:
    """Write a table plan's objects (several: their rows in name order, one schema) as one
    table entry into a new version of ``writer``; ``reserve`` records (and checks against the
    budget) what the writer will hold at most (see :data:`Reserve`); ``advance`` reports each
    object's bytes once fetched. Raises if an object changed meanwhile."""
    reservation = Reservation(reserve)
    scratch = writer.new_version()
    version = writer.new_version()
    appender: TableAppender | None = None
    whole = not has_pyarrow()  # JSON lines without pyarrow: read whole by the standard library
    for item in plan.items:
        held = appender.nbytes + PAGE * appender.file_count if appender is not None else 0
        reservation.need(held + item.size + 2 * PAGE)
        path = str(writer.path(scratch, f"object{item.suffix}"))
        _fetch(plan, item, writer, scratch, path, part_size)
        advance(item.size)
        if whole:
            break
        try:
            appender = _decode(plan, item, path, writer, version, appender, reservation)
        except ChangedLayout:
            whole = True
            break
        os.unlink(path)
    if not whole:
        assert appender is not None
        headers, crcs, meta = finish_table(appender, reservation)
    if whole:  # decoded whole, as before this module (the scratch file still there, if one object)
        writer.discard(version)
        version = writer.new_version()
        headers, crcs, meta = _write_whole(plan, writer, scratch, version, reservation, part_size)
    writer.discard(scratch)
    check_objects_unchanged(plan, plan.items)
    extra = meta | {"source": plan.url, "source_fingerprint": {"size": plan.object_bytes}}
    extra["source_identity"] = plan.items[0].identity if len(plan.items) == 1 else ""
    return LoadedTable(version, headers, crcs, extra)


# ---------------------------------------------------------------------- fetching


def _fetch(
    plan: RemotePlan, item: RemoteItem, writer: VersionWriter, scratch: str, path: str, part_size: int | None
) -> None:
    """The object's bytes into the scratch file ``path``: one GET streamed (one connection),
    or parallel ranged reads of ``part_size`` written at their offsets; the bytes that
    arrived must be the size listed."""
    os.close(writer.create_file(scratch, os.path.basename(path)))
    with remote_errors(item.url, plan.secrets), full_is_cache_full(path):
        if part_size is not None and 0 < part_size < item.size:
            _fetch_parts(plan, item, path, part_size)
        elif item.size:
            plan.fs.get_file(item.path, path, **_one_stream(plan.fs))
    size = os.stat(path).st_size
    if size != item.size:
        raise CorruptSourceError(
            f"{item.url}: its {item.size} bytes came back as {size} (it was truncated or changed "
            "while loading); nothing was published, load it again"
        )


def _one_stream(fs: Any) -> dict[str, Any]:
    """``get_file``'s options for one GET of the whole object: s3fs splits an object larger
    than its block size into concurrent ranged GETs unless told not to."""
    import inspect

    method = getattr(fs, "_get_file", None) or fs.get_file
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return {}
    return {"max_concurrency": 1} if "max_concurrency" in parameters else {}


def _fetch_parts(plan: RemotePlan, item: RemoteItem, path: str, part_size: int) -> None:
    """Parallel ranged reads of ``part_size``, each written at its offset (at most
    ``DEFAULT_WORKERS`` parts in memory at once)."""
    from pathlib import Path

    target = Path(path)

    def fetch(start: int) -> None:
        end = min(start + part_size, item.size)
        pwrite_all(target, read_range(plan.fs, item, start, end, plan.secrets), start)

    starts = range(0, item.size, part_size)
    with ThreadPoolExecutor(min(DEFAULT_WORKERS, len(starts)), thread_name_prefix="shmcache-table") as pool:
        list(pool.map(fetch, starts))


# ---------------------------------------------------------------------- decoding


def _decode(
    plan: RemotePlan,
    item: RemoteItem,
    path: str,
    writer: VersionWriter,
    version: str,
    appender: TableAppender | None,
    reservation: Reservation,
) -> TableAppender:
    """Append the scratch file's batches to ``appender`` (a new one for the first object);
    the scratch file counts with the table until it goes."""
    import pyarrow as pa

    with pa.OSFile(path) as source:
        return append_table_file(
            source,
            item.url,
            item.suffix,
            writer,
            version,
            appender,
            reservation,
            table=str(plan.url),
            held=item.size,
            size=item.size,
        )


def _write_whole(
    plan: RemotePlan,
    writer: VersionWriter,
    scratch: str,
    version: str,
    reservation: Reservation,
    part_size: int | None,
) -> tuple[dict[str, NpyHeader], dict[str, int], dict[str, Any]]:
    """The table decoded whole in memory and written (one object: from its scratch file;
    several: read again, as before this module)."""
    if len(plan.items) == 1:
        item = plan.items[0]
        path = str(writer.path(scratch, f"object{item.suffix}"))
        with _source_file(path) as fp, remote_errors(item.url, plan.secrets):
            files, meta = read_table_file(fp, item.url, item.suffix)
    else:
        from .remote_files import read_remote_table

        files, meta = read_remote_table(plan, part_size)
        meta = {k: v for k, v in meta.items() if not k.startswith("source")}
    scratch_bytes = sum(os.stat(p).st_size for p in _files(writer, scratch))
    headers, crcs = write_table_files(writer, version, files, reservation, held=scratch_bytes)
    return headers, crcs, meta


def _files(writer: VersionWriter, version: str) -> list[str]:
    directory = writer.path(version, "")
    return [os.path.join(directory, name) for name in os.listdir(directory)]


def _source_file(path: str) -> Any:
    """The scratch file for a whole read: pyarrow's ``pread`` file, or a Python file."""
    try:
        import pyarrow as pa
    except ImportError:
        return open(path, "rb")
    return pa.OSFile(path)
