"""Change counters that let every process keep warm opens without asking the disk.

The ``generation`` file (see ``layout``) is a table of 8-byte slots: slot 0 changes on
any publish or evict in the root, slot ``generation_slot(key)`` when that key changes.
Readers map it read-only and compare one slot (tens of nanoseconds); writers rewrite
slots with ``pwrite`` (never through a mapping) with fresh random bytes, so concurrent
writers need no read-modify-write.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Iterable

from .layout import GENERATION_SLOTS, Layout

__all__ = [
    "CHANGING",
    "bump_all_generations",
    "bump_generations",
    "key_generation_slots",
    "map_generations",
    "mark_changing",
]

CHANGING = 1 << 63
"""A slot value at or above this: a directory put is switching the key (``mark_changing``);
readers do not keep what they open then. Settled values stay below it."""
_SETTLED = CHANGING - 1


def map_generations(layout: Layout) -> tuple[memoryview, int] | None:
    """The generation table mapped read-only (``memoryview`` of uint64) and the file's
    inode, or None if the root has none yet (nothing was ever published there)."""
    try:
        fd = os.open(layout.generation, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_size < 8 * GENERATION_SLOTS:
            return None  # being created, or written by an older version (prepare grows it)
        table = memoryview(mmap.mmap(fd, 8 * GENERATION_SLOTS, prot=mmap.PROT_READ)).cast("Q")
        return table, st.st_ino
    finally:
        os.close(fd)


def bump_generations(layout: Layout, keys: Iterable[str], slots: frozenset[int] | None = None) -> None:
    """Record that ``keys`` changed (and so the root did); ``slots``: theirs, computed
    already (:func:`key_generation_slots`: a directory put marks and bumps the same ones)."""
    _write_slots(layout, {0, *(key_generation_slots(keys) if slots is None else slots)}, 0)


def mark_changing(layout: Layout, keys: Iterable[str], slots: frozenset[int] | None = None) -> None:
    """Record that ``keys`` are about to switch together: until ``bump_generations``
    settles their slots, a reader opens them from the disk and keeps nothing, so a writer
    that dies between switching and bumping leaves no process with some of them warm and
    old while it opens the others new. ``slots``: as for :func:`bump_generations`."""
    _write_slots(layout, set(key_generation_slots(keys) if slots is None else slots), CHANGING)


def key_generation_slots(keys: Iterable[str]) -> frozenset[int]:
    """``{generation_slot(key) for key in keys}`` without a call per key (a directory put
    marks and bumps 100,000 keys)."""
    crc, modulo = zlib.crc32, GENERATION_SLOTS - 1
    return frozenset({1 + crc(key.encode("utf-8", "surrogatepass")) % modulo for key in keys})


def _write_slots(layout: Layout, slots: set[int] | frozenset[int], flag: int) -> None:
    """Fresh random values (with ``flag``) in ``slots``: one ``pwrite`` per run of adjacent
    slots (a directory put of thousands of keys touches nearly every slot: a few writes)."""
    ordered = sorted(slots)
    noise = os.urandom(8 * len(ordered))
    values = [
        (int.from_bytes(noise[8 * i : 8 * i + 8], "little") & _SETTLED | flag).to_bytes(8, "little")
        for i in range(len(ordered))
    ]
    fd = os.open(layout.generation, os.O_WRONLY | os.O_CLOEXEC)
    try:
        start = 0
        for end in range(1, len(ordered) + 1):
            if end == len(ordered) or ordered[end] != ordered[end - 1] + 1:
                os.pwrite(fd, b"".join(values[start:end]), 8 * ordered[start])
                start = end
    finally:
        os.close(fd)


def bump_all_generations(layout: Layout) -> None:
    """Record that any key may have changed (after a writer died between switching links
    and bumping their slots: every process's warm opens go back to the disk once)."""
    fd = os.open(layout.generation, os.O_WRONLY | os.O_CLOEXEC)
    try:
        values = [int.from_bytes(os.urandom(8), "little") & _SETTLED for _ in range(GENERATION_SLOTS)]
        os.pwrite(fd, b"".join(v.to_bytes(8, "little") for v in values), 0)
    finally:
        os.close(fd)
