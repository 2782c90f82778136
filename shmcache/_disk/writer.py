"""Writing new versions into ``tmp/`` and publishing them with one atomic rename.

A writer holds an flock on ``tmp/<writer>.lock`` for as long as it works; the kernel
drops it if the writer dies (even by ``kill -9``), which is how ``cleanup`` tells the
partial files of dead writers from those of live ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .fs import full_is_cache_full, remove_tree, write_all
from .layout import META_FILE, Layout
from .npy import NpyHeader, build_header, parse_header_bytes

__all__ = ["STAGING_SUFFIX", "VersionWriter", "writer_of"]

STAGING_SUFFIX = ".lock.new"
_ROWS_BYTES = 16 << 20  # chunk size when a non-contiguous array must be copied to write


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
        self.writer_id = f"{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(4)}"
        self._count = 0
        self._pending: list[str] = []
        # Lock under a temporary name, then rename: the lock file never appears unlocked.
        staging = layout.tmp / f"{self.writer_id}{STAGING_SUFFIX}"
        with full_is_cache_full(staging):
            self._lock_fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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
        with full_is_cache_full(self.layout.tmp / version):
            os.mkdir(self.layout.tmp / version, 0o700)
        self._pending.append(version)
        return version

    def path(self, version: str, filename: str) -> Path:
        return self.layout.tmp / version / filename

    def create_file(self, version: str, filename: str) -> int:
        path = self.path(version, filename)
        with full_is_cache_full(path):
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def write_array(self, version: str, filename: str, array: np.ndarray) -> tuple[int, NpyHeader]:
        """Write ``array`` as a ``.npy`` file with ``write()`` (never through a mapping);
        returns the CRC-32 of the file's bytes and its header as a reader will parse it."""
        path = self.path(version, filename)
        fortran = bool(array.flags.f_contiguous and not array.flags.c_contiguous)
        fd = self.create_file(version, filename)
        try:
            header = build_header(array.dtype, array.shape, fortran)
            parsed = NpyHeader(*parse_header_bytes(header, len(header), str(path)))
            write_all(fd, header, path)
            crc = zlib.crc32(header)
            if array.size == 0 or array.dtype.itemsize == 0:
                return crc, parsed
            flat = array.T if fortran else array
            if flat.ndim == 0 or flat.flags.c_contiguous:
                chunks: Iterable[np.ndarray] = [flat]
            else:
                rows = max(1, _ROWS_BYTES // max(1, flat[0].nbytes))
                chunks = (np.ascontiguousarray(flat[i : i + rows]) for i in range(0, flat.shape[0], rows))
            for chunk in chunks:
                data = chunk.reshape(-1).view(np.uint8)
                write_all(fd, data, path)
                crc = zlib.crc32(data.data, crc)
            return crc, parsed
        finally:
            os.close(fd)

    def write_meta(self, version: str, meta: dict[str, Any]) -> None:
        fd = self.create_file(version, META_FILE)
        try:
            write_all(fd, json.dumps(meta, indent=1).encode(), self.path(version, META_FILE))
        finally:
            os.close(fd)

    def promote(self, version: str) -> None:
        """Move a finished version from ``tmp/`` to ``objects/`` (still unreferenced)."""
        os.rename(self.layout.tmp / version, self.layout.objects / version)

    def link(self, key: str, version: str) -> None:
        """Point ``key``'s entry link at a promoted ``version`` with one atomic rename: a
        reader sees the old version or the new one, never a partial one."""
        staged = self.layout.tmp / f"{version}.link"
        with full_is_cache_full(staged):
            os.symlink(self.layout.link_target(version), staged)
        os.replace(staged, self.layout.entry_link(key))
        self.mark_published(version)

    def mark_published(self, version: str) -> None:
        """The version is referenced by an entry link now: no longer ours to discard."""
        self._pending.remove(version)

    def discard(self, version: str) -> None:
        """Remove a version of this writer, wherever it is."""
        remove_tree(self.layout.tmp / version)
        remove_tree(self.layout.objects / version)
        if version in self._pending:
            self._pending.remove(version)

    def close(self) -> None:
        for version in list(self._pending):
            self.discard(version)
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
