"""What a ``put_file`` will write, one item per entry, decided before any byte is copied.

Three ways to fill an entry's ``data.npy``: copy a source's own ``.npy`` bytes (``.npy``,
stored ``.npz`` members), write a header built here and then copy a raw byte range
(``prefix``: safetensors, contiguous torch tensors), or run a decoder (``write``:
compressed ``.npz`` members are inflated by ``files``, HDF5 datasets, strided tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._disk.keys import validate_key
from .._disk.npy import NpyHeader, build_header
from ..errors import ShmCacheError
from .source_files import SourceFile

__all__ = ["Container", "Planned", "PlannedEntry", "Writer", "container_header", "member_key"]

Writer = Callable[[int, int, Path, Callable[[int], None]], int]
"""``write(src, dst, target, advance) -> crc32``: append the whole ``.npy`` (header
included) to ``dst`` from the reopened source ``src``, calling ``advance(n)`` per chunk."""


@dataclass(frozen=True)
class Container:
    """A container entry decoded from a source when it was checked (HDF5 variable-length
    strings): its kind, its files (name without ``.npy`` -> array) and extra metadata;
    ``copied``: files copied from the source as planned items are (a Megatron ``.bin``)."""

    kind: str
    files: Mapping[str, np.ndarray]
    extra: Mapping[str, Any]
    copied: Mapping[str, Planned] = field(default_factory=dict)


def container_header(container: Container) -> NpyHeader:
    """A header that only sizes a container (``put_file`` reserves and reports bytes from
    ``header.file_size``): the bytes of all its ``.npy`` files."""
    size = sum(len(build_header(a.dtype, a.shape, False)) + a.nbytes for a in container.files.values())
    size += sum(item.header.file_size for item in container.copied.values())
    return NpyHeader(np.dtype(np.uint8), (size,), False, 0)


@dataclass(slots=True)
class Planned:
    """One entry a ``put_file`` call will write, validated before any byte is copied.

    ``key`` is validated; ``header`` is what the entry's metadata is built from (the
    source's own header, or the one built in ``prefix``).
    """

    key: str
    header: NpyHeader
    source: str
    file: SourceFile
    copy_offset: int | None  # None: the member is compressed and must be inflated
    member: str | None = None
    version: str = field(default="")
    prefix: bytes | None = None
    """A built ``.npy`` header written first; ``copy_offset`` then starts the raw payload."""
    write: Writer | None = None
    """Decodes the source into the entry (``copy_offset`` is unused then)."""
    container: Container | None = None
    """Not an array: a container, written by ``_store/writing.write_container`` (``header`` only sizes it)."""
    fd: int | None = None
    """The descriptor the source was checked through, held open until the copy (a
    directory put's ``.npy`` files, as many as the descriptor limit allows: no reopen, and
    no second check of which file it is); None: the copy reopens ``file``. Closed by the
    copy or by ``files.release_planned``."""
    data: bytes | None = None
    """The whole ``.npy`` (``header.file_size`` bytes), read when the file was checked (a
    directory put's small files, within a total cap: ``files._KEEP_TOTAL``), its descriptor
    closed then, after an ``fstat`` showed the same size and time stamps as before that
    read (a snapshot of the file: no write began during the read; one already under way
    then makes the file racily clean, ``SourceFile.racy``): the copy writes these bytes,
    with no reopen, no ``stat`` and no second read. Dropped by the copy or by
    ``files.release_planned``."""

    @property
    def fingerprint(self) -> dict[str, int]:
        return self.file.fingerprint

    @property
    def copy_from(self) -> str:
        return self.file.path


def member_key(key: str, name: str, path: Path, what: str) -> str:
    """``key/<name>`` for a tensor or dataset ``name`` of ``path``, or the key error naming both."""
    try:
        return validate_key(f"{key}/{name}")
    except ShmCacheError as exc:
        raise type(exc)(
            f"{path}: {what} {name!r} does not make a valid key ({exc}); rename it, or load the "
            "file with its own library and put the arrays under keys of your choosing"
        ) from None


@dataclass(frozen=True)
class PlannedEntry:
    """One entry ``put_file`` would publish (see ``Store.plan_file``)."""

    key: str
    source: str
    """The file, or ``archive.npz[member.npy]``."""
    file: str
    """The file on disk the bytes come from."""
    size: int
    """Bytes the entry's data file will take."""
