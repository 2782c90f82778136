"""The key locks of a batch (a directory put's thousands of keys): taken in the order of
their slots (file, then byte: two batches never deadlock), a lock file with many of them
through the whole file then narrowed to them, released together.

Several lock files, not one: the kernel scans a file's whole list of locks on every lock,
so 100,000 on one file cost minutes; spread over 32, about 3 s. So a batch with hundreds
of keys in one file locks the whole file where no other process holds a byte of it (one
lock, without waiting), then unlocks the gaps between its keys at once: about 0.2 s of
CPU for 100,000 keys, a third of it their hashes (the root's format) and most of the rest
one ``fcntl`` per gap (the kernel has no call that unlocks several ranges).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from .._disk.fs import try_lock_range, unlock_all_but, unlock_ranges
from .._disk.layout import Layout
from .key_slots import KEY_LOCK_FILES, key_slot, key_slots, slot_files
from .lock_table import TABLE, Hold, Opener, Run, Waiting, creating, drop_file, enter, holds, use_file, wake

__all__ = ["WHOLE_FILE_KEYS", "key_locks"]

WHOLE_FILE_KEYS = 256
"""A batch with at least this many keys in one lock file locks them through the whole file
(:func:`key_locks`). The kernel walks the file's list of locks on every new lock (not on an
unlock): the n-th byte costs ~n x 18 ns on top of ~1 us of fixed cost (a ``fcntl`` from
Python), so at 256 bytes a file the walk has grown to the fixed cost (2.1 us a lock,
measured) and from there on it dominates (3,125 a file, a batch of 100,000 keys: 20 us a
lock), while the whole file costs one lock and an unlock (~2 us) per key. Below, the
gain is a fraction of a millisecond a file."""


@contextmanager
def key_locks(layout: Layout, keys: Iterable[str], timeout: float | None) -> Iterator[None]:
    """The locks of several keys, taken in the order of their slots (file, then byte: two
    batches never deadlock) and released together.

    The order is part of the root's format: every version that writes a root must take
    them alike, or an older and a newer batch could wait on each other. (Taking each
    file's bytes highest first halves the kernel's cost of placing 100,000 locks, but
    would change that order: not done.)

    **Whole files, then their bytes.** Where the batch has :data:`WHOLE_FILE_KEYS` keys or
    more in one lock file and this process holds no byte of it, it tries, at that file's
    place in the order, one write lock on the whole file (offset 0 to its end) without
    waiting, and at once unlocks the gaps between its keys' bytes, highest first (an
    unlock does not walk the list of locks, and a split at the front stops there): it then
    holds exactly the bytes it would have locked one by one, in linear instead of quadratic
    time. Where another process holds any byte of the file, the try fails and the file's
    bytes are taken one by one, as before (waiting, with the holder named, where one is
    taken). This keeps every promise of the byte locks:

    - *No deadlock, with any version.* A whole file is all its bytes taken at once at
      their place in the order, and the batch never waits while it holds one (the try
      does not wait; the narrowing does not either). So a waiter at (file, byte), of
      whatever version, still holds only locks before it, and none of them cycle.
    - *Others see what they saw.* Another process sees the whole file only for the few
      milliseconds of its narrowing: a try fails then, naming the batch's pid
      (``F_GETLK``), and a waiter's next poll finds its key free unless the batch has
      it. During the publish, unrelated keys of the file stay free (a ``cache()`` on one
      starts, an eviction takes it).
    - *Threads see what they saw.* The lock, the narrowing and each key's slot happen in
      one hold of ``TABLE.cond``, so no other thread of this process sees the file whole (its
      fcntl would succeed on any byte: locks of one process never conflict). A file this
      process already holds a byte of, or is taking one (another thread, or this one
      around the batch: ``share()`` publishes under its key's lock), is taken byte by
      byte: locking it whole then narrowing would release that byte too. The bytes a
      batch took through a whole file are one record (:class:`.lock_table.Run`), which
      other threads look up by bisection.

    **Released together.** A lock file this process then no longer needs is closed (which
    releases all its bytes at once); one it still holds other bytes of has everything
    else unlocked, one call per byte it keeps (or per byte released, where fewer)."""
    batch = _Batch(layout, list(keys))
    try:
        while batch.next < batch.count:
            batch.take_free()  # a directory put's thousands of keys: one pass, whole files
            if batch.next == batch.count:
                break
            path, offset = batch.slot(batch.next)  # busy: wait for it, in order
            wait = Waiting(timeout, f"the lock of key {batch.key(path, offset)!r}")
            epoch = enter(path, offset, False, wait, creating(path, layout))
            assert epoch is not None
            batch.taken.append((path, offset, epoch))
            batch.next += 1
        yield
    finally:
        _exit_all(batch.taken, batch.whole)


class _Batch:
    """The key locks of one :func:`key_locks` call: its sorted slots (arrays: no Python
    object per key unless a file is taken byte by byte), how far it got and what it holds."""

    def __init__(self, layout: Layout, keys: list[str]) -> None:
        self.layout, self.keys, self.next = layout, keys, 0
        files, offsets = key_slots(keys)  # sorted: by file (their names sort as their numbers), byte
        self.files, self.offsets = files, offsets.astype(np.int64)  # 58-bit: int64 compares with ints
        self.count = len(files)
        self.paths = slot_files(layout)
        self.taken: list[tuple[str, int, int]] = []  # (path, offset, epoch), in order
        self.whole: list[tuple[str, Run]] = []
        self._listed: tuple[list[int], list[int]] | None = None
        ends = np.cumsum(np.bincount(files, minlength=KEY_LOCK_FILES)).tolist()
        self.ranges = list(zip([0, *ends[:-1]], ends, strict=True))  # each file's slots: [start, end)

    def slot(self, i: int) -> tuple[str, int]:
        """The ``i``-th slot in order: (lock file, byte)."""
        if self._listed is None:
            self._listed = self.files.tolist(), self.offsets.tolist()
        files, offsets = self._listed
        return self.paths[files[i]], offsets[i]

    def key(self, path: str, offset: int) -> str:
        """The key of one of the batch's slots (for a wait's messages)."""
        return next(key for key in self.keys if key_slot(self.layout, key) == (path, offset))

    def take_free(self) -> None:
        """Take the locks from ``next`` on, in order, while each is free in this process and
        in every other (no wait): a file with enough keys through the whole file where it
        can be, else byte by byte; stops at the first that is not free. What ``enter``
        does for one lock, for many under one hold of ``TABLE.cond``."""
        me = threading.get_ident()
        openers: dict[str, Opener] = {}  # one per lock file, not one per key
        i = self.next
        with TABLE.cond:
            try:
                while i < self.count:
                    index = int(self.files[i])
                    start, end = self.ranges[index]
                    if i == start and end - start >= WHOLE_FILE_KEYS:
                        path = self.paths[index]
                        if path not in TABLE.files and self._take_whole(path, start, end):
                            i = end
                            continue
                    path, offset = self.slot(i)
                    if holds(path, offset):
                        return
                    opener = openers.get(path)
                    if opener is None:
                        opener = openers[path] = creating(path, self.layout)
                    fd = use_file(path, True, opener)
                    assert fd is not None  # a writer's opener always opens
                    try:
                        free = try_lock_range(fd, offset, False)
                    except BaseException:
                        drop_file(path, offset)
                        raise
                    if not free:
                        drop_file(path, None)
                        return
                    TABLE.slots[path, offset] = Hold(False, {me: 1}, pending=False)
                    self.taken.append((path, offset, TABLE.epoch))
                    i += 1
            finally:
                self.next = i

    def _take_whole(self, path: str, start: int, end: int) -> bool:
        """Lock the bytes of slots ``start`` to ``end`` through the whole of ``path``, if no
        other process holds a byte of it (holding ``TABLE.cond``; this process holds none)."""
        fd = use_file(path, True, creating(path, self.layout))  # the run's one use of the file
        assert fd is not None
        try:
            free = try_lock_range(fd, 0, False, 0)
        except BaseException:
            drop_file(path, None)  # its last user: closing releases whatever it got
            raise
        if not free:
            drop_file(path, None)
            return False
        run = Run(self.offsets[start:end], threading.get_ident(), TABLE.epoch)
        file = TABLE.files[path]
        file.run = run
        self.whole.append((path, run))
        try:
            unlock_all_but(fd, run.offsets)
        except BaseException:  # Ctrl+C, MemoryError: forget it and close the file, which
            self.whole.pop()  # releases every lock on it (this process held none before)
            del TABLE.files[path]
            for held in file.fds.values():
                os.close(held)
            raise
        return True


def _exit_all(taken: list[tuple[str, int, int]], whole: list[tuple[str, Run]]) -> None:
    """Release ``taken`` (each held once by this thread) and the runs ``whole`` took
    through whole files: what ``exit_one`` does for each byte, but a lock file this process
    no longer needs is closed (which releases all its bytes at once) rather than unlocked
    byte by byte."""
    me = threading.get_ident()
    with TABLE.cond:
        released = False
        for path, run in whole:
            if run.epoch != TABLE.epoch:
                continue  # taken before this process forked: the child never held it
            _release_run(path, run, me)
            released = True
        freed: dict[str, list[int]] = {}
        for path, offset, epoch in taken:
            if epoch != TABLE.epoch:
                continue  # taken before this process forked: the child never held it
            hold = TABLE.slots[path, offset]
            hold.holders[me] -= 1
            if hold.holders[me]:
                continue
            del hold.holders[me]
            if not hold.holders:
                del TABLE.slots[path, offset]
                freed.setdefault(path, []).append(offset)
        for path, offsets in freed.items():
            file = TABLE.files[path]
            file.users -= len(offsets)
            if file.users == 0:
                _close(path)
            else:
                unlock_ranges(next(iter(file.fds.values())), [(offset, 1) for offset in offsets])
        if released or freed:
            wake()


def _release_run(path: str, run: Run, me: int) -> None:
    """Let go of a run's bytes (holding ``TABLE.cond``): a byte a nested take of this thread
    still holds stays, with a use of the file of its own; the file is closed if nothing
    else of it is held, else all of it but what is held is unlocked."""
    file = TABLE.files[path]
    file.run = None
    for offset in run.own:
        hold = TABLE.slots[path, offset]
        hold.holders[me] -= 1
        if hold.holders[me] == 0:
            del hold.holders[me]
        if hold.holders:
            file.users += 1  # held on by a nested take that outlives the batch
        else:
            del TABLE.slots[path, offset]
    file.users -= 1
    if file.users == 0:
        _close(path)
        return
    fd = next(iter(file.fds.values()))
    kept = np.array(sorted(offset for held, offset in TABLE.slots if held == path), np.int64)
    if len(kept) < len(run.offsets):
        unlock_all_but(fd, kept)  # the other bytes this process holds or is taking stay
    else:
        mine = run.offsets[~np.isin(run.offsets, kept)]
        unlock_ranges(fd, [(offset, 1) for offset in mine.tolist()])


def _close(path: str) -> None:
    """Close a lock file no byte of which is held (holding ``TABLE.cond``): the kernel
    releases whatever the process still had of it."""
    for fd in TABLE.files.pop(path).fds.values():
        os.close(fd)
