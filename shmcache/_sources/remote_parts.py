"""The parts of a remote load: one ranged read (its length checked, a backend's errors
typed), bytes written at their offsets, the bound on the bytes held at once, and the
checksums of a staging file whose parts arrive in any order (``remote``'s fetch uses all)."""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._disk.fs import full_is_cache_full
from ..errors import CorruptSourceError, InvalidSourceError, ShmCacheError, SourceNotFoundError
from .remote_plan import RemoteItem
from .urls import scrub

__all__ = [
    "SPAN_GAP",
    "ByteBudget",
    "Span",
    "TrailingHash",
    "object_spans",
    "pwrite_all",
    "read_range",
    "remote_errors",
]

_HASH_CHUNK = 1 << 20
SPAN_GAP = 1 << 20
"""Bytes between two ranges of one object read rather than split into two requests."""

Span = tuple[int, int, list[Any]]
"""``(start, end, items)``: one ranged read of an object, and the range items it fills."""


def read_range(
    fs: Any, obj: RemoteItem, start: int, end: int, secrets: list[str], where: str | None = None
) -> bytes:
    """Bytes ``start:end`` of ``obj`` by one ranged read (none for an empty range). Fewer
    bytes than asked means the object was truncated or replaced since it was listed:
    :class:`CorruptSourceError` naming ``where`` (default: the object's redacted URL)."""
    if end <= start:
        return b""
    with remote_errors(obj.url, secrets):
        data = fs.cat_file(obj.path, start=start, end=end)
    if len(data) != end - start:
        raise CorruptSourceError(
            f"{where or obj.url}: bytes {start}-{end} came back as {len(data)} (it was truncated or "
            "changed while loading); nothing was published, load it again"
        )
    return data  # type: ignore[no-any-return]


@contextmanager
def remote_errors(where: str, secrets: list[str]) -> Iterator[None]:
    """A backend's exceptions as typed errors naming ``where`` (the redacted URL), with any
    secret scrubbed from their text and their chain dropped (it may quote credentials)."""
    try:
        yield
    except ShmCacheError:
        raise
    except FileNotFoundError:
        raise SourceNotFoundError(f"{where} does not exist") from None
    except PermissionError as exc:
        raise InvalidSourceError(
            f"{where}: access denied ({scrub(str(exc), secrets)}); check the credentials "
            "(the filesystem's standard chain: environment, config files, instance role; or storage options)"
        ) from None
    except Exception as exc:
        raise InvalidSourceError(
            f"{where} could not be read: {type(exc).__name__}: {scrub(str(exc), secrets)}"
        ) from None


def object_spans(items: Sequence[Any], part: Callable[[int], int]) -> list[Span]:
    """The ranged reads that fetch every byte range of one object's ``items`` (each with
    ``offset`` and ``range_bytes``): ranges closer than ``SPAN_GAP`` are read
    together, and what is read is split into parts of ``part(bytes of the ranges)``. A
    checkpoint of many tensors then costs a request per part, not one per tensor (a store
    that charges per request, or, like moto, copies the object for every request, pays it)."""
    ranges = [(i.offset, i.offset + i.range_bytes, i) for i in items if i.range_bytes]
    ranges.sort(key=lambda r: (r[0], r[1]))
    if not ranges:
        return []
    size = part(sum(end - start for start, end, _ in ranges))
    extents: list[tuple[int, int]] = []
    for start, end, _ in ranges:
        if extents and start - extents[-1][1] <= SPAN_GAP:
            extents[-1] = (extents[-1][0], max(extents[-1][1], end))
        else:
            extents.append((start, end))
    spans: list[Span] = []
    for low, high in extents:
        for start in range(low, high, size):
            end = min(start + size, high)
            filled = [i for lo, hi, i in ranges if lo < end and hi > start]
            if filled:  # (a part inside a gap between ranges is not read)
                spans.append((start, end, filled))
    return spans


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
