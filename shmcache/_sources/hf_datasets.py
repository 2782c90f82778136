"""Hugging Face ``datasets`` folders (``Dataset.save_to_disk``) as table entries.

A ``Dataset`` folder holds ``data-0000x-of-0000N.arrow`` (Arrow IPC *streams*), named in
``state.json``'s ``_data_files``, beside ``dataset_info.json``; a ``DatasetDict`` folder holds
``dataset_dict.json`` (its ``splits``) and one such folder per split, which becomes
``key/<split>`` (one group). Each data file is opened once through ``source_files``
(beneath the allowed directories, never following links), mapped read-only and read by
pyarrow's stream reader straight from the mapping (no Python object per row, no copy
of the file in memory beside the page cache), concatenated, encoded as any Arrow table
(columns outside shmcache's table support refused naming the column), and checked
unchanged after the read. The ``datasets`` package is not needed; pyarrow is.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._containers.table_arrow import encode_arrow_parts, require_pyarrow
from .._disk.array_parts import FileArray, joined
from .._disk.fs import pread_exactly
from .._disk.keys import validate_key
from ..errors import (
    CorruptSourceError,
    InvalidKeyError,
    InvalidSourceError,
    SourceNotFoundError,
    UnsupportedDataError,
)
from .blobs import tree_fingerprint
from .planned import PlannedEntry
from .source_files import SourceFile, check_unchanged, open_checked

__all__ = [
    "HfSplit",
    "arrow_of_dataset",
    "is_hf_folder",
    "open_hf_split",
    "open_hf_table",
    "plan_hf_folder",
    "read_hf_split",
]

_MAX_JSON = 16 << 20
"""A ``state.json`` or ``dataset_dict.json`` larger than this is not one ``datasets`` wrote."""


@dataclass(frozen=True)
class HfSplit:
    """One table entry a ``save_to_disk`` folder makes: its key, folder and data files."""

    key: str
    folder: Path
    files: tuple[Path, ...]

    @property
    def size(self) -> int:
        return sum(os.stat(f).st_size for f in self.files)


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    top = Path(path)
    if not top.is_dir():
        return False
    return (top / "dataset_dict.json").is_file() or (
        (top / "state.json").is_file() and (top / "dataset_info.json").is_file()
    )


def plan_hf_folder(key: str, path: Path, allowed: Sequence[str | os.PathLike[str]] = ()) -> list[HfSplit]:
    """The entries a ``save_to_disk`` folder makes (``key``, or ``key/<split>`` per split of
    a ``DatasetDict``), its JSON files checked; nothing is read of the data yet."""
    path = Path(os.path.abspath(path))
    tops = tuple(os.path.realpath(top) for top in allowed)
    if not (path / "dataset_dict.json").is_file():
        return [HfSplit(key, path, _data_files(path, tops))]
    listed = _read_json(path / "dataset_dict.json", tops)
    splits = listed.get("splits") if isinstance(listed, dict) else None
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise CorruptSourceError(f"{path}/dataset_dict.json names no splits (a list of names)")
    planned = []
    for split in splits:
        if "/" in split or split in ("", ".", ".."):
            raise InvalidSourceError(f"{path}/dataset_dict.json names split {split!r}, not a folder name")
        try:
            child = validate_key(f"{key}/{split}")
        except InvalidKeyError:
            raise InvalidSourceError(
                f"{path}: split {split!r} cannot be a key segment ([A-Za-z0-9._-]); rename the split"
            ) from None
        planned.append(HfSplit(child, path / split, _data_files(path / split, tops)))
    return planned


def _data_files(folder: Path, tops: tuple[str, ...]) -> tuple[Path, ...]:
    state = _read_json(folder / "state.json", tops)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries:
        raise CorruptSourceError(f"{folder}/state.json lists no _data_files; save the dataset again")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise InvalidSourceError(
                f"{folder}/state.json names data file {name!r}, not a file in its folder"
            )
        if not (folder / name).is_file():
            raise SourceNotFoundError(f"{folder}/state.json names data file {name}, which does not exist")
        files.append(folder / name)
    return tuple(files)


def _read_json(path: Path, tops: tuple[str, ...]) -> Any:
    fd, file = open_checked(str(path), tops)
    with open(fd, "rb") as fp:
        if file.size > _MAX_JSON:
            raise CorruptSourceError(f"{path} is {file.size:,} bytes; not a file datasets wrote")
        try:
            return json.loads(fp.read())
        except ValueError as exc:
            raise CorruptSourceError(f"{path} is not valid JSON: {exc}") from None


def planned_entries(splits: Sequence[HfSplit]) -> list[PlannedEntry]:
    """What ``plan_file`` reports: an entry per split, sized by its data files."""
    return [PlannedEntry(s.key, str(s.folder), str(s.folder), s.size) for s in splits]


def read_hf_split(
    split: HfSplit, allowed: Sequence[str | os.PathLike[str]] = ()
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The table entry's files (each one array) and meta of one split (see
    :func:`open_hf_split`); a file changed meanwhile raises."""
    with open_hf_split(split, allowed) as (files, meta):
        # owned copies, made before the files are checked unchanged: a column can be a view of
        # a stream file's mapping, which the caller would otherwise read after the check
        return {name: _owned(joined(array)) for name, array in files.items()}, meta


def _owned(array: np.ndarray) -> np.ndarray:
    return array if array.flags.owndata else array.copy()


@contextmanager
def open_hf_split(
    split: HfSplit, allowed: Sequence[str | os.PathLike[str]] = ()
) -> Iterator[tuple[dict[str, FileArray], dict[str, Any]]]:
    """The table entry's files and meta of one split: its Arrow streams read from read-only
    mappings of the checked files, concatenated, encoded. A fixed-width column's values
    stay views of the mappings (:class:`ArrayParts`, one part per data file: no copy
    before the caller's write), so the files are checked unchanged when the block ends
    without an error, after the caller has written them; a file changed meanwhile raises."""
    what = f"dataset folder {split.folder}"
    with open_hf_table(split, allowed) as (table, extra):
        files, meta = encode_arrow_parts(table, what)
        yield files, meta | extra


@contextmanager
def open_hf_table(
    split: HfSplit, allowed: Sequence[str | os.PathLike[str]] = (), *, populate: bool = True
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """One split's Arrow streams as one pyarrow Table (its columns' chunks views of
    read-only mappings of the checked files, or of their bytes read: see
    :func:`_read_stream`) and the meta naming its source; the files are checked unchanged
    when the block ends without an error, after the caller has written the table.
    ``populate=False``: the mappings' pages are mapped in as they are first read (by a
    caller that reads them on two threads), not all at once here."""
    what = f"dataset folder {split.folder}"
    pa = require_pyarrow(what)
    tops = tuple(os.path.realpath(top) for top in allowed)
    tables, checked = [], []
    try:
        for path in split.files:
            fd, file = open_checked(str(path), tops)
            checked.append((fd, file))
            tables.append(_read_stream(pa, fd, file, mapped=not tops, populate=populate))
        try:
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as exc:
            raise CorruptSourceError(f"{what}: its data files differ in schema ({exc})") from None
        fingerprint = tree_fingerprint(file for _, file in checked)  # "racy": see source_files
        yield table, {"source": str(split.folder), "source_fingerprint": fingerprint}
        for fd, file in checked:
            check_unchanged(fd, file)
    finally:
        for fd, _ in checked:
            os.close(fd)


def hf_fingerprint(folder: Path) -> dict[str, int] | None:
    """A split folder's fingerprint as it is now (stat only), as :func:`read_hf_split` records it."""
    try:
        stats = [os.stat(f) for f in _data_files(folder, ())]
    except (OSError, InvalidSourceError):
        return None
    return {
        "files": len(stats),
        "size": sum(st.st_size for st in stats),
        "mtime_ns": max(st.st_mtime_ns for st in stats),
    }


def _read_stream(pa: Any, fd: int, file: SourceFile, *, mapped: bool, populate: bool = True) -> Any:
    """The Arrow table of one stream file. ``mapped``: on a read-only mapping of the file
    (no copy; the table's buffers keep it alive). A confined load (a daemon's, whose
    sources belong to its clients) reads the file into memory instead: a client that
    truncated a mapped file mid-load would kill the daemon with SIGBUS."""
    if file.size == 0:
        raise CorruptSourceError(f"{file.path} is empty, not an Arrow stream")
    if mapped:
        # its pages are mapped in at once, not faulted one by one as the writer reads them
        # (a 265 MiB folder's put: 0.50 -> 0.40 s)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        data: Any = mmap.mmap(fd, file.size, flags=flags, prot=mmap.PROT_READ)
    else:
        data = pread_exactly(fd, file.size, 0, lambda done: CorruptSourceError(
            f"{file.path} changed while loading (it was {file.size} bytes, {done} could be read); "
            "nothing was published, load it again"
        ))
    try:
        return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError, EOFError) as exc:
        raise CorruptSourceError(f"{file.path} is not a readable Arrow stream: {exc}") from None


def arrow_of_dataset(data: Any, what: str) -> Any:
    """The pyarrow Table of a ``datasets.Dataset`` (its rows as selected: an indices mapping
    from ``select``/``shuffle`` is applied by Arrow's ``take``, no Python object per row)."""
    name = type(data).__name__
    if name in ("DatasetDict", "IterableDatasetDict"):
        raise UnsupportedDataError(
            f"{what} is a {name}; put each split (put_table(f'{{key}}/{{split}}', data[split])), or "
            "save_to_disk it and put_file the folder (each split as key/<split>)"
        )
    if name != "Dataset" or not hasattr(data, "with_format"):
        raise UnsupportedDataError(f"{what} is a datasets {name}; put_table takes a datasets.Dataset")
    return data.with_format("arrow")[:]
