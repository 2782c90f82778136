"""The key locks of a batch (a directory put's thousands of keys): taken in the order of
their slots (file, then byte: two batches never deadlock), a lock file with many of them
through the whole file then narrowed to them, released together.

Several lock files, not one: the kernel scans a file's whole list of locks on every lock,
so 100,000 on one file cost minutes; spread over 32, about 3 s. So a batch with hundreds
of keys in one file locks the whole file where no other process holds a byte of it (one
lock, without waiting), then unlocks the gaps between its keys at once: about 0.5 s.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from .._disk.fs import try_lock_range, unlock_ranges
from .._disk.layout import Layout
from .key_slots import KEY_LOCK_FILES, key_slot, key_slots, slot_files
from .lock_table import TABLE, Hold, Opener, Waiting, creating, drop_file, enter, use_file, wake

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
      byte: locking it whole then narrowing would release that byte too."""
    batch = _Batch(layout, list(keys))
    try:
        while batch.next < len(batch.slots):
            batch.take_free()  # a directory put's thousands of keys: one pass, whole files
            if batch.next == len(batch.slots):
                break
            path, offset = batch.slots[batch.next]  # busy: wait for it, in order
            wait = Waiting(timeout, f"the lock of key {batch.key(path, offset)!r}")
            epoch = enter(path, offset, False, wait, creating(path, layout))
            assert epoch is not None
            batch.taken.append((path, offset, epoch))
            batch.next += 1
        yield
    finally:
        _exit_all(batch.taken, batch.whole)


class _Batch:
    """The key locks of one :func:`key_locks` call: its sorted slots, how far it got and
    what it holds."""

    def __init__(self, layout: Layout, keys: list[str]) -> None:
        self.layout, self.keys, self.next = layout, keys, 0
        files, offsets = key_slots(keys)
        paths = slot_files(layout)
        # sorted: by file (their names sort as their numbers), byte
        pairs = zip(files.tolist(), offsets.tolist(), strict=True)
        self.slots: list[tuple[str, int]] = [(paths[f], o) for f, o in pairs]
        self.taken: list[tuple[str, int, int]] = []  # (path, offset, epoch), in order
        self.whole: list[_Whole] = []
        self.runs: dict[str, tuple[int, int]] = {}  # file with enough keys -> their range in slots
        ends = np.cumsum(np.bincount(files, minlength=KEY_LOCK_FILES)).tolist()
        for path, start, end in zip(paths, [0, *ends[:-1]], ends, strict=True):
            if end - start >= WHOLE_FILE_KEYS:
                self.runs[path] = start, end

    def key(self, path: str, offset: int) -> str:
        """The key of one of the batch's slots (for a wait's messages)."""
        return next(key for key in self.keys if key_slot(self.layout, key) == (path, offset))

    def take_free(self) -> None:
        """Take the locks from ``next`` on, in order, while each is free in this process and
        in every other (no wait): a file with enough keys through the whole file where it
        can be, else byte by byte; stops at the first that is not free. What ``_enter``
        does for one lock, for many under one hold of ``TABLE.cond``."""
        me = threading.get_ident()
        openers: dict[str, Opener] = {}  # one per lock file, not one per key
        slots, i = self.slots, self.next
        with TABLE.cond:
            try:
                while i < len(slots):
                    path, offset = slots[i]
                    run = self.runs.get(path)
                    whole = run is not None and run[0] == i and path not in TABLE.files
                    if whole and run is not None and self._take_whole(path, run):
                        i = run[1]
                        continue
                    if (path, offset) in TABLE.slots:
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

    def _take_whole(self, path: str, run: tuple[int, int]) -> bool:
        """Lock the bytes of ``slots[run[0]:run[1]]`` through the whole of ``path``, if no
        other process holds a byte of it (holding ``TABLE.cond``; this process holds none)."""
        fd = use_file(path, True, creating(path, self.layout))
        assert fd is not None
        try:
            free = try_lock_range(fd, 0, False, 0)
        except BaseException:
            drop_file(path, None)  # its last user: closing releases whatever it got
            raise
        if not free:
            drop_file(path, None)
            return False
        mine = self.slots[run[0] : run[1]]
        hold = Hold(False, {threading.get_ident(): 1}, False, batch=True)  # one for them all
        try:
            TABLE.files[path].users += len(mine) - 1
            TABLE.slots.update(dict.fromkeys(mine, hold))
            self.whole.append((path, mine, hold, TABLE.epoch))
            _unlock_gaps(fd, [offset for _, offset in mine])
        except BaseException:  # Ctrl+C, MemoryError: forget it all and close the file, which
            for slot in mine:  # releases every lock on it (this process held none before)
                TABLE.slots.pop(slot, None)
            if self.whole and self.whole[-1][2] is hold:
                self.whole.pop()
            for held in TABLE.files.pop(path).fds.values():
                os.close(held)
            raise
        return True


def _unlock_gaps(fd: int, keep: list[int]) -> None:
    """Unlock all of the file but the bytes ``keep`` (sorted), highest gap first: each
    unlock then splits the process's first lock of the file and the kernel walks no
    further, where lowest first would walk every byte already kept."""
    if not keep:
        unlock_ranges(fd, [(0, 0)])
        return
    gaps = [(keep[-1] + 1, 0)]  # (offset, length; 0: to the end of the file)
    pairs = zip(keep[-2::-1], keep[:0:-1], strict=True)  # (byte, next byte kept), highest first
    gaps += [(low + 1, high - low - 1) for low, high in pairs if high > low + 1]
    if keep[0] > 0:
        gaps.append((0, keep[0]))
    unlock_ranges(fd, gaps)


_Whole = tuple[str, list[tuple[str, int]], Hold, int]  # a whole file's bytes: path, slots, hold, epoch


def _exit_all(taken: list[tuple[str, int, int]], whole: list[_Whole]) -> None:
    """Release ``taken`` (each held once by this thread) and the bytes ``whole`` took
    through whole files (their shared hold): what ``_exit`` does for each, but a lock file
    this process no longer needs is closed (which releases all its bytes at once) rather
    than unlocked byte by byte."""
    me = threading.get_ident()
    with TABLE.cond:
        released: dict[str, list[int]] = {}
        for path, slots, hold, epoch in whole:
            if epoch != TABLE.epoch:
                continue  # taken before this process forked: the child never held it
            if hold.copies == 0:  # every byte still under the batch's hold: no look-up each
                deque(map(TABLE.slots.__delitem__, slots), maxlen=0)
                released.setdefault(path, []).extend([offset for _, offset in slots])
            else:
                taken = taken + [(*slot, epoch) for slot in slots]
        for path, offset, epoch in taken:
            if epoch != TABLE.epoch:
                continue  # taken before this process forked: the child never held it
            hold = TABLE.slots[path, offset]
            if hold.batch:  # a byte of a whole file that no nested take gave a hold of its own
                del TABLE.slots[path, offset]
                released.setdefault(path, []).append(offset)
                continue
            hold.holders[me] -= 1
            if hold.holders[me]:
                continue
            del hold.holders[me]
            if not hold.holders:
                del TABLE.slots[path, offset]
                released.setdefault(path, []).append(offset)
        for path, offsets in released.items():
            file = TABLE.files[path]
            file.users -= len(offsets)
            if file.users == 0:
                del TABLE.files[path]
                for fd in file.fds.values():
                    os.close(fd)
            else:
                fd = next(iter(file.fds.values()))
                unlock_ranges(fd, [(offset, 1) for offset in offsets])
        if released:
            wake()

