"""A table file decoded one Parquet row group / Arrow record batch / CSV-JSON block at a
time into a version of a writer (``table_stream``), so the decoded table is never whole in
memory: the streaming core of local table files (``tables``, read in place) and of table
objects from URLs (``remote_tables``, read from their scratch file).

The file is read through a ``pyarrow.OSFile`` (``pread``, no mapping: touched pages of a
mapped tmpfs file count in RSS), the next batch decoded by a thread while this one is
written. The writer's reservation grows batch by batch, ahead of
what each encoded column chunk adds. A table whose later batches need another layout than
its first (a CSV column that turns from ints to floats after the first block, a column with
no value in the first block, a fixed-size list column that meets a null) raises
:class:`ChangedLayout`: the caller decodes it whole instead, correct but not flat.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._containers.table_arrow import (
    check_dictionaries,
    is_no_line_error,
    is_straddling_error,
    nullable_schema,
)
from .._containers.table_stream import ChangedLayout, TableAppender
from .._disk.array_parts import FileArray
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from .._units import human_bytes
from ..errors import (
    CacheFullError,
    CorruptSourceError,
    InvalidSourceError,
    NoRoomError,
    ShmCacheError,
    UnsupportedDataError,
)

__all__ = [
    "PAGE",
    "LoadedTable",
    "Reservation",
    "Reserve",
    "append_table_file",
    "finish_table",
    "has_pyarrow",
    "write_table_files",
]

PAGE = 4096  # what a file takes beyond its bytes (its header's page)
_SLACK = 64 << 20  # a reservation grows by at least this much (fewer space-lock rounds)
_GROUP = 8 << 20  # consecutive small batches are joined up to this many bytes, then written
_JSON_BLOCK = 16 << 20  # a JSON lines stream's block: its longest line must fit in one

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


class Reservation:
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

    def hope(self, nbytes: int, floor: int | None = None) -> None:
        """Reserve ``nbytes`` (an estimate) if it fits without evicting anything; else grow
        batch by batch, evicting for what is written only. ``floor``: what the table needs
        at least; where evicting could not make room even for that, raise NoRoomError now,
        before a batch is written or an entry evicted for it."""
        if nbytes <= self.reserved:
            return
        try:
            self._reserve(nbytes, False)
            self.reserved = nbytes
            return
        except NoRoomError:
            if floor is None or floor <= self.reserved:
                return
        except CacheFullError:  # it may fit by evicting: as it is written
            return
        try:
            self._reserve(floor, False)
            self.reserved = floor
        except NoRoomError:
            raise
        except CacheFullError:
            pass


def append_table_file(
    source: Any,
    what: str,
    suffix: str,
    writer: VersionWriter,
    version: str,
    appender: TableAppender | None,
    reservation: Reservation,
    *,
    table: str | None = None,
    held: int = 0,
    size: int = 0,
    progress: Callable[[int], None] | None = None,
) -> TableAppender:
    """Append the batches of the table file ``source`` (a ``pyarrow.OSFile``; ``what`` names
    it in errors) to ``appender``, a new one (writing into ``version``) for the first file.
    ``table`` names the whole table of several files (a schema that differs from the
    first's is refused); ``held``: bytes the writer holds besides the table's files (a
    scratch file); ``size``: the file's size (an estimate of the table's, but Parquet's);
    ``progress(done)``: after each batch written, the bytes of the file read so far (below
    ``size``; it may raise to cancel: the caller discards the version)."""
    import pyarrow as pa

    def create(name: str) -> tuple[int, str]:
        return writer.create_file(version, f"{name}.npy"), str(writer.path(version, f"{name}.npy"))

    with _arrow_errors(pa, what, suffix):
        schema, batches, estimate = _batches(pa, source, suffix)
    if suffix in (".csv", ".jsonl") and _has_null_type(pa, schema):
        # a column with no value in the first block: the whole file's read types it
        raise ChangedLayout(f"{what}: {schema} from the first block has null-typed columns")
    if appender is None:
        appender = TableAppender(schema, create, table or what)
    elif not nullable_schema(schema).equals(nullable_schema(appender.schema)):  # nullable: not recorded
        if suffix in (".csv", ".jsonl"):  # types from a first block: the whole files' may agree
            raise ChangedLayout(f"{what}: {schema} after {appender.schema}")
        raise InvalidSourceError(
            f"{table}: its table objects do not share one schema ({what} has {schema}, the "
            f"first {appender.schema}); load each by its own URL"
        )
    added = appender

    asked = 0

    def before_write(nbytes: int) -> None:  # a column chunk's encoded bytes, about to be written
        nonlocal asked
        asked = added.nbytes + PAGE * (added.file_count + 1) + held + nbytes
        reservation.need(asked)

    written = added.nbytes + PAGE * (added.file_count + 1) + held
    start = added.nbytes
    sequential = suffix in (".csv", ".jsonl") or (estimate is None and not _has_footer(source))

    def read_so_far() -> int:
        """Where the reads are sequential (CSV, JSON, an IPC stream), the file's position
        (the decode thread's, a group ahead); else estimated from the bytes written."""
        if sequential:
            return int(source.tell())
        return (added.nbytes - start) * size // max(estimate if estimate is not None else size, 1)

    reading = _read(pa, batches, what, suffix)
    try:
        # A Parquet's row groups' uncompressed size is about its table's, and rarely twice
        # it (INT96 timestamps: 12 bytes a value there, 8 here); an Arrow file's size is not
        # (batches of a few rows carry more metadata than data), nor a CSV's. Where not even
        # half of it could be made room for, refuse before evicting anything.
        ahead = estimate if estimate is not None else size
        floor = written + estimate // 2 if estimate is not None else None
        reservation.hope(written + ahead, floor=floor)
        for batch in reading:
            added.add(batch, before_write)  # (its own errors are not the file's: not mapped)
            if progress is not None and size:
                progress(min(read_so_far(), size - 1))
    except CacheFullError as exc:  # it names what the batches so far needed: say the whole's
        if not size:
            raise
        if estimate is not None and asked <= written + estimate:  # Parquet: its row groups' sizes
            whole = f"about {human_bytes(estimate)} (its row groups' uncompressed size)"
        else:  # (or more than the estimate: dictionary-encoded strings; an IPC file's size is
            # none: compressed, or of one-row batches, it is far from its table's)
            whole = f"more than {human_bytes(asked)} (the part read so far; the rest is not known yet)"
        raise type(exc)(f"{what}: its table needs {whole}; {exc}") from None  # NoRoomError stays one
    finally:
        reading.close()  # no decode under way once the caller closes the file
    return appender


def finish_table(
    appender: TableAppender, reservation: Reservation
) -> tuple[dict[str, NpyHeader], dict[str, int], dict[str, Any]]:
    """The appended table's headers written (its files' final size reserved): their
    headers, CRC-32s and the table's metadata."""
    headers, crcs, meta = appender.finish()
    reservation.need(appender.nbytes + PAGE * (appender.file_count + 1))
    return headers, crcs, meta


def write_table_files(
    writer: VersionWriter,
    version: str,
    files: Mapping[str, FileArray],
    reservation: Reservation,
    held: int = 0,
) -> tuple[dict[str, NpyHeader], dict[str, int]]:
    """A table decoded whole: its size reserved (beside ``held`` bytes the writer holds
    already), its files written into ``version``; their headers and CRC-32s."""
    reservation.need(held + sum(int(a.nbytes) for a in files.values()) + PAGE * (len(files) + 1))
    headers, crcs = {}, {}
    for name, array in files.items():
        crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
    return headers, crcs


def has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _has_footer(source: Any) -> bool:
    """Whether an Arrow file is an IPC file (read at its batches' offsets), not a stream."""
    position = source.tell()
    try:
        source.seek(0)
        return bytes(source.read(6)) == b"ARROW1"
    finally:
        source.seek(position)


def _has_null_type(pa: Any, schema: Any) -> bool:
    """Whether a field (or a field nested in one: a list of nulls) is of Arrow type null."""
    pending = [f.type for f in schema]
    while pending:
        kind = pending.pop()
        if pa.types.is_null(kind):
            return True
        pending.extend(kind.field(i).type for i in range(kind.num_fields))
    return False


def _read(pa: Any, batches: Iterator[Any], what: str, suffix: str) -> Generator[Any, None, None]:
    """``batches`` joined into groups (:func:`_grouped`), each read with pyarrow's errors
    typed (a corrupt row group, a bad block), the next one decoded by a thread while the
    caller writes this one: decoding and writing overlap (a 459 MiB Parquet put: 1.9 s ->
    1.5 s, one group more in memory: +12 MiB). A plain daemon thread, asked for one group at
    a time (never two ahead): ``concurrent.futures`` refuses work once the main thread has
    exited, and a put may run in a thread that outlives it. Its error is raised here; closing
    this generator (or running it out) waits for the thread, so close it before the file."""
    requests: queue.SimpleQueue[bool] = queue.SimpleQueue()
    results: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()

    def decode() -> None:
        grouped = _grouped(pa, (check_dictionaries(batch, what) for batch in batches))  # before a join
        while requests.get():
            try:
                with _arrow_errors(pa, what, suffix):
                    results.put((next(grouped, None), None))
            except BaseException as exc:  # raised in the caller
                results.put((None, exc))
                return

    thread = threading.Thread(target=decode, name="shmcache-table", daemon=True)
    thread.start()
    try:
        requests.put(True)
        while True:
            batch, error = results.get()
            if error is not None:
                raise error
            if batch is None:
                return
            requests.put(True)
            yield batch
    finally:
        requests.put(False)
        thread.join()  # (a decode under way finishes first: one group's time)


def _grouped(pa: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """Consecutive small batches joined into one table of ~:data:`_GROUP` bytes (at most a
    quarter more): the per-batch cost of writing (an encode, an open/write/close per column
    file) is paid per group, not per small batch (a stream of 1000-row batches, a Parquet of
    50-row groups: 3-5x slower unjoined). A batch of a quarter of that or more passes as is,
    never held back (nor copied) waiting for the next: memory as unjoined."""
    group: list[Any] = []
    size = 0
    for batch in batches:
        nbytes = int(batch.nbytes)
        if nbytes >= _GROUP // 4:
            if group:
                yield _joined(pa, group)
                group, size = [], 0
            yield batch
            continue
        group.append(batch)
        size += nbytes
        if size >= _GROUP:
            yield _joined(pa, group)
            group, size = [], 0
    if group:
        yield _joined(pa, group)


def _joined(pa: Any, group: list[Any]) -> Any:
    if len(group) == 1:
        return group[0]
    tables = [b if isinstance(b, pa.Table) else pa.Table.from_batches([b]) for b in group]
    return pa.concat_tables(tables).combine_chunks()


def _batches(pa: Any, source: Any, suffix: str) -> tuple[Any, Iterator[Any], int | None]:
    """The schema and the batches of a table file (``source``, a ``pyarrow.OSFile``), read
    one batch at a time, and (Parquet) about the bytes they make: the row groups'
    uncompressed sizes."""
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        # One thread: decoding a row group's columns in parallel held ~8 row groups' worth
        # in RSS (pyarrow's pool peaked at 3, the allocator kept the rest), one thread ~4;
        # and it was no slower on 2 busy cores. (iter_batches read far ahead: ~the table.)
        parquet = pq.ParquetFile(source)
        sizes = [int(parquet.metadata.row_group(i).total_byte_size) for i in range(parquet.num_row_groups)]
        return parquet.schema_arrow, _row_groups(pq, source, parquet, sizes), sum(sizes)
    if suffix in (".feather", ".arrow"):
        if source.read(4) == b"FEA1":  # Feather V1: columns, no record batches to stream
            raise ChangedLayout("a Feather V1 file")
        source.seek(0)
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:  # an Arrow IPC stream rather than a file
            source.seek(0)
            stream = pa.ipc.open_stream(source)
            return stream.schema, iter(stream), None
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches)), None
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        reader = _opened(pa, pcsv.open_csv, source)
        return reader.schema, _streamed(pa, reader), None
    import pyarrow.json as pjson

    if not hasattr(pjson, "open_json"):  # pyarrow < 20: no streaming JSON reader
        raise ChangedLayout("this pyarrow has no pyarrow.json.open_json")
    # Blocks of 16 MiB, not pyarrow's 1 MiB: language-model corpora have documents (lines)
    # of several MiB, and a line longer than a block fails ("straddling object").
    reader = _opened(pa, pjson.open_json, source, pjson.ReadOptions(block_size=_JSON_BLOCK))
    return reader.schema, _streamed(pa, reader), None


def _opened(pa: Any, open_reader: Callable[..., Any], source: Any, options: Any = None) -> Any:
    """A CSV/JSON stream reader (it reads its first block); a row longer than the block
    asks for the whole read (its blocks as large as the file)."""
    try:
        return open_reader(source) if options is None else open_reader(source, read_options=options)
    except pa.ArrowInvalid as exc:
        if is_straddling_error(exc) or is_no_line_error(exc):  # (no line at all: read whole)
            raise ChangedLayout(str(exc)) from None
        raise


def _row_groups(pq: Any, source: Any, parquet: Any, sizes: list[int]) -> Iterator[Any]:
    """A Parquet file's row groups: each read whole where it is small (one call for its
    pages), in batches of ~:data:`_GROUP` bytes through a 1 MiB read buffer where it is
    bigger than 4 of them (a 244 MiB row group read whole grew the put by ~580 MiB: its
    column chunks' bytes and their decode at once; in batches, ~50 MiB)."""
    buffered = None
    for index, size in enumerate(sizes):
        if size <= 4 * _GROUP:
            yield parquet.read_row_group(index, use_threads=False)
            continue
        if buffered is None:
            buffered = pq.ParquetFile(source, buffer_size=1 << 20, pre_buffer=False)
        rows = int(parquet.metadata.row_group(index).num_rows)
        batch_rows = max(1024, rows * _GROUP // size)
        yield from buffered.iter_batches(batch_size=batch_rows, row_groups=[index], use_threads=False)


def _streamed(pa: Any, reader: Any) -> Iterator[Any]:
    """A CSV/JSON reader's blocks; a block its first block's types do not fit (the whole
    file's inference would have widened them) asks for the whole read instead. A CSV row
    that does not parse (a column too many, an unterminated quote) fails the whole read
    alike: it is corrupt now, not after decoding the whole file to find that out."""
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            if str(exc).startswith("CSV parse error") and not is_straddling_error(exc):
                raise
            raise ChangedLayout(str(exc)) from None  # (a row longer than a block: read whole)
        yield batch


@contextmanager
def _arrow_errors(pa: Any, what: str, suffix: str) -> Iterator[None]:
    """pyarrow's errors as ``table_arrow.read_arrow_table`` types them."""
    try:
        yield
    except (ShmCacheError, ChangedLayout):
        raise
    except (pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise UnsupportedDataError(f"{what}: {exc}") from None
    except (pa.ArrowInvalid, pa.ArrowIndexError, pa.ArrowKeyError, OSError, EOFError) as exc:
        # (IndexError: a damaged file's lengths, met slicing or joining its batches)
        raise CorruptSourceError(f"{what} is not a readable {suffix[1:]} file: {exc}") from None
