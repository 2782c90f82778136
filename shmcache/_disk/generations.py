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
from collections.abc import Iterable

from .layout import GENERATION_SLOTS, Layout, generation_slot

__all__ = ["bump_all_generations", "bump_generations", "map_generations"]


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


def bump_generations(layout: Layout, keys: Iterable[str]) -> None:
    """Record that ``keys`` changed (and so the root did)."""
    slots = {generation_slot(key) for key in keys}
    slots.add(0)
    fd = os.open(layout.generation, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for slot in sorted(slots):
            os.pwrite(fd, os.urandom(8), 8 * slot)
    finally:
        os.close(fd)


def bump_all_generations(layout: Layout) -> None:
    """Record that any key may have changed (after a writer died between switching links
    and bumping their slots: every process's warm opens go back to the disk once)."""
    fd = os.open(layout.generation, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, os.urandom(8 * GENERATION_SLOTS), 0)
    finally:
        os.close(fd)
