"""What an entry's mapping is, and what is read through one without mapping anything:
:class:`MappedFile` (one published entry file, knowing where it came from) and
:class:`SharedManifest` (one mapping per 64 MiB window of a packed batch's manifest,
shared by the entries starting in it); which
entry an array lies in (:func:`mapped_base`, :func:`origin_of`); and a packed entry's
range, header and live byte in its batch's manifest (format 2). ``attach`` makes the
mappings and holds the mmap policy (modes, strict overcommit, the fallbacks, which tests
patch there); this module lies below it and imports none of that."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from ..errors import CorruptEntryError
from .layout import ARRAY_FILE
from .npy import header_length

__all__ = ["MappedFile", "SharedManifest", "is_shared_read_only", "mapped_base", "origin_of", "version_of"]

_HEADER_READ = 256  # numpy pads headers to 64 bytes; nearly all fit in 128
_DATA_START = 64  # a packed entry starts after the manifest's head (format 2)
_PACK_ALIGN = 64  # and at a multiple of this (manifest.PACK_ALIGN)
_LIVE_AT = slice(32, 40)  # where a format 2 manifest's head says its live bitmap starts


class MappedFile(mmap.mmap):
    """A mapping of one published entry file that knows where it came from."""

    origin: tuple[str, str, str, str]
    """``(root, version, filename, key)`` of the mapped file."""
    shared: bool = False
    """True for a ``MAP_SHARED`` read-only mapping (mode ``"shared"``, or the fallback
    when the kernel refused a copy-on-write one): a write through it is a SIGSEGV."""
    file_start: int = 0
    """Where the mapping starts in its file (a packed entry's range mapping: the page
    below its offset); :func:`origin_of` gives offsets in the file, not the mapping."""
    _start: int | None = None

    def start_address(self) -> int:
        """Virtual address of the first byte of the mapping (for view offsets)."""
        if self._start is None:
            self._start = int(np.frombuffer(self, dtype=np.uint8, count=1).ctypes.data)
        return self._start

    def origin_at(self, offset: int) -> tuple[str, str, str, str] | None:
        """``origin`` of the entry whose bytes hold byte ``offset`` of the mapping."""
        return self.origin


class SharedManifest(MappedFile):
    """The one mapping of a window of a batch manifest (64 MiB and the longest entry, from
    ``file_start``: ``attach._shared_manifest``) that every packed entry starting in it
    opened copy-on-write in this process is a view into: one descriptor (two on Python
    < 3.13) and one VMA per window, not per key (``vm.max_map_count`` and ``ulimit -n``
    would otherwise cap a process at a few thousand keys), nor a 10 GB reservation for one
    key of a 10 GB manifest. It lives while any array over it does (``attach._MANIFESTS``
    holds it weakly). A published manifest never grows (it is written once, then only its
    live bytes change in place): the mapping, made at the file's size, covers every entry
    of its window it will ever hold."""

    fd: int
    """A read-only descriptor of the file, for the open path's ``pread`` of an entry's
    header and live byte: a read through the mapping of a file truncated meanwhile (a
    broken or hostile writer) would be SIGBUS, a ``pread`` is a short read. Closed with
    the mapping (Python < 3.13's mmap keeps a duplicate of its own, not exposed: two
    descriptors per window there, one on 3.13+)."""
    ident: tuple[int, int]
    """``(st_dev, st_ino)`` of the file mapped: while this mapping lives the file's inode
    cannot be freed, so no other file has them; a path that stats to them is this file."""
    entries: dict[int, tuple[str, str, int]]
    """Packed offset (in the file) -> ``(version, key, length)`` of each entry opened over it (for the
    ``origin`` of an array: pickling by reference, ``private_view``, ``pin``)."""
    longest: int = 0

    def origin_at(self, offset: int) -> tuple[str, str, str, str] | None:
        entries = self.entries
        offset += self.file_start  # entries are recorded at their offset in the file
        start = offset - offset % _PACK_ALIGN
        lowest = max(_DATA_START, self.file_start, offset - self.longest)
        while start >= lowest:  # entries are 64-byte aligned, at most ``longest`` bytes
            found = entries.get(start)
            if found is not None:
                version, key, length = found
                if offset < start + length:
                    return self.origin[0], version, ARRAY_FILE, key
                return None
            start -= _PACK_ALIGN
        return None

    def record(self, offset: int, version: str, key: str, length: int) -> None:
        """Remember that entry ``version`` (``key``) is bytes ``offset..+length``."""
        self.entries[offset] = (version, key, length)
        if length > self.longest:
            self.longest = length


def is_shared_read_only(array: np.ndarray) -> bool:
    """Whether ``array`` lies on a ``MAP_SHARED`` read-only mapping of an entry, where a
    write that gets past numpy's flag (a torch tensor's in-place op) is a SIGSEGV."""
    base = mapped_base(array)
    return isinstance(base, MappedFile) and base.shared


def _check_range(key: str, path: str, offset: int, length: int, size: int) -> None:
    if offset < _DATA_START or offset + length > size:
        raise CorruptEntryError(
            f"entry {key!r}: {path} is truncated or damaged (it does not hold the entry's "
            f"bytes {offset}..{offset + length}); evict it and put it again"
        )


def _packed_header(fd: int, key: str, path: str, offset: int, length: int) -> tuple[bytes, int]:
    """A packed entry's header bytes and length, ``pread`` from its manifest at ``fd`` (a
    short read, the file truncated meanwhile, is :class:`CorruptEntryError`, never the
    SIGBUS a read through a mapping would be)."""
    head = os.pread(fd, min(_HEADER_READ, length), offset)
    end = header_length(head, f"entry {key!r}")
    if end > len(head):
        head = os.pread(fd, min(end, length), offset)
        if end > len(head):
            raise CorruptEntryError(f"entry {key!r}: its bytes in {path} end inside its header")
    return head, end


def _packed_live(fd: int, index: int) -> bool:
    """Whether packed entry ``index``'s live byte in the manifest at ``fd`` is still 1
    (``manifest``'s format 2; two ``pread``s)."""
    head = os.pread(fd, 40, 0)
    if len(head) < 40:
        return False
    return os.pread(fd, 1, int.from_bytes(head[_LIVE_AT], "little") + index) == b"\x01"


def origin_of(array: np.ndarray) -> tuple[tuple[str, str, str, str], int] | None:
    """``((root, version, filename, key), offset)`` of the entry a shared array (or a view
    of one) lies in, ``offset`` being where its data starts in the entry's mapping (for a
    packed entry: in its whole manifest, whatever part of it the mapping holds); None for
    any other array. An empty array has an origin too (``as_tensor``, ``pin`` of an empty
    entry); pickling sends it by value."""
    base = mapped_base(array)
    if not isinstance(base, MappedFile):
        return None
    offset = int(array.__array_interface__["data"][0]) - base.start_address()
    origin = base.origin_at(offset)
    if origin is None and not array.size and offset:  # empty, at its entry's end
        origin = base.origin_at(offset - 1)
    return None if origin is None else (origin, offset + base.file_start)


def version_of(array: np.ndarray) -> str | None:
    """The version of the entry a shared array (or a view of one) lies in; None for any
    other array (what a Dataset sized from it records, to read no other)."""
    found = origin_of(array)
    return None if found is None else found[0][1]


def mapped_base(array: np.ndarray) -> Any:
    """The object at the end of ``array``'s base chain, looking through ndarrays and
    wrappers such as the one ``as_strided``/``sliding_window_view`` put in between."""
    base = array.base
    while base is not None and not isinstance(base, MappedFile):
        parent = getattr(base, "base", None)
        if parent is None:
            break
        base = parent
    return base
