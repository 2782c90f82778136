"""Writing new versions into ``tmp/`` and publishing them with one atomic rename (of a
link for one key, of a prefix directory for several: ``entry_tree``).

A writer holds an flock on ``tmp/<writer>.lock`` for as long as it works; the kernel
drops it if the writer dies (even by ``kill -9``), which is how ``cleanup`` tells the
partial files of dead writers from those of live ones.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .array_parts import ArrayParts
from .checksum import crc32
from .entry_tree import build_tree, install_tree, make_prefix_dirs
from .fs import full_is_cache_full, raise_if_full, remove_tree, write_all
from .layout import META_FILE, Layout
from .npy import NpyHeader, build_header, parse_header_bytes

__all__ = ["STAGING_SUFFIX", "BatchEntries", "VersionWriter", "write_npy", "writer_of"]

STAGING_SUFFIX = ".lock.new"
_ROWS_BYTES = 16 << 20  # chunk size when a non-contiguous array must be copied to write
_PIPELINE_CHUNK = 8 << 20  # write() one chunk while another thread CRCs the one before
_PIPELINE_MIN = 4 * _PIPELINE_CHUNK  # smaller arrays: one thread (a thread costs ~100 us)


def writer_of(name: str) -> str:
    """Writer id of a ``tmp/`` or ``objects/`` name (``<writer>.<n>[.link]`` or ``<writer>.lock``)."""
    return name.split(".", 1)[0]


class VersionWriter:
    """Creates version directories in ``tmp/`` under a writer lock; a context manager.

    On an exception every unpublished version of this writer is removed. Running out of
    space or inodes while creating anything (lock, directory, file, link) is a
    :class:`~shmcache.errors.CacheFullError`.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.writer_id = f"{time.time_ns():x}-{os.getpid()}-{os.urandom(4).hex()}"
        self._count = 0
        self._tmp = f"{layout.root}/tmp"  # strings: pathlib costs ~10 us a join, per file
        self._objects = f"{layout.root}/objects"
        self._dir_mode, self._file_mode = layout.modes
        self._pending: dict[str, None] = {}  # insertion-ordered set: O(1) removal
        self._old_trees: list[str] = []  # prefix directories swapped out, to remove
        # Lock under a temporary name, then rename: the lock file never appears unlocked.
        staging = layout.tmp / f"{self.writer_id}{STAGING_SUFFIX}"
        with full_is_cache_full(staging):
            self._lock_fd = os.open(
                staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, layout.file_mode
            )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self.lock_path = layout.tmp / f"{self.writer_id}.lock"
            os.rename(staging, self.lock_path)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def reserve(self, nbytes: int) -> None:
        """Record the bytes this writer is about to write (counted against the budget)."""
        with full_is_cache_full(self.lock_path):
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, str(nbytes).encode(), 0)

    def new_version(self) -> str:
        """Create ``tmp/<version>/`` and return the version name."""
        self._count += 1
        version = f"{self.writer_id}.{self._count}"
        self._mkdir(f"{self._tmp}/{version}")
        self._pending[version] = None
        return version

    def new_batch(self) -> str:
        """Create ``tmp/<batch>/``, the one version directory of a directory put, and return
        its name; its entries are packed into its manifest (``manifest.ManifestWriter``) or
        made with :meth:`batch_entries` / :meth:`new_batch_entry`."""
        return self.new_version()

    def new_batch_entry(self, batch: str, index: int) -> str:
        """Create entry ``index``'s directory in ``tmp/<batch>/``; returns its version
        ``<batch>/<index>`` (files are created in it as in any version)."""
        version = f"{batch}/{index}"
        self._mkdir(f"{self._tmp}/{version}")
        return version

    def batch_entries(self, batch: str) -> BatchEntries:
        """The entries of batch ``batch`` made relative to its directory (a context manager):
        the many-file alternative to :meth:`new_batch_entry` and :meth:`create_file`."""
        return BatchEntries(f"{self._tmp}/{batch}", batch, self._dir_mode, self._file_mode)

    def _mkdir(self, path: str) -> None:
        """A version's (or a batch entry's) directory; a full file system is CacheFullError."""
        try:
            os.mkdir(path, self._dir_mode)
        except OSError as exc:
            raise_if_full(path, exc)
            raise

    def make_dir(self, version: str, name: str) -> None:
        """An empty directory ``name`` in the version being written."""
        self._mkdir(str(self.path(version, name)))

    def path(self, version: str, filename: str) -> Path:
        return Path(f"{self._tmp}/{version}/{filename}")

    def create_file(self, version: str, filename: str) -> int:
        path = f"{self._tmp}/{version}/{filename}"
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._file_mode)
        except OSError as exc:
            raise_if_full(path, exc)
            raise

    def write_array(
        self, version: str, filename: str, array: np.ndarray | ArrayParts
    ) -> tuple[int, NpyHeader]:
        """Write ``array`` as a ``.npy`` file with ``write()`` (never through a mapping);
        returns the CRC-32 of the file's bytes and its header as a reader will parse it."""
        fd = self.create_file(version, filename)
        try:
            return write_npy(fd, self.path(version, filename), array)
        finally:
            os.close(fd)

    def write_meta(self, version: str, meta: dict[str, Any]) -> None:
        fd = self.create_file(version, META_FILE)
        try:
            write_all(fd, json.dumps(meta).encode(), f"{self._tmp}/{version}/{META_FILE}")
        finally:
            os.close(fd)

    def promote(self, version: str) -> None:
        """Move a finished version from ``tmp/`` to ``objects/`` (still unreferenced)."""
        os.rename(f"{self._tmp}/{version}", f"{self._objects}/{version}")

    def link(self, key: str, version: str) -> None:
        """Point ``key``'s entry link at a promoted ``version`` with one atomic rename: a
        reader sees the old version or the new one, never a partial one. The caller holds
        the publish lock shared (``swap_link``)."""
        self.swap_link(key, version, self.stage_link(version, key))

    def stage_link(self, version: str, key: str) -> str:
        """Create the link of ``key`` to ``version`` in ``tmp/`` (what may run out of
        inodes), so that publishing it is one rename."""
        staged = f"{self._tmp}/{version}.link"
        try:
            os.symlink(self.layout.link_target(version, key), staged)
        except OSError as exc:
            raise_if_full(staged, exc)
            raise
        return staged

    def swap_link(self, key: str, version: str, staged: str) -> None:
        """Rename a staged link over ``key``'s entry link (atomic for readers), creating
        its prefix directories first if needed. The caller holds the publish lock shared,
        so that no directory put is copying the prefix meanwhile."""
        link = self.layout.entry_link(key)
        try:
            os.replace(staged, link)
        except FileNotFoundError:  # a prefix directory is missing (the first key under it)
            if not os.path.lexists(staged):
                raise
            make_prefix_dirs(self.layout, key.rpartition("/")[0])
            os.replace(staged, link)
        self.mark_published(version)

    def swap_tree(
        self,
        prefix: str,
        versions: Sequence[tuple[str, str]],
        check: Callable[[dict[str, str]], None] | None = None,
        batch: str | None = None,
    ) -> dict[str, str]:
        """Make every ``(key, version)`` under ``prefix`` current at one instant: copy the
        prefix's directory into ``tmp/`` with the new links, exchange it with the live one
        (``entry_tree``), then remove the old copy. Returns key -> the version each new
        link replaced (keys that had an entry). ``check(replaced)`` runs before the
        exchange; what it raises publishes nothing. The caller holds the publish lock
        exclusive until this returns; a crash leaves the old tree or the new one whole, and
        the copy in ``tmp/`` for ``cleanup``. ``batch``: the one batch every version is an
        entry of (a directory put), marked published once."""
        self._count += 1
        staging = f"{self._tmp}/{self.writer_id}.{self._count}.tree"
        # Layout.link_target of each, without a call each (a directory put links 100,000):
        # what climbs out of the key's prefix directories, made once per depth
        climbs = {depth: "../" * (depth + 1) + "objects/" for depth in range(8)}
        links = [
            (key, (climbs.get(key.count("/")) or self.layout.link_target("", key)) + version)
            for key, version in versions
        ]
        try:
            replaced = build_tree(self.layout, prefix, staging, links)
            if check is not None:
                check(replaced)
            install_tree(self.layout, prefix, staging)
        except BaseException:
            remove_tree(Path(staging))
            raise
        for version in [batch] if batch is not None else [version for _, version in versions]:
            self.mark_published(version)
        self._old_trees.append(staging)
        return replaced

    def remove_old_trees(self) -> None:
        """Remove the trees that ``swap_tree`` swapped out (outside the publish lock:
        nobody reaches them any more, except a reader's walk already inside, which then
        misses and reads the link again)."""
        while self._old_trees:
            remove_tree(Path(self._old_trees.pop()))

    def mark_published(self, version: str) -> None:
        """The version is referenced by an entry link now: no longer ours to discard (an
        entry ``<batch>/<n>``: its whole batch)."""
        self._pending.pop(version.partition("/")[0], None)

    def discard(self, version: str) -> None:
        """Remove a version of this writer, wherever it is."""
        remove_tree(self.layout.tmp / version)
        remove_tree(self.layout.objects / version)
        self._pending.pop(version, None)

    def close(self) -> None:
        self.remove_old_trees()
        for version in list(self._pending):
            self.discard(version)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self._tmp}/{version}.link")
        try:
            os.unlink(self.lock_path)  # before unlocking: never an unlocked live lock file
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BatchEntries:
    """Creates the entries of one batch version (``<batch>/<n>/`` and their files) relative
    to a descriptor of the batch's directory: no path walk from ``/`` per entry and no path
    built unless an error names one (at 100,000 entries, the paths and their ``Path``
    objects cost more than the ``mkdir`` and ``open`` themselves). Same modes and errors as
    :class:`VersionWriter`'s own methods."""

    def __init__(self, directory: str, batch: str, dir_mode: int, file_mode: int) -> None:
        self.directory = directory
        self.batch = batch
        self._dir_mode, self._file_mode = dir_mode, file_mode
        self._fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def new_entry(self, index: int) -> str:
        """Create entry ``index``'s directory; returns its version ``<batch>/<index>``."""
        try:
            os.mkdir(str(index), self._dir_mode, dir_fd=self._fd)
        except OSError as exc:
            raise_if_full(self.path(index), exc)
            raise
        return f"{self.batch}/{index}"

    def create_file(self, index: int, filename: str) -> int:
        """Create ``filename`` in entry ``index`` for writing (it must not exist)."""
        try:
            return os.open(
                f"{index}/{filename}",
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                self._file_mode,
                dir_fd=self._fd,
            )
        except OSError as exc:
            raise_if_full(self.path(index, filename), exc)
            raise

    def path(self, index: int, filename: str = "") -> str:
        """The path of entry ``index`` (or of its file ``filename``), for messages."""
        return f"{self.directory}/{index}/{filename}" if filename else f"{self.directory}/{index}"

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> BatchEntries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_npy(
    fd: int, path: str | os.PathLike[str], array: np.ndarray | ArrayParts
) -> tuple[int, NpyHeader]:
    """Write ``array`` as a whole ``.npy`` file at ``fd``'s position with ``write()``;
    returns the CRC-32 of the bytes written and the header as a reader will parse it
    (``path`` names the file in errors). An :class:`ArrayParts` is written part after part."""
    if isinstance(array, ArrayParts):
        header = build_header(array.dtype, array.shape, False)
        write_all(fd, header, Path(path))
        parts = (p.reshape(-1).view(np.uint8) for p in array.parts)
        crc = _write_chunks(fd, Path(path), parts, crc32(header)) if array.nbytes else crc32(header)
        return crc, NpyHeader(*parse_header_bytes(header, len(header), str(path)))
    fortran = bool(array.flags.f_contiguous and not array.flags.c_contiguous)
    header = build_header(array.dtype, array.shape, fortran)
    parsed = NpyHeader(*parse_header_bytes(header, len(header), str(path)))
    write_all(fd, header, Path(path))
    crc = crc32(header)
    if array.size == 0 or array.dtype.itemsize == 0:
        return crc, parsed
    flat = array.T if fortran else array
    if flat.ndim == 0 or flat.flags.c_contiguous:
        chunks: Iterable[np.ndarray] = [flat]
    else:
        rows = max(1, _ROWS_BYTES // max(1, flat[0].nbytes))
        chunks = (np.ascontiguousarray(flat[i : i + rows]) for i in range(0, flat.shape[0], rows))
    return _write_chunks(fd, Path(path), (c.reshape(-1).view(np.uint8) for c in chunks), crc), parsed


def _write_chunks(fd: int, path: Path, chunks: Iterable[np.ndarray], crc: int) -> int:
    """Write ``chunks`` (uint8) to ``fd``; return the CRC-32 of the bytes written, chained
    from ``crc``. Large data is cut into pieces and pipelined: this thread ``write()``s
    piece k while a helper CRCs piece k-1 (both release the GIL), so the checksum costs
    little beyond the write. The CRC is of the very buffers written (an :class:`ArrayParts` of a source's
    mapping is read again for it: its source is checked unchanged after the write)."""
    pieces = (
        piece[i : i + _PIPELINE_CHUNK]
        for piece in chunks
        for i in range(0, max(len(piece), 1), _PIPELINE_CHUNK)
        if len(piece)
    )
    first = [p for _, p in zip(range(4), pieces, strict=False)]
    if sum(len(p) for p in first) < _PIPELINE_MIN:
        for piece in itertools.chain(first, pieces):
            write_all(fd, piece, path)
            crc = crc32(piece.data, crc)
        return crc
    state = {"crc": crc}
    ready = threading.Semaphore(0)
    room = threading.Semaphore(4)  # pieces written but not yet checksummed (copies, if strided)
    queue: collections.deque[np.ndarray | None] = collections.deque()

    def checksum() -> None:
        value = state["crc"]
        while True:
            ready.acquire()
            piece = queue.popleft()
            if piece is None:
                state["crc"] = value
                return
            value = crc32(piece.data, value)
            room.release()

    helper = threading.Thread(target=checksum, name="shmcache-crc", daemon=True)
    helper.start()
    try:
        for piece in itertools.chain(first, pieces):
            write_all(fd, piece, path)
            room.acquire()
            queue.append(piece)
            ready.release()
    finally:
        queue.append(None)
        ready.release()
        helper.join()
    return state["crc"]
