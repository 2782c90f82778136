"""Checksums recorded at put time, so ``verify`` can tell a damaged entry.

CRC-32 (zlib, several GB/s, releases the GIL on large buffers). A file's checksum covers
all of its bytes, header included. Entries store ``"crc32:<name>=<hex>,..."``.
"""

from __future__ import annotations

import os
import threading
import zlib

__all__ = ["BackgroundCrc", "crc_of_range", "format_checksums", "parse_checksums"]

_CHUNK = 16 << 20


def crc_of_range(fd: int, offset: int, count: int, crc: int = 0) -> int:
    """CRC-32 of ``count`` bytes of ``fd`` from ``offset``, read with ``pread`` (never
    through a mapping: a file truncated meanwhile must not SIGBUS us)."""
    buffer = bytearray(min(_CHUNK, max(count, 1)))
    view = memoryview(buffer)
    end = offset + count
    while offset < end:
        got = os.preadv(fd, [view[: min(len(buffer), end - offset)]], offset)
        if got == 0:
            raise EOFError(f"file ended at byte {offset}, expected {end}")
        crc = zlib.crc32(view[:got], crc)
        offset += got
    return crc


class BackgroundCrc:
    """Checksum a file range on another thread while the kernel copies it."""

    def __init__(self, path: str, offset: int, count: int) -> None:
        self.value: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path, offset, count), daemon=True)
        self._thread.start()

    def _run(self, path: str, offset: int, count: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.value = crc_of_range(fd, offset, count)
            finally:
                os.close(fd)
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> int:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


def format_checksums(crcs: dict[str, int]) -> str:
    return "crc32:" + ",".join(f"{name}={crcs[name]:08x}" for name in sorted(crcs))


def parse_checksums(text: str) -> dict[str, int]:
    algorithm, _, rest = text.partition(":")
    if algorithm != "crc32" or not rest:
        raise ValueError(f"unknown checksum format {text!r}")
    return {name: int(value, 16) for name, value in (part.split("=", 1) for part in rest.split(","))}
