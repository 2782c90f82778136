"""Read-only mappings of entry files, and pickling of arrays by reference.

An array handed out by shmcache is a plain ``ndarray`` (full indexing speed, unlike
``np.memmap``) whose buffer is a :class:`MappedFile`. Pickling such an array, or
any view of it, sends ``(root, version, file, offset, shape, strides, dtype)`` instead
of the data, and the receiving process maps the same file again: DataLoader workers
started with ``spawn``/``forkserver`` get the dataset in microseconds, not a copy.
"""

from __future__ import annotations

import copyreg
import errno
import mmap
import os
import resource
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CorruptEntryError, KeyNotFoundError, TooManyOpenFilesError
from .layout import object_path
from .npy import header_length, parse_header_bytes

__all__ = [
    "MappedFile",
    "attach_array",
    "install_pickle_by_reference",
    "map_entry_file",
    "mapped_base",
    "private_view",
]


class MappedFile(mmap.mmap):
    """A read-only mapping of one published entry file that knows where it came from."""

    origin: tuple[str, str, str, str]
    """``(root, version, filename, key)`` of the mapped file."""
    _start: int | None = None

    def start_address(self) -> int:
        """Virtual address of the first byte of the mapping (for view offsets)."""
        if self._start is None:
            self._start = int(np.frombuffer(self, dtype=np.uint8, count=1).ctypes.data)
        return self._start


# Python 3.13+ can map without keeping a duplicate descriptor per mapping.
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
_HEADER_READ = 256  # numpy pads headers to 64 bytes; nearly all fit in 128
_MAPPINGS: weakref.WeakValueDictionary[tuple[str, str, str], MappedFile] = (
    weakref.WeakValueDictionary()
)


def map_entry_file(root: str, version: str, filename: str, key: str) -> MappedFile:
    """Map ``root/objects/<version>/<filename>`` read-only.

    Raises FileNotFoundError if the version is gone (replaced or evicted).
    """
    mapping = _map(root, version, filename, key, read_header=False)[0]
    assert isinstance(mapping, MappedFile)
    return mapping


def attach_array(
    root: str, version: str, filename: str, key: str, *, copy_on_write: bool = False
) -> np.ndarray:
    """The read-only array a published ``.npy`` file holds (a plain ``ndarray``).

    The header is read with ``pread`` rather than through the mapping: touching the
    mapping would cost a page fault, more than the rest of the attach together.
    With ``copy_on_write`` the array is writable over a private mapping instead (reads
    share the cache's pages; a write copies the touched page into this process only);
    it pickles by value, like any array of its own.
    Raises FileNotFoundError if the version is gone (replaced or evicted).
    """
    mapping, head, end = _map(root, version, filename, key, True, copy_on_write)
    dtype, shape, fortran_order, offset = parse_header_bytes(head, end, f"entry {key!r}")
    try:
        if fortran_order:
            return np.ndarray(shape, dtype, mapping, offset, order="F")
        return np.ndarray(shape, dtype, mapping, offset)
    except TypeError as exc:  # "buffer is too small for requested array"
        raise CorruptEntryError(
            f"entry {key!r} ({filename}) is truncated: {len(mapping)} bytes, fewer than its "
            f"header promises ({shape} of {dtype}); evict it and put it again"
        ) from exc


def _map(
    root: str, version: str, filename: str, key: str, read_header: bool, private: bool = False
) -> tuple[mmap.mmap, bytes, int]:
    path = object_path(root, version, filename)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise _too_many_open(key) from exc
        raise
    try:
        head, end = b"", 0
        if read_header:
            head = os.pread(fd, _HEADER_READ, 0)
            end = header_length(head, f"entry {key!r}")
            if end > len(head):
                head = os.pread(fd, end, 0)
                if end > len(head):
                    raise CorruptEntryError(f"entry {key!r}: {path} is truncated inside its header")
        try:
            if private:
                mapping: mmap.mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            else:
                mapping = MappedFile(fd, 0, prot=mmap.PROT_READ, **_MMAP_OPTIONS)
        except ValueError as exc:  # an empty file cannot be mapped
            raise CorruptEntryError(f"entry {key!r}: {path} is empty; evict it and put it again") from exc
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise _too_many_open(key) from exc
            raise
        try:  # when it was last used, for least-recently-used eviction
            os.utime(fd)
        except OSError:
            pass
    finally:
        os.close(fd)
    if isinstance(mapping, MappedFile):
        mapping.origin = (root, version, filename, key)
    if not _installed:
        install_pickle_by_reference()
    return mapping, head, end


def _too_many_open(key: str) -> TooManyOpenFilesError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return TooManyOpenFilesError(
        f"cannot attach entry {key!r}: this process has too many open files (limit {soft}; "
        f"on Python < 3.13 each attached entry holds a descriptor). Raise `ulimit -n` (hard limit "
        f"{hard}), or open fewer distinct entries (e.g. one array instead of many small ones)"
    )


def _raise_open_file_limit() -> None:
    """Python < 3.13 keeps a descriptor per mapping: lift the soft limit to the hard one
    (the common 1024 is reached by a process that attaches ~1000 entries)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, 1 << 20), hard))
    except (ValueError, OSError):
        pass


def private_view(array: np.ndarray) -> np.ndarray:
    """A writable copy-on-write view of a shared array's bytes.

    The file is mapped again with ``MAP_PRIVATE``: reads share the cache's pages (no
    copy); a write copies just the touched page into this process, so the cache and
    every other process keep the original. Raises ValueError for arrays that do not
    live in the cache.
    """
    base = mapped_base(array)
    if not isinstance(base, MappedFile):
        raise ValueError("array does not live in the shmcache (open it with shmcache.open_array)")
    root, version, filename, key = base.origin
    offset = int(array.__array_interface__["data"][0]) - base.start_address()
    try:
        fd = os.open(object_path(root, version, filename), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyNotFoundError(
            f"entry {key!r} (version {version}) was replaced or evicted; open the key again"
        ) from None
    try:
        private = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.ndarray(array.shape, array.dtype, buffer=private, offset=offset, strides=array.strides)


def _reattach(
    root: str,
    version: str,
    filename: str,
    key: str,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
) -> np.ndarray:
    """Unpickle side of :func:`_reduce_ndarray`: map the same version again.

    Mappings are shared by all arrays unpickled in this process while any of them lives.
    """
    ident = (root, version, filename)
    try:
        mapping = _MAPPINGS.get(ident) or map_entry_file(root, version, filename, key)
    except FileNotFoundError:
        raise KeyNotFoundError(
            f"entry {key!r} (version {version}) in {root} was replaced or evicted before this "
            "process could attach to it; open the key again"
        ) from None
    _MAPPINGS[ident] = mapping
    return np.ndarray(shape, dtype, buffer=mapping, offset=offset, strides=strides)


_previous_reducer: Callable[[np.ndarray], Any] | None = None
_installed = False


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


def _reduce_ndarray(array: np.ndarray) -> Any:
    base = mapped_base(array)
    if isinstance(base, MappedFile) and array.size:
        offset = int(array.__array_interface__["data"][0]) - base.start_address()
        return _reattach, (
            *base.origin,
            offset,
            array.shape,
            array.strides,
            array.dtype,
        )
    if _previous_reducer is not None:
        return _previous_reducer(array)
    return array.__reduce__()


def install_pickle_by_reference() -> None:
    """Make pickle send shared arrays by reference (idempotent; other arrays unchanged).

    Installed on the first attach, not on import, so a process that never opens an
    entry pickles exactly as before.
    """
    global _installed, _previous_reducer
    if _installed:
        return
    if not _MMAP_OPTIONS:
        _raise_open_file_limit()
    existing = copyreg.dispatch_table.get(np.ndarray)
    if existing is not _reduce_ndarray:
        _previous_reducer = existing
    copyreg.pickle(np.ndarray, _reduce_ndarray)
    _installed = True
