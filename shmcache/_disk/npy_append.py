"""A ``.npy`` file written piece by piece when its length is known only at the end (a table
column decoded one Parquet row group or Arrow record batch at a time): nothing of the
column is held in memory beyond the piece being written.

numpy pads every header so that the first dimension's digits do not change its length
(``GROWTH_AXIS_MAX_DIGITS``): the header for ``(0, *tail)`` is as long as the final one,
so the data is written after as many zero bytes and the real header over them at the end
(until then the file has no ``.npy`` magic: one never finished fails to load, loudly). The
CRC-32 of the file (header first) is chained from the data's own with ``crc32_combine``.

No descriptor is held between appends (each opens the file with ``O_APPEND``): a table of
a thousand column files is written under the usual limit of open files.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .checksum import crc32, crc32_combine
from .fs import write_all
from .npy import NpyHeader, build_header, parse_header_bytes

__all__ = ["NpyAppender"]


class NpyAppender:
    """Appends arrays of one dtype and one shape past the first axis to a new ``.npy`` file
    at ``fd`` (created empty by the caller; closed here, once its header's room is written;
    later writes reopen ``path``); :meth:`finish` writes the header and returns the file's
    CRC-32 and header, as ``writer.write_npy`` does."""

    def __init__(self, fd: int, path: str, dtype: np.dtype[Any], tail: tuple[int, ...] = ()) -> None:
        self.path = path
        self.dtype, self.tail = np.dtype(dtype), tuple(tail)
        self.rows = 0
        self.nbytes = 0
        self._crc = 0
        try:
            self._header_bytes = len(build_header(self.dtype, (0, *self.tail), False))
            write_all(fd, bytes(self._header_bytes), path)  # its page allocated now; no magic yet
        finally:
            os.close(fd)

    def append(self, array: np.ndarray) -> None:
        """Write ``array``'s items after those appended before."""
        if array.dtype != self.dtype or tuple(array.shape[1:]) != self.tail or array.ndim == 0:
            raise ValueError(
                f"{self.path}: cannot append {array.dtype}{array.shape} to {self.dtype}{self.tail}"
            )
        if array.size:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            fd = -1
            try:  # opened inside: an interrupt right after the open still closes it
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                write_all(fd, data, self.path)
            finally:
                if fd >= 0:
                    os.close(fd)
            self._crc = crc32(data.data, self._crc)
            self.nbytes += data.nbytes
        self.rows += int(array.shape[0])

    def finish(self) -> tuple[int, NpyHeader]:
        """Write the header for the rows appended; returns the file's CRC-32 and its header."""
        header = build_header(self.dtype, (self.rows, *self.tail), False)
        if len(header) != self._header_bytes:  # numpy pads the first axis to 21 digits: never
            raise AssertionError(f"{self.path}: .npy header grew from {self._header_bytes} to {len(header)}")
        fd = -1
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # not O_APPEND: Linux's pwrite would append
            if os.pwrite(fd, header, 0) != len(header):
                raise OSError(f"{self.path}: short write of the .npy header")
        finally:
            if fd >= 0:
                os.close(fd)
        crc = crc32_combine(crc32(header), self._crc, self.nbytes)
        return crc, NpyHeader(*parse_header_bytes(header, len(header), self.path))
