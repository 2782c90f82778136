"""``put_file`` of a table file (``.parquet``, ``.feather``/``.arrow``, ``.csv``, ``.jsonl``):
one table entry. The file is opened once through ``source_files`` (regular file,
beneath the allowed directories without following links), read from that descriptor, and
checked unchanged after the read, like every other source."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._containers.table_arrow import TABLE_SUFFIXES, read_table_file, require_pyarrow
from .._disk.array_parts import FileArray
from ..errors import CorruptSourceError, SourceNotFoundError
from .planned import PlannedEntry
from .source_files import SourceFile, check_unchanged, open_checked

__all__ = ["is_table_file", "plan_table_file", "read_table_source"]


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
