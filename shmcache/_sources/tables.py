"""``put_file`` of a table file (``.parquet``, ``.feather``/``.arrow``, ``.csv``, ``.jsonl``):
one table entry. The file is opened once through ``source_files`` (regular file,
beneath the allowed directories without following links), read from that descriptor, and
checked unchanged after the read, like every other source.

:func:`load_table_source` (``put_file``, ``put_table`` of a path) reads it in place one row
group / record batch / block at a time into the writer's version (``table_batches``: flat
memory); a table it cannot stream (types that change between CSV/JSON blocks, JSON lines
without pyarrow) is decoded whole, as :func:`read_table_source` does."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._containers.table_arrow import TABLE_SUFFIXES, read_table_file, require_pyarrow
from .._containers.table_stream import ChangedLayout
from .._disk.array_parts import FileArray
from .._disk.writer import VersionWriter
from ..errors import CorruptSourceError, SourceNotFoundError
from .planned import PlannedEntry
from .source_files import SourceFile, check_unchanged, open_checked
from .table_batches import (
    LoadedTable,
    Reservation,
    Reserve,
    append_table_file,
    finish_table,
    has_pyarrow,
    write_table_files,
)

__all__ = ["is_table_file", "load_table_source", "plan_table_file", "read_table_source"]


def is_table_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``put_file`` publishes ``path`` as one table entry (by its suffix)."""
    return Path(path).suffix.lower() in TABLE_SUFFIXES


def _open(path: Path, allowed: Sequence[str | os.PathLike[str]]) -> tuple[int, SourceFile]:
    if path.is_dir():
        raise CorruptSourceError(f"{path} is a directory, not a table file")
    if not os.path.lexists(path):
        raise SourceNotFoundError(f"source {path} does not exist")
    return open_checked(str(path), tuple(os.path.realpath(top) for top in allowed))


def plan_table_file(key: str, path: Path, allowed: Sequence[str | os.PathLike[str]] = ()) -> PlannedEntry:
    """Check a table file without loading it: readable, allowed, and (Parquet) its footer;
    the size estimate is the file's size."""
    path = Path(os.path.abspath(path))
    suffix = path.suffix.lower()
    if suffix != ".jsonl":
        require_pyarrow(f"table file {path}")
    fd, source = _open(path, allowed)
    with open(fd, "rb") as fp:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                pq.ParquetFile(fp)
            except Exception as exc:  # pyarrow's errors for a bad footer vary by version
                raise CorruptSourceError(f"{path} is not a readable parquet file: {exc}") from None
    return PlannedEntry(key, str(path), str(path), source.size)


def read_table_source(
    path: Path, allowed: Sequence[str | os.PathLike[str]] = ()
) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """The table entry's files and meta from a table file (with ``source`` and its
    fingerprint in the meta); a file changed while it was read raises."""
    path = Path(os.path.abspath(path))
    fd, source = _open(path, allowed)
    with open(fd, "rb") as fp:
        files, meta = read_table_file(fp, str(path), path.suffix.lower())
        check_unchanged(fp.fileno(), source)
    return files, meta | {"source": str(path), "source_fingerprint": source.fingerprint}


def load_table_source(
    path: Path,
    writer: VersionWriter,
    reserve: Reserve,
    allowed: Sequence[str | os.PathLike[str]] = (),
    progress: Callable[[int, int], None] | None = None,
) -> LoadedTable:
    """The table entry of a table file written into a new version of ``writer`` (not
    published), read in place batch by batch; ``reserve`` records what the writer will hold
    (``table_batches.Reserve``). A file changed while it was read raises
    :class:`CorruptSourceError` (the version is the writer's to discard). ``progress(done,
    size)``: the file's bytes read, after each streamed batch (it may raise to cancel)."""
    path = Path(os.path.abspath(path))
    suffix = path.suffix.lower()
    fd, source = _open(path, allowed)
    with open(fd, "rb") as fp:
        try:
            loaded = _load(fp, source, str(path), suffix, writer, Reservation(reserve), progress)
        except Exception:
            check_unchanged(fp.fileno(), source)  # a change explains the error: say so instead
            raise
        check_unchanged(fp.fileno(), source)
    loaded.extra |= {"source": str(path), "source_fingerprint": source.fingerprint}
    return loaded


def _load(
    fp: Any,
    source: SourceFile,
    name: str,
    suffix: str,
    writer: VersionWriter,
    reservation: Reservation,
    progress: Callable[[int, int], None] | None,
) -> LoadedTable:
    """Streamed where pyarrow can (see :func:`load_table_source`), else decoded whole."""
    if has_pyarrow():
        version = writer.new_version()
        try:
            with _pread(fp) as file:
                done = None if progress is None else (lambda n: progress(n, source.size))
                appender = append_table_file(
                    file, name, suffix, writer, version, None, reservation, size=source.size, progress=done
                )
        except ChangedLayout:
            writer.discard(version)
        else:
            return LoadedTable(version, *finish_table(appender, reservation))
        fp.seek(0)
    files, meta = read_table_file(fp, name, suffix)
    version = writer.new_version()
    headers, crcs = write_table_files(writer, version, files, reservation)
    return LoadedTable(version, headers, crcs, meta)


def _pread(fp: Any) -> Any:
    """The checked descriptor's file as a ``pyarrow.OSFile`` (``pread``, no Python between):
    reopened through ``/proc/self/fd``, the very file opened (no path walked again); a
    Python file over the descriptor where there is no ``/proc``."""
    import pyarrow as pa

    try:
        return pa.OSFile(f"/proc/self/fd/{fp.fileno()}")
    except OSError:  # a duplicate: closing the pyarrow file leaves ``fp`` open
        return pa.PythonFile(os.fdopen(os.dup(fp.fileno()), "rb"), mode="r")
