"""Cross-process locks of a root: one per key (publish, evict, ``cache()``), one for
space accounting, and the root-wide publish lock that makes a multi-key publish
all-or-nothing for readers (exclusive while a batch swaps its links, shared while a reader
takes a snapshot of several links).

Each lock is one byte of a lock file under ``locks/``, locked with ``fcntl`` (F_SETLK):

- **No descriptor per key.** A key's lock is the byte at a 58-bit hash of the key in one
  of :data:`KEY_LOCK_FILES` files (``locks/key-slots.NN.lock``): a batch of 100,000 keys
  holds at most that many descriptors, whatever the open-file limit (one file per key, as
  before, ran out of descriptors at 1,024 files). Several files, not one: the kernel scans
  a file's whole list of locks on every lock, so 100,000 on one file cost minutes; spread
  over 32, about 3 s. So a batch with hundreds of keys in one file locks the whole file
  where no other process holds a byte of it (one lock, without waiting), then unlocks the
  gaps between its keys at once (:func:`key_locks`): about 0.5 s.
- **Released on death.** The kernel drops a process's locks when it exits, even by
  ``kill -9``; a fork does not inherit them (a DataLoader worker forked during a load does
  not keep the key locked after its parent dies, as it did an ``flock``).
- **The holder is known.** ``F_GETLK`` gives the pid of the process holding the lock, as
  this process's PID namespace numbers it (0 if invisible), from the kernel itself; a pid
  written in the lock file would go stale on a fork or a crash, and ``/proc/locks`` gives
  no pid for open-file-description locks and the creator's for an inherited ``flock``.
  So every wait is bounded and explained (:mod:`.lock_holders`): a holder that stays
  stopped (Ctrl+Z) fails its waiters in :data:`STOPPED_GRACE_S` with ``kill -CONT PID``;
  a running one is waited for up to ``timeout`` (:data:`DEFAULT_LOCK_TIMEOUT`, an hour:
  a ``cache()`` loader may legitimately run for many minutes); None waits forever.
- **Per thread.** fcntl locks belong to the process, so this module keeps, per lock, which
  threads hold it: a lock is reentrant per thread (``share()`` publishes under the key lock
  it holds) while another thread of the process waits for it as another process would.
  The process's lock on a byte is taken by the first holder and released by the last;
  a lock file stays open while any of its bytes is held or wanted (closing a descriptor
  would release every lock of the process on that file), and is closed after.

Waits poll (1 ms doubling to 50 ms): F_SETLKW cannot be bounded or interrupted to look at
the holder. Keys are taken in one order of their (file, byte) (:func:`key_locks`), so
two batches never deadlock, whatever version of shmcache each runs (a whole file counts
as all its bytes at once, and is never held during a wait); a hash collision (odds 2^-58
per pair) only makes two keys share a lock.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np

from .._disk.fs import (
    raise_if_full,
    range_lock_conflict,
    too_many_open_files,
    try_lock_range,
    unlock_range,
    unlock_ranges,
)
from .._disk.layout import Layout
from .lock_holders import STOPPED_GRACE_S, LockWait
from .timeouts import STORE_TIMEOUT, StoreTimeout

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "KEY_LOCK_FILES",
    "STOPPED_GRACE_S",
    "STORE_TIMEOUT",
    "WHOLE_FILE_KEYS",
    "StoreTimeout",
    "key_lock",
    "key_locks",
    "publish_lock",
    "snapshot_lock",
    "space_lock",
]

DEFAULT_LOCK_TIMEOUT = 3600.0
"""Seconds a wait on a running holder lasts by default: far beyond a legitimate hold (a
long ``cache()`` loader, a big put), so that only a hung holder (blocked in the kernel, or
waiting on something that never comes) reaches it. A stopped holder fails its waiters
after :data:`STOPPED_GRACE_S` whatever the bound."""

KEY_LOCK_FILES = 32
"""Lock files the key locks are spread over: the most descriptors a process holds for key
locks, whatever the number of keys."""

_POLL_FIRST_S = 0.001
_POLL_S = 0.05
_NARROWING_S = 1.0
"""How long a wait, even one that may not wait, polls past another process's whole-file
lock on a key-slot file: a batch holds one only while it unlocks the gaps between its
keys (17-71 ms a file at 100,000 keys on 2 busy cores)."""


@dataclass(slots=True)
class _Hold:
    """One locked byte in this process: who holds it, and whether the process has it yet."""

    shared: bool
    holders: dict[int, int]  # thread ident -> depth
    pending: bool = True  # its first holder is still taking the process's lock
    batch: bool = False  # one hold for the bytes a batch took through a whole file (copied on a nested take)
    copies: int = 0  # of a batch's hold: bytes given a hold of their own since


@dataclass
class _File:
    """A lock file open in this process: a read-only and/or a writable descriptor."""

    fds: dict[bool, int] = field(default_factory=dict)  # writable -> fd
    users: int = 0  # bytes held or being taken


Opener = Callable[[bool], int | None]
"""``opener(writable)``: a new descriptor of the lock file, or None when no lock is needed."""

_cond = threading.Condition(threading.Lock())
_slots: dict[tuple[str, int], _Hold] = {}
_files: dict[str, _File] = {}
_epoch = 0  # bumped in a forked child, which holds none of its parent's locks
_waiting = 0  # threads waiting on _cond for a lock another thread holds


def _wake() -> None:
    """Wake the threads waiting for a lock of this process (called holding ``_cond``)."""
    if _waiting:
        _cond.notify_all()


def _after_fork_in_child() -> None:
    global _cond, _slots, _files, _epoch, _waiting
    for file in _files.values():
        for fd in file.fds.values():
            with suppress(OSError):
                os.close(fd)  # the child's copy: the parent's locks stay the parent's
    _cond, _slots, _files = threading.Condition(threading.Lock()), {}, {}
    _epoch += 1
    _waiting = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _use_file(path: str, writable: bool, opener: Opener) -> int | None:
    """A descriptor of ``path`` fit for the lock (called holding ``_cond``)."""
    file = _files.get(path)
    fd = None if file is None else file.fds.get(writable, file.fds.get(True))
    if fd is None:
        fd = opener(writable)
        if fd is None:
            return None
        if file is None:
            file = _files[path] = _File()
        file.fds[writable] = fd
    assert file is not None
    file.users += 1
    return fd


def _drop_file(path: str, offset: int | None) -> None:
    """One user of ``path`` is done (called holding ``_cond``): unlock ``offset`` (if
    given), or close the file when it was the last, which releases everything at once."""
    file = _files[path]
    file.users -= 1
    if file.users == 0:
        del _files[path]
        for fd in file.fds.values():
            os.close(fd)
    elif offset is not None:
        unlock_range(next(iter(file.fds.values())), offset)


def _enter(path: str, offset: int, shared: bool, wait: _Waiting, opener: Opener) -> int | None:
    """Take byte ``offset`` of ``path`` for this thread; returns the epoch to release it
    with, or None when no lock was needed (``opener`` said so)."""
    global _waiting
    me = threading.get_ident()
    slot = (path, offset)
    with _cond:
        while True:
            hold = _slots.get(slot)
            if hold is None:
                fd = _use_file(path, not shared, opener)
                if fd is None:
                    return None
                hold = _slots[slot] = _Hold(shared, {me: 1})
                epoch = _epoch
                break
            if me in hold.holders:
                if shared or not hold.shared:  # nested (shared inside exclusive included)
                    if hold.batch:  # this byte's own hold from now on
                        hold.copies += 1
                        hold = _slots[slot] = _Hold(hold.shared, dict(hold.holders), False)
                    hold.holders[me] += 1
                    return _epoch
                raise RuntimeError(f"{wait.what}: this thread holds it shared and asked for it exclusive")
            if shared and hold.shared and not hold.pending:
                hold.holders[me] = 1
                return _epoch
            left = wait.waiting().left()
            if left is not None and left <= 0:
                raise wait.waiting().give_up_on_thread()
            _waiting += 1
            try:
                _cond.wait(_POLL_S if left is None else min(left, _POLL_S))
            finally:
                _waiting -= 1
    try:
        if not try_lock_range(fd, offset, shared):
            _take(fd, offset, shared, wait.waiting())
    except BaseException:
        with _cond:
            if epoch == _epoch:
                del _slots[slot]
                _drop_file(path, offset)  # no other thread of the process holds it: unlocking is safe
                _wake()
        raise
    with _cond:
        hold.pending = False
        _wake()
    return epoch


def _take(fd: int, offset: int, shared: bool, wait: LockWait) -> None:
    """This process's lock on the byte, polled until it is free or ``wait`` gives up. A
    whole-file lock in the way is a big batch narrowing to its own bytes (milliseconds:
    :func:`key_locks`): polled for up to :data:`_NARROWING_S` whatever the bound, so that a
    caller that does not wait (an eviction's ``timeout=0``) is not refused a key that the
    batch does not take."""
    pause = _POLL_FIRST_S
    narrowing_until = time.monotonic() + _NARROWING_S
    while not try_lock_range(fd, offset, shared):
        found = range_lock_conflict(fd, offset, shared)
        if found is None:
            continue  # released between the two calls
        pid, whole_file = found
        if whole_file and time.monotonic() < narrowing_until:
            time.sleep(_POLL_FIRST_S)
            continue
        wait.check(pid)
        left = wait.left()
        time.sleep(pause if left is None else max(0.0, min(pause, left)))
        pause = min(pause * 2, _POLL_S)


def _exit(path: str, offset: int, epoch: int) -> None:
    me = threading.get_ident()
    with _cond:
        if epoch != _epoch:
            return  # taken before this process forked: the child never held it
        slot = (path, offset)
        hold = _slots[slot]
        hold.holders[me] -= 1
        if hold.holders[me]:
            return
        del hold.holders[me]
        if not hold.holders:
            del _slots[slot]
            _drop_file(path, offset)
            _wake()


class _Waiting:
    """What a wait will need, built only when there is one (most locks are free)."""

    __slots__ = ("_wait", "timeout", "what")

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout, self.what = timeout, what
        self._wait: LockWait | None = None

    def waiting(self) -> LockWait:
        if self._wait is None:
            self._wait = LockWait(self.timeout, self.what)
        return self._wait


class _Locked:
    """One lock held for a ``with`` block (a class: a generator costs more than the lock)."""

    __slots__ = ("epoch", "offset", "opener", "path", "shared", "timeout", "what")

    def __init__(
        self, path: str, offset: int, shared: bool, timeout: float | None, what: str, opener: Opener
    ) -> None:
        self.path, self.offset, self.shared, self.opener = path, offset, shared, opener
        self.timeout, self.what = timeout, what
        self.epoch: int | None = None

    def __enter__(self) -> None:
        waiting = _Waiting(self.timeout, self.what)
        self.epoch = _enter(self.path, self.offset, self.shared, waiting, self.opener)

    def __exit__(self, *exc: object) -> None:
        if self.epoch is not None:
            _exit(self.path, self.offset, self.epoch)
            self.epoch = None


def _creating(path: str, layout: Layout) -> Opener:
    """Open (creating, with the root's file mode) a lock file in the root, writable or not."""
    mode = layout.file_mode

    def opener(writable: bool) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        except OSError as exc:  # out of inodes: CacheFullError; of descriptors: TooManyOpenFilesError
            raise_if_full(path, exc)
            raise

    return opener


# ---------------------------------------------------------------------- key locks


@functools.lru_cache(maxsize=64)
def _slot_files(layout: Layout) -> tuple[str, ...]:
    return tuple(layout.key_slot_file(i) for i in range(KEY_LOCK_FILES))


def _key_slot(layout: Layout, key: str) -> tuple[str, int]:
    """The lock file and byte of ``key``: a 64-bit hash, its low bits pick the file."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return _slot_files(layout)[digest % KEY_LOCK_FILES], digest >> 6


def _key_slots(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_key_slot` of each key as (file index, byte), sorted and each once (two keys
    may share a lock): a hash per key, the rest in numpy (a dict per key cost ~2x more)."""
    blake2b = hashlib.blake2b
    digests = np.frombuffer(b"".join([blake2b(key.encode(), digest_size=8).digest() for key in keys]), "<u8")
    files, offsets = digests % np.uint64(KEY_LOCK_FILES), digests >> np.uint64(6)
    order = np.lexsort((offsets, files))
    files, offsets = files[order], offsets[order]
    once = np.ones(len(files), dtype=bool)
    once[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1])
    return files[once].astype(np.intp), offsets[once]


def key_lock(layout: Layout, key: str, timeout: float | None) -> AbstractContextManager[None]:
    """The lock of one key; ``timeout`` bounds the wait on a running holder (None: no
    bound, 0: no wait); a holder stopped for :data:`STOPPED_GRACE_S` ends it sooner."""
    path, offset = _key_slot(layout, key)
    return _Locked(path, offset, False, timeout, f"the lock of key {key!r}", _creating(path, layout))


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
      one hold of ``_cond``, so no other thread of this process sees the file whole (its
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
            wait = _Waiting(timeout, f"the lock of key {batch.key(path, offset)!r}")
            epoch = _enter(path, offset, False, wait, _creating(path, layout))
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
        files, offsets = _key_slots(keys)
        paths = _slot_files(layout)
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
        return next(key for key in self.keys if _key_slot(self.layout, key) == (path, offset))

    def take_free(self) -> None:
        """Take the locks from ``next`` on, in order, while each is free in this process and
        in every other (no wait): a file with enough keys through the whole file where it
        can be, else byte by byte; stops at the first that is not free. What ``_enter``
        does for one lock, for many under one hold of ``_cond``."""
        me = threading.get_ident()
        openers: dict[str, Opener] = {}  # one per lock file, not one per key
        slots, i = self.slots, self.next
        with _cond:
            try:
                while i < len(slots):
                    path, offset = slots[i]
                    run = self.runs.get(path)
                    if run is not None and run[0] == i and path not in _files and self._take_whole(path, run):
                        i = run[1]
                        continue
                    if (path, offset) in _slots:
                        return
                    opener = openers.get(path)
                    if opener is None:
                        opener = openers[path] = _creating(path, self.layout)
                    fd = _use_file(path, True, opener)
                    assert fd is not None  # a writer's opener always opens
                    try:
                        free = try_lock_range(fd, offset, False)
                    except BaseException:
                        _drop_file(path, offset)
                        raise
                    if not free:
                        _drop_file(path, None)
                        return
                    _slots[path, offset] = _Hold(False, {me: 1}, pending=False)
                    self.taken.append((path, offset, _epoch))
                    i += 1
            finally:
                self.next = i

    def _take_whole(self, path: str, run: tuple[int, int]) -> bool:
        """Lock the bytes of ``slots[run[0]:run[1]]`` through the whole of ``path``, if no
        other process holds a byte of it (holding ``_cond``; this process holds none)."""
        fd = _use_file(path, True, _creating(path, self.layout))
        assert fd is not None
        try:
            free = try_lock_range(fd, 0, False, 0)
        except BaseException:
            _drop_file(path, None)  # its last user: closing releases whatever it got
            raise
        if not free:
            _drop_file(path, None)
            return False
        mine = self.slots[run[0] : run[1]]
        hold = _Hold(False, {threading.get_ident(): 1}, False, batch=True)  # one for them all
        try:
            _files[path].users += len(mine) - 1
            _slots.update(dict.fromkeys(mine, hold))
            self.whole.append((path, mine, hold, _epoch))
            _unlock_gaps(fd, [offset for _, offset in mine])
        except BaseException:  # Ctrl+C, MemoryError: forget it all and close the file, which
            for slot in mine:  # releases every lock on it (this process held none before)
                _slots.pop(slot, None)
            if self.whole and self.whole[-1][2] is hold:
                self.whole.pop()
            for held in _files.pop(path).fds.values():
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


_Whole = tuple[str, list[tuple[str, int]], _Hold, int]  # a whole file's bytes: path, slots, hold, epoch


def _exit_all(taken: list[tuple[str, int, int]], whole: list[_Whole]) -> None:
    """Release ``taken`` (each held once by this thread) and the bytes ``whole`` took
    through whole files (their shared hold): what ``_exit`` does for each, but a lock file
    this process no longer needs is closed (which releases all its bytes at once) rather
    than unlocked byte by byte."""
    me = threading.get_ident()
    with _cond:
        released: dict[str, list[int]] = {}
        for path, slots, hold, epoch in whole:
            if epoch != _epoch:
                continue  # taken before this process forked: the child never held it
            if hold.copies == 0:  # every byte still under the batch's hold: no look-up each
                deque(map(_slots.__delitem__, slots), maxlen=0)
                released.setdefault(path, []).extend([offset for _, offset in slots])
            else:
                taken = taken + [(*slot, epoch) for slot in slots]
        for path, offset, epoch in taken:
            if epoch != _epoch:
                continue  # taken before this process forked: the child never held it
            hold = _slots[path, offset]
            if hold.batch:  # a byte of a whole file that no nested take gave a hold of its own
                del _slots[path, offset]
                released.setdefault(path, []).append(offset)
                continue
            hold.holders[me] -= 1
            if hold.holders[me]:
                continue
            del hold.holders[me]
            if not hold.holders:
                del _slots[path, offset]
                released.setdefault(path, []).append(offset)
        for path, offsets in released.items():
            file = _files[path]
            file.users -= len(offsets)
            if file.users == 0:
                del _files[path]
                for fd in file.fds.values():
                    os.close(fd)
            else:
                fd = next(iter(file.fds.values()))
                unlock_ranges(fd, [(offset, 1) for offset in offsets])
        if released:
            _wake()


# ---------------------------------------------------------------------- root locks


def space_lock(layout: Layout, timeout: float | None) -> AbstractContextManager[None]:
    """The lock that serializes checking room and recording a reservation."""
    path = str(layout.space_lock)
    return _Locked(path, 0, False, timeout, "the space-accounting lock", _creating(path, layout))


def publish_lock(
    layout: Layout, *, shared: bool, timeout: float | None = DEFAULT_LOCK_TIMEOUT
) -> AbstractContextManager[None]:
    """The root-wide publish lock: exclusive while a multi-key publish swaps its links
    (microseconds per link), shared while a reader reads several links as one snapshot."""
    path = f"{layout.root}/locks/publish.lock"
    return _Locked(path, 0, shared, timeout, "the publish lock", _creating(path, layout))


def snapshot_lock(
    layout: Layout, timeout: float | None = DEFAULT_LOCK_TIMEOUT
) -> AbstractContextManager[None]:
    """The publish lock shared, for a reader reading several links as one set.

    A reader never needs to write: the lock file is opened read-only (a read lock needs no
    more; a cache mounted read-only into a pod stays readable). Where the file does not
    exist and cannot be created (no ``locks/`` yet, no inode left, a read-only mount,
    another user's root), no publisher could have created it either, so no batch publish
    is under way and the links are read without it."""
    path = f"{layout.root}/locks/publish.lock"
    return _Locked(path, 0, True, timeout, "the publish lock", _reader_opener(path, layout))


def _reader_opener(path: str, layout: Layout) -> Opener:
    def opener(writable: bool) -> int | None:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, layout.file_mode)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise too_many_open_files(exc, f"opening {path}") from exc
                if exc.errno not in _NO_LOCK_NEEDED:
                    raise
                return None
        except (NotADirectoryError, PermissionError):
            return None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise too_many_open_files(exc, f"opening {path}") from exc
            raise

    return opener


_NO_LOCK_NEEDED = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
)
"""Why a reader may fail to create the publish lock file, each meaning no publisher made it."""
