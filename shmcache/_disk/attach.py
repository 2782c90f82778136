"""Mappings of entry files that no write can crash through, and pickling of arrays by reference.

An array handed out by shmcache is a plain ``ndarray`` (full indexing speed, unlike
``np.memmap``) flagged read-only, whose buffer is a :class:`MappedFile`. Pickling such
an array, or any view of it, sends ``(root, version, file, offset, shape, strides,
dtype)`` instead of the data, and the receiving process maps the same file again:
DataLoader workers started with ``spawn``/``forkserver`` get the dataset in
microseconds, not a copy.

The small entries of a directory put are packed into its batch's manifest: those a
process opens copy-on-write are views into ONE mapping of the manifest per 64 MiB window
(:class:`SharedManifest`: one descriptor, two on Python < 3.13, and one VMA per window of
a batch, not per key), which lives while any array of it does; where the kernel refuses
such a mapping (ENOMEM: ``ulimit -v``, ``ulimit -d``), an entry maps its own range.
``/proc/<pid>/maps`` then shows every entry of that batch as mapped by the process: true
of its memory, which returns only with the batch. An evicted packed entry's bytes stay
readable through it, as an unlinked file's do.

How an entry is mapped (``mode``):

- ``"copy-on-write"`` (the default, what every reader gets): ``MAP_PRIVATE`` with
  ``PROT_READ | PROT_WRITE``, as ``np.load(mmap_mode="c")`` does. Reads share the
  cache's pages (one physical copy however many processes map it); numpy refuses writes
  (``writeable=False``), but a write that gets past numpy (a ``torch.from_numpy``
  tensor's in-place op, ``setflags(write=True)``) copies just the touched pages into
  this process instead of killing it with SIGSEGV, and no other process or the cache
  sees it. ``MAP_NORESERVE`` keeps the kernel from charging the whole size to the
  commit limit under the default heuristic overcommit. Strict overcommit
  (``vm.overcommit_memory=2``) ignores ``MAP_NORESERVE`` and charges such a mapping in
  full, in every process and again at every fork (each DataLoader worker): there,
  entries are mapped ``"shared"`` instead, and so is one whose mapping the kernel
  refuses with ENOMEM (an ``RLIMIT_DATA`` smaller than the entry). Either is logged once
  per process: numpy still refuses writes, but a torch tensor written in place over
  such a mapping gets SIGSEGV again.
- ``"shared"``: ``MAP_SHARED`` with ``PROT_READ`` only: no page can ever be copied or
  written (for registering the pages with a device read-only, e.g.
  ``cudaHostRegister``). A write through it is a SIGSEGV.
- ``"writable"``: a fresh ``MAP_PRIVATE`` mapping whose array is writable (for
  ``shmcache.torch`` tensors): writes stay in this array, not even the other arrays of
  the same entry in this process see them; it pickles by value, like any array of its
  own. Refused by the kernel: :class:`MappingRefusedError`, never a fallback.
"""

from __future__ import annotations

import copyreg
import errno
import math
import mmap
import os
import resource
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ..errors import CorruptEntryError, KeyNotFoundError, MappingRefusedError, TooManyOpenFilesError
from .layout import MANIFEST_FILE, object_path, packed_range
from .mapped import (
    _HEADER_READ,
    MappedFile,
    SharedManifest,
    _check_range,
    _packed_header,
    _packed_live,
    origin_of,
)
from .npy import header_length, parse_header_bytes

__all__ = [
    "COPY_ON_WRITE",
    "SHARED",
    "WRITABLE",
    "MapMode",
    "attach_array",
    "install_pickle_by_reference",
    "map_entry_file",
    "overcommit_is_strict",
    "private_view",
]

MapMode = Literal["copy-on-write", "shared", "writable"]
COPY_ON_WRITE: MapMode = "copy-on-write"
SHARED: MapMode = "shared"
WRITABLE: MapMode = "writable"


# Python 3.13+ can map without keeping a duplicate descriptor per mapping.
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
_MAPPINGS: weakref.WeakValueDictionary[tuple[str, str, str], MappedFile] = (
    weakref.WeakValueDictionary()
)
_MANIFESTS: weakref.WeakValueDictionary[tuple[str, str, int], SharedManifest] = weakref.WeakValueDictionary()
"""(root, batch, window) -> this process's shared mapping of that window of the batch's
manifest, while it lives."""
_WINDOW = 64 << 20  # a manifest is mapped in windows of this size, at multiples of it,
_OVERLAP = (64 << 10) + mmap.PAGESIZE  # each this much longer: every packed entry (at most
# manifest.PACK_MAX = 64 KiB) lies wholly in the window where it starts
_TOUCH_EVERY_S = 1.0  # a batch used again within this is not touched again (LRU: seconds)
_PROT_COPY = mmap.PROT_READ | mmap.PROT_WRITE
# MAP_NORESERVE: older Pythons' mmap module has no constant; Linux's is 0x4000 on x86,
# ARM, RISC-V and s390 (other architectures go without: only the accounting differs).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0)
_NORESERVE_0x4000 = ("x86", "i686", "amd64", "aarch64", "arm", "riscv", "s390")
if not _NORESERVE and sys.platform == "linux" and os.uname().machine.startswith(_NORESERVE_0x4000):
    _NORESERVE = 0x4000
_FLAGS_COPY = mmap.MAP_PRIVATE | _NORESERVE
_OVERCOMMIT_SETTING = "/proc/sys/vm/overcommit_memory"
_shared_fallback_logged = False


def overcommit_is_strict(setting: bytes | None = None) -> bool:
    """Whether the kernel's overcommit policy (``setting``: the contents of
    /proc/sys/vm/overcommit_memory, read when None) is strict (2)."""
    if setting is None:
        try:
            with open(_OVERCOMMIT_SETTING, "rb") as fp:
                setting = fp.read()
        except OSError:  # no procfs: not Linux's strict mode
            return False
    return setting.strip() == b"2"


_STRICT_OVERCOMMIT = overcommit_is_strict()


def map_entry_file(
    root: str, version: str, filename: str, key: str, *, mode: MapMode = COPY_ON_WRITE
) -> MappedFile:
    """Map ``root/objects/<version>/<filename>`` copy-on-write, or with ``mode="shared"``
    ``MAP_SHARED``/``PROT_READ``, where no page is ever copied (see the module docstring).

    Raises FileNotFoundError if the version is gone (replaced or evicted).
    """
    if mode == WRITABLE:
        raise ValueError("map_entry_file maps to share; a writable array: attach_array(..., mode='writable')")
    mapping = _map(root, version, filename, key, False, mode)[0]
    assert isinstance(mapping, MappedFile)
    return mapping


def attach_array(
    root: str,
    version: str,
    filename: str,
    key: str,
    *,
    mode: MapMode = COPY_ON_WRITE,
    huge_pages: bool = False,
) -> np.ndarray:
    """The array a published ``.npy`` file holds (a plain ``ndarray``), read-only
    unless ``mode="writable"`` (see the module docstring for the modes).
    ``huge_pages`` (``"writable"`` only): a mapping on 2 MiB pages where
    ``huge_map`` can make one (the file's pages collapsed once), else the usual one.

    The header is read with ``pread`` rather than through the mapping: touching the
    mapping would cost a page fault, more than the rest of the attach together.
    Raises FileNotFoundError if the version is gone (replaced or evicted), and
    :class:`MappingRefusedError` if the kernel refuses a ``"writable"`` mapping.
    """
    if huge_pages and mode != WRITABLE:
        raise ValueError("huge_pages=True maps a private writable array: mode='writable'")
    mapping, head, end, shift, stop = _map(root, version, filename, key, True, mode, huge_pages)
    dtype, shape, fortran_order, offset = parse_header_bytes(head, end, f"entry {key!r}")
    offset += shift  # a packed entry's .npy starts inside its mapping
    try:
        if stop is not None and offset + dtype.itemsize * math.prod(shape) > stop:
            raise TypeError("buffer is too small for requested array")  # its neighbours' bytes
        if fortran_order:
            array = np.ndarray(shape, dtype, mapping, offset, order="F")
        else:
            array = np.ndarray(shape, dtype, mapping, offset)
    except TypeError as exc:  # "buffer is too small for requested array"
        raise CorruptEntryError(
            f"entry {key!r} ({filename}) is truncated: {(stop or len(mapping)) - shift} bytes, "
            f"fewer than its header promises ({shape} of {dtype}); evict it and put it again"
        ) from exc
    if mode != WRITABLE:
        array.setflags(write=False)
    return array


def _map(
    root: str,
    version: str,
    filename: str,
    key: str,
    read_header: bool,
    mode: MapMode = COPY_ON_WRITE,
    huge: bool = False,
) -> tuple[Any, bytes, int, int, int | None]:
    """A mapping of a published entry file, its header's first bytes and length (when
    ``read_header``), where its ``.npy`` starts in the mapping (0 but for a packed
    entry), and where it ends (None: with the mapping)."""
    if mode != COPY_ON_WRITE and mode != SHARED and mode != WRITABLE:
        raise ValueError(f"unknown mapping mode {mode!r}: one of 'copy-on-write', 'shared', 'writable'")
    if "." in version.partition("/")[2]:  # an entry packed into its batch's manifest
        packed = packed_range(version)
        if packed is not None:
            return _map_packed(root, version, filename, key, packed, read_header, mode)
    path = object_path(root, version, filename)
    fd = _open_entry_file(path, key)
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
            mapping = _map_and_touch(fd, key, mode, huge)
        except ValueError as exc:  # an empty file cannot be mapped
            raise CorruptEntryError(f"entry {key!r}: {path} is empty; evict it and put it again") from exc
    finally:
        os.close(fd)
    return _owned(mapping, (root, version, filename, key)), head, end, 0, None


def _map_packed(
    root: str,
    version: str,
    filename: str,
    key: str,
    packed: tuple[str, int, int, int],
    read_header: bool,
    mode: MapMode,
) -> tuple[Any, bytes, int, int, int | None]:
    """:func:`_map` of a packed entry: bytes ``offset..offset+length`` of its batch's
    manifest. Copy-on-write (every reader): a view into this process's one mapping of the
    manifest's window it lies in (:func:`_shared_manifest`); ``"shared"`` (``pin``: a
    registration of its own), ``"writable"``, and copy-on-write where its window cannot
    be mapped (ENOMEM: ``ulimit -v``/``-d``): a mapping of just its range, from the page
    below ``offset`` (``MappedFile.file_start``). Returns
    the entry's header as :func:`_map` does, and where its ``.npy`` starts in the mapping.
    A range beyond the file's end (a damaged or truncated manifest) is
    :class:`CorruptEntryError`, never a mapping that faults. No huge pages (tiny)."""
    batch, index, offset, length = packed
    path = object_path(root, batch, MANIFEST_FILE)
    if mode == COPY_ON_WRITE:
        try:
            shared = _shared_manifest(root, batch, path, key, offset, length)
        except OSError as exc:  # no room for its window (`ulimit -v`, `ulimit -d`)
            if exc.errno != errno.ENOMEM:
                raise
        else:  # header and live byte pread: a read through the mapping could be SIGBUS
            if not read_header and not _packed_live(shared.fd, index):
                raise FileNotFoundError(errno.ENOENT, f"entry {key!r} was evicted", path)
            shared.record(offset, version, key, length)
            head, end = b"", 0
            if read_header:
                head, end = _packed_header(shared.fd, key, path, offset, length)
            shift = offset - shared.file_start
            return shared, head, end, shift, shift + length
    fd = _open_entry_file(path, key)
    try:
        _check_range(key, path, offset, length, os.fstat(fd).st_size)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        shift = offset - start
        if not read_header and not _packed_live(fd, index):
            # a second mapping of an array already out (private_view): refused once the
            # entry is evicted, as a removed file of its own would be
            raise FileNotFoundError(errno.ENOENT, f"entry {key!r} was evicted", path)
        head, end = b"", 0
        if read_header:
            head, end = _packed_header(fd, key, path, offset, length)
        try:
            mapping = _map_and_touch(fd, key, mode, False, shift + length, start)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise MappingRefusedError(
                f"the kernel refused to map entry {key!r} ({length:,} bytes) even read-only: this "
                "process's address space is full (`ulimit -v`, `ulimit -d`); raise the limit or "
                "hold fewer arrays"
            ) from exc
    finally:
        os.close(fd)
    if isinstance(mapping, MappedFile):
        mapping.file_start = start
    return _owned(mapping, (root, version, filename, key)), head, end, shift, shift + length


def _shared_manifest(
    root: str, batch: str, path: str, key: str, offset: int, length: int
) -> SharedManifest:
    """This process's mapping of the window of ``batch``'s manifest that ``offset`` lies in
    (bytes ``w * _WINDOW`` to ``(w + 1) * _WINDOW + _OVERLAP``, or the file's end: a key of
    a 10 GB manifest maps 64 MiB, not 10 GB), made on the first open of one of its
    entries; later opens of its other entries cost
    one ``stat`` (the file's identity and size; the LRU touch at most once a second), no
    open, fstat nor mmap. A refused mapping (ENOMEM) is raised, not mapped shared
    read-only: the caller maps the entry's range instead.

    The mapping is reused only for the same file: the ``stat`` of ``path`` must give the
    ``(device, inode)`` it was made from, which no other file can have while it lives (it
    holds the inode), so a batch removed and a new one at the same path (a re-put, a root
    wiped and recreated) always get a mapping of their own. ``stat``'s size is checked as
    an ``fstat``'s would be: a manifest truncated after it was mapped is
    :class:`CorruptEntryError`, never a read past its end (SIGBUS)."""
    window = offset // _WINDOW
    cached = _MANIFESTS.get((root, batch, window))
    if cached is not None:
        try:
            st = os.stat(path)
        except OSError as exc:  # gone: evicted or replaced, as a failed open says
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise _too_many_open(key) from exc
            raise
        if (st.st_dev, st.st_ino) == cached.ident:
            _check_range(key, path, offset, length, st.st_size)
            if time.time() - st.st_atime >= _TOUCH_EVERY_S:  # when last used (LRU eviction)
                try:
                    os.utime(path)
                except OSError:
                    pass
            return cached
    fd = _open_entry_file(path, key)
    try:
        st = os.fstat(fd)
        _check_range(key, path, offset, length, st.st_size)
        start = window * _WINDOW  # a multiple of the allocation granularity
        span = min(_WINDOW + _OVERLAP, st.st_size - start)
        mapping: SharedManifest = _map_and_touch(
            fd, key, COPY_ON_WRITE, False, span, start, kind=SharedManifest, fallback=False
        )
    except BaseException:
        os.close(fd)
        raise
    mapping.fd = fd  # closed with the mapping (Python < 3.13: beside the mapping's own)
    weakref.finalize(mapping, os.close, fd)
    mapping.file_start = start
    mapping.ident = (st.st_dev, st.st_ino)
    mapping.entries = {}
    _owned(mapping, (root, batch, MANIFEST_FILE, ""))
    _MANIFESTS[(root, batch, window)] = mapping
    return mapping


def _open_entry_file(path: str, key: str) -> int:
    """A read-only descriptor of an entry's file; out of descriptors is typed."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise _too_many_open(key) from exc
        raise


def _map_and_touch(
    fd: int,
    key: str,
    mode: MapMode,
    huge: bool,
    length: int = 0,
    offset: int = 0,
    kind: type[MappedFile] = MappedFile,
    fallback: bool = True,
) -> Any:
    """:func:`_mmap` (out of descriptors typed), then the file's time stamps touched: when
    it was last used, for least-recently-used eviction."""
    try:
        mapping = _mmap(fd, key, mode, huge, length, offset, kind, fallback)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise _too_many_open(key) from exc
        raise
    try:
        os.utime(fd)
    except OSError:
        pass
    return mapping


def _owned(mapping: Any, origin: tuple[str, str, str, str]) -> Any:
    """``mapping`` told where it came from (pickled by reference), the pickler installed."""
    if isinstance(mapping, MappedFile):
        mapping.origin = origin
    if not _installed:
        install_pickle_by_reference()
    return mapping


def _mmap(
    fd: int,
    key: str,
    mode: MapMode,
    huge: bool = False,
    length: int = 0,
    offset: int = 0,
    kind: type[MappedFile] = MappedFile,
    fallback: bool = True,
) -> Any:
    """One mapping of ``fd`` in ``mode`` (an ``mmap``, or with ``huge`` a ``huge_map``
    buffer where one can be made); a copy-on-write one is a shared read-only one
    under strict overcommit, or where the kernel refuses it (ENOMEM: RLIMIT_DATA) unless
    not ``fallback`` (then the ENOMEM is raised)."""
    if mode == COPY_ON_WRITE:
        if not _STRICT_OVERCOMMIT:
            try:
                return kind(
                    fd, length, flags=_FLAGS_COPY, prot=_PROT_COPY, offset=offset, **_MMAP_OPTIONS
                )
            except OSError as exc:
                if exc.errno != errno.ENOMEM or not fallback:
                    raise
                _say_shared_once(_refused(key, os.fstat(fd).st_size))
        else:
            _say_shared_once(
                "vm.overcommit_memory=2 (strict overcommit) would charge a copy-on-write mapping "
                "of each entry in full to the commit limit, in every process and again at every "
                "fork (each DataLoader worker)"
            )
        mode = SHARED  # the fallback: a shared read-only mapping, below
    if mode == SHARED:
        try:
            mapping = kind(fd, length, prot=mmap.PROT_READ, offset=offset, **_MMAP_OPTIONS)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise MappingRefusedError(_refused_shared(key, length or os.fstat(fd).st_size)) from exc
        mapping.shared = True
        return mapping
    if huge and not _STRICT_OVERCOMMIT:
        from .huge_map import map_collapsed  # deferred: ctypes only for who asks

        made = map_collapsed(fd, os.fstat(fd).st_size)
        if made is not None:  # a refused collapse still maps: 4 KiB pages, aligned
            return made[0]
    try:
        return mmap.mmap(fd, length, flags=_FLAGS_COPY, prot=_PROT_COPY, offset=offset)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        advice = (
            ": a writable tensor of this entry needs one. Read it with numpy "
            "(shmcache.open_array: read-only, shared), take rows of it (CachedDataset copies "
            "the rows of such entries), or give the kernel room (swap, vm.overcommit_ratio, "
            "`ulimit -d`)"
        )
        raise MappingRefusedError(_refused(key, os.fstat(fd).st_size) + advice) from exc


def _refused(key: str, size: int) -> str:
    return (
        f"the kernel refused a private copy-on-write mapping of entry {key!r} ({size:,} bytes; "
        "strict overcommit, vm.overcommit_memory=2, charges it in full to the commit limit, "
        "and RLIMIT_DATA counts it)"
    )


def _refused_shared(key: str, size: int) -> str:
    return (
        f"the kernel refused even a shared read-only mapping of entry {key!r} ({size:,} bytes): "
        "this process has no address space left for it (`ulimit -v`, RLIMIT_AS, counts every "
        "mapping). Raise `ulimit -v`, or open fewer or smaller entries at once"
    )


def _say_shared_once(reason: str) -> None:
    global _shared_fallback_logged
    if not _shared_fallback_logged:
        _shared_fallback_logged = True
        import logging  # deferred: said once at most, and the open path of a fresh process is lean

        logging.getLogger(__name__).warning(
            "shmcache: %s; such entries are mapped shared read-only in this process instead "
            "(said once): numpy still refuses writes, but an in-place write through a torch "
            "tensor of one (torch.from_numpy, torch.as_tensor) kills the process with SIGSEGV: "
            "copy what you write to, or use shmcache.torch.CachedDataset",
            reason,
        )


def _too_many_open(key: str) -> TooManyOpenFilesError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return TooManyOpenFilesError(
        f"cannot attach entry {key!r}: this process has too many open files (limit {soft}; "
        f"on Python < 3.13 each attached entry holds a descriptor, the small entries of one directory put "
        f"one together). Raise `ulimit -n` (hard limit "
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
    """A writable view of a shared array's bytes over a mapping of its own.

    The file is mapped again (mode ``"writable"``): reads share the cache's pages (no
    copy); a write copies just the touched page into this view's mapping, so the cache,
    every other process and the other arrays of the entry in this process keep the
    original. Raises ValueError for arrays that do not live in the cache,
    :class:`MappingRefusedError` if the kernel refuses the mapping.
    """
    found = origin_of(array)
    if found is None:
        raise ValueError("array does not live in the shmcache (open it with shmcache.open_array)")
    if not array.size:  # no bytes to map
        return np.zeros(array.shape, array.dtype)
    (root, version, filename, key), offset = found
    try:
        private, _, _, shift, _ = _map(root, version, filename, key, False, WRITABLE)
    except FileNotFoundError:
        raise KeyNotFoundError(
            f"entry {key!r} (version {version}) was replaced or evicted; open the key again"
        ) from None
    packed = packed_range(version) if "." in version.partition("/")[2] else None
    if packed is not None:  # ``offset`` is in the manifest; ``private`` maps from ``packed[2] - shift``
        offset -= packed[2] - shift
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
    offset -= mapping.file_start  # ``offset`` is in the file (a range mapping starts later)
    array = np.ndarray(shape, dtype, buffer=mapping, offset=offset, strides=strides)
    array.setflags(write=False)
    return array


_previous_reducer: Callable[[np.ndarray], Any] | None = None
_installed = False


def _reduce_ndarray(array: np.ndarray) -> Any:
    found = origin_of(array)
    if found is not None and array.size:  # an empty array goes by value
        origin, offset = found
        return _reattach, (
            *origin,
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
