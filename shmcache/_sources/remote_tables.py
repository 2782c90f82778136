"""Table objects from URLs (``.parquet``, ``.feather``/``.arrow``, ``.csv``, ``.jsonl``;
one object, or a prefix of them: one table) loaded with flat memory: neither the object's
bytes nor the decoded table is ever whole in the process.

Each object is streamed into a scratch file under the root's ``tmp/`` (a version of the
load's own writer: removed with it on success, failure or cancel, and by ``cleanup`` if
the process is killed), by ONE GET (what ``s3fs get`` does with one connection; a store
like moto copies the whole object for every ranged GET) or, with ``part_size``, parallel
ranged reads written at their offsets. pyarrow then reads that file with ``pread`` (no
mapping: touched pages of a mapped tmpfs file count in RSS) one Parquet row group, Arrow
record batch or CSV/JSON block at a time, and each batch is appended to the entry's column
files (``table_stream``) before the next is read. The scratch file goes before the
entry is published; while it exists its bytes count against the budget with the files
written (the reservation grows batch by batch).

Checks as for every remote object: the bytes that arrived are the size listed, size and
ETag are looked up again after the load (a change fails it: nothing published), errors
are typed and scrubbed of secrets. A table whose later batches need another layout than
its first (a CSV column that turns from ints to floats after the first block, a
fixed-size list column that meets a null) is decoded whole instead, as before this
module: correct, but not flat.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._containers.table_arrow import read_table_file
from .._containers.table_stream import ChangedLayout, TableAppender
from .._disk.fs import full_is_cache_full
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from ..errors import (
    CacheFullError,
    CorruptSourceError,
    InvalidSourceError,
    ShmCacheError,
    UnsupportedDataError,
)
from .remote import DEFAULT_WORKERS, RemoteItem, RemotePlan, check_objects_unchanged
from .remote_parts import pwrite_all, read_range, remote_errors

__all__ = ["LoadedTable", "load_remote_table"]

_PAGE = 4096
_SLACK = 64 << 20  # a reservation grows by at least this much (fewer space-lock rounds)

Reserve = Callable[[int, bool], None]
"""``reserve(nbytes, evict)``: record (and check against the budget and free space) what the
writer will hold at most; ``evict=False``: raise CacheFullError rather than evict for it."""


@dataclass
class LoadedTable:
    """A table entry written into ``version`` of the writer, not published yet."""

    version: str
    headers: dict[str, NpyHeader]
    crcs: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)


class _Reservation:
    """The writer's reservation, grown ahead of what is about to be written: by slack where
    that fits without evicting anything, else by exactly what is needed (evicting for it)."""

    def __init__(self, reserve: Reserve) -> None:
        self._reserve = reserve
        self.reserved = 0

    def need(self, nbytes: int) -> None:
        if nbytes <= self.reserved:
            return
        ahead = nbytes + min(_SLACK, nbytes // 2)
        try:
            self._reserve(ahead, False)  # the slack saves space-lock rounds, never an entry
            self.reserved = ahead
        except CacheFullError:
            self._reserve(nbytes, True)
            self.reserved = nbytes

    def hope(self, nbytes: int) -> None:
        """Reserve ``nbytes`` (an estimate) if it fits without evicting anything; else grow
        batch by batch, evicting for what is written only."""
        if nbytes <= self.reserved:
            return
        try:
            self._reserve(nbytes, False)
            self.reserved = nbytes
        except CacheFullError:
            pass


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
    reservation = _Reservation(reserve)
    scratch = writer.new_version()
    version = writer.new_version()
    appender: TableAppender | None = None
    whole = not _has_pyarrow()  # JSON lines without pyarrow: read whole by the standard library
    for item in plan.items:
        held = appender.nbytes + _PAGE * appender.file_count if appender is not None else 0
        reservation.need(held + item.size + 2 * _PAGE)
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
        headers, crcs, meta = appender.finish()
        reservation.need(appender.nbytes + _PAGE * (appender.file_count + 1))
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
    reservation: _Reservation,
) -> TableAppender:
    """Append the scratch file's batches to ``appender`` (a new one for the first object)."""
    import pyarrow as pa

    def create(name: str) -> tuple[int, str]:
        return writer.create_file(version, f"{name}.npy"), str(writer.path(version, f"{name}.npy"))

    with pa.OSFile(path) as source:
        with _arrow_errors(pa, item.url, item.suffix):
            schema, batches, estimate = _batches(pa, source, item.suffix)
        if item.suffix in (".csv", ".jsonl") and _has_null_type(pa, schema):
            # a column with no value in the first block: the whole file's read types it
            raise ChangedLayout(f"{item.url}: {schema} from the first block has null-typed columns")
        if appender is None:
            appender = TableAppender(schema, create, str(plan.url))
        elif not schema.remove_metadata().equals(appender.schema.remove_metadata()):
            if item.suffix in (".csv", ".jsonl"):  # types from a first block: the whole files' may agree
                raise ChangedLayout(f"{item.url}: {schema} after {appender.schema}")
            raise InvalidSourceError(
                f"{plan.url}: its table objects do not share one schema ({item.url} has {schema}, the "
                f"first {appender.schema}); load each by its own URL"
            )
        added = appender

        def before_write(nbytes: int) -> None:  # a column chunk's encoded bytes, about to be written
            reservation.need(added.nbytes + _PAGE * (added.file_count + 1) + item.size + nbytes)

        held = added.nbytes + _PAGE * (added.file_count + 1) + item.size
        reservation.hope(held + (estimate if estimate is not None else item.size))
        for batch in _read(pa, batches, item.url, item.suffix):
            added.add(batch, before_write)  # (its own errors are not the object's: not mapped)
    return appender


def _has_null_type(pa: Any, schema: Any) -> bool:
    """Whether a field (or a field nested in one: a list of nulls) is of Arrow type null."""
    pending = [f.type for f in schema]
    while pending:
        kind = pending.pop()
        if pa.types.is_null(kind):
            return True
        pending.extend(kind.field(i).type for i in range(kind.num_fields))
    return False


def _read(pa: Any, batches: Iterator[Any], url: str, suffix: str) -> Iterator[Any]:
    """``batches``, each read with pyarrow's errors typed (a corrupt row group, a bad block)."""
    while True:
        with _arrow_errors(pa, url, suffix):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def _batches(pa: Any, source: Any, suffix: str) -> tuple[Any, Iterator[Any], int | None]:
    """The schema and the batches of a local table file (``source``, a ``pyarrow.OSFile``:
    ``pread``, no mapping), read one batch at a time, and (Parquet) about the bytes they
    make: the row groups' uncompressed sizes."""
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        # One thread: decoding a row group's columns in parallel held ~8 row groups' worth
        # in RSS (pyarrow's pool peaked at 3, the allocator kept the rest), one thread ~4;
        # and it was no slower on 2 busy cores. (iter_batches read far ahead: ~the table.)
        parquet = pq.ParquetFile(source)
        groups = range(parquet.num_row_groups)
        estimate = sum(int(parquet.metadata.row_group(i).total_byte_size) for i in groups)
        return parquet.schema_arrow, (parquet.read_row_group(i, use_threads=False) for i in groups), estimate
    if suffix in (".feather", ".arrow"):
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:  # an Arrow IPC stream rather than a file (Feather v1: raises here)
            source.seek(0)
            stream = pa.ipc.open_stream(source)
            return stream.schema, iter(stream), None
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches)), None
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        reader = pcsv.open_csv(source)
        return reader.schema, _streamed(pa, reader), None
    import pyarrow.json as pjson

    reader = pjson.open_json(source)
    return reader.schema, _streamed(pa, reader), None


def _streamed(pa: Any, reader: Any) -> Iterator[Any]:
    """A CSV/JSON reader's blocks; a block its first block's types do not fit (the whole
    file's inference would have widened them) asks for the whole read instead."""
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            raise ChangedLayout(str(exc)) from None
        yield batch


@contextmanager
def _arrow_errors(pa: Any, url: str, suffix: str) -> Iterator[None]:
    """pyarrow's errors as ``table_arrow.read_arrow_table`` types them."""
    try:
        yield
    except (ShmCacheError, ChangedLayout):
        raise
    except (pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise UnsupportedDataError(f"{url}: {exc}") from None
    except (pa.ArrowInvalid, OSError, EOFError) as exc:
        raise CorruptSourceError(f"{url} is not a readable {suffix[1:]} file: {exc}") from None


def _write_whole(
    plan: RemotePlan,
    writer: VersionWriter,
    scratch: str,
    version: str,
    reservation: _Reservation,
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
    reservation.need(scratch_bytes + sum(int(a.nbytes) for a in files.values()) + _PAGE * (len(files) + 1))
    headers, crcs = {}, {}
    for name, array in files.items():
        crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
    return headers, crcs, meta


def _files(writer: VersionWriter, version: str) -> list[str]:
    directory = writer.path(version, "")
    return [os.path.join(directory, name) for name in os.listdir(directory)]


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _source_file(path: str) -> Any:
    """The scratch file for a whole read: pyarrow's ``pread`` file, or a Python file."""
    try:
        import pyarrow as pa
    except ImportError:
        return open(path, "rb")
    return pa.OSFile(path)
