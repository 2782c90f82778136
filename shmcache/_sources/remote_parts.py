"""The parts of a remote load: bytes written at their offsets, the bound on the bytes held
at once, and the checksums of a staging file whose parts arrive in any order (``remote``'s
fetch uses all three)."""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._disk.fs import full_is_cache_full

__all__ = ["ByteBudget", "TrailingHash", "pwrite_all"]

_HASH_CHUNK = 1 << 20


def pwrite_all(path: Path, data: bytes | memoryview, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        with full_is_cache_full(path):
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
    finally:
        os.close(fd)


class ByteBudget:
    """At most ``limit`` bytes of parts held at once (one part alone may exceed it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = threading.Condition()

    @contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        with self._changed:
            while self.used and self.used + nbytes > self.limit:
                self._changed.wait()
            self.used += nbytes
        try:
            yield
        finally:
            with self._changed:
                self.used -= nbytes
                self._changed.notify_all()


class TrailingHash:
    """CRC-32 (and MD5) of a staging file whose parts arrive in any order: each finished
    part is recorded, and whichever thread finds the next part in file order hashes it and
    every following finished one (reading back what was just written, still in cache)."""

    def __init__(self, path: Path, want_md5: bool) -> None:
        self.path = path
        self.size = -1  # set once the header says how many bytes the array file has
        self._lock = threading.Lock()
        self._finished: dict[int, int] = {}
        self._next = 0
        self._busy = False
        self._crc = 0
        self._md5 = hashlib.md5(usedforsecurity=False) if want_md5 else None

    def done(self, start: int, end: int, data: memoryview | None = None) -> None:
        """Record bytes ``start:end`` as written (``data``: those bytes, hashed from memory
        when they are next in order, instead of read back)."""
        with self._lock:
            self._finished[start] = end
            if self._busy:
                return
            self._busy = True
        try:
            while True:
                with self._lock:
                    end = self._finished.pop(self._next, -1)
                    if end < 0:
                        self._busy = False
                        return
                if data is not None and self._next == start:
                    self._update(data)
                else:
                    self._hash(self._next, end)
                self._next = end
        except BaseException:
            with self._lock:
                self._busy = False
            raise

    def _hash(self, start: int, end: int) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while start < end:
                chunk = os.pread(fd, min(_HASH_CHUNK, end - start), start)
                if not chunk:
                    raise EOFError(f"{self.path} ended at byte {start}")
                self._update(chunk)
                start += len(chunk)
        finally:
            os.close(fd)

    def _update(self, data: bytes | memoryview) -> None:
        self._crc = zlib.crc32(data, self._crc)
        if self._md5 is not None:
            self._md5.update(data)

    def result(self) -> tuple[int, str | None]:
        if self._next != self.size:  # every part was fetched, so this is a bug
            raise RuntimeError(f"{self.path}: hashed {self._next} of {self.size} bytes")
        return self._crc, None if self._md5 is None else self._md5.hexdigest()
