"""This process's record of the lock bytes it holds, and the take and release of one byte.

fcntl locks belong to the process, so this module keeps, per lock, which threads hold it:
a lock is reentrant per thread (``share()`` publishes under the key lock it holds) while
another thread of the process waits for it as another process would. The process's lock
on a byte is taken by the first holder and released by the last; a lock file stays open
while any of its bytes is held or wanted (closing a descriptor would release every lock
of the process on that file), and is closed after. A fork starts the child with an empty
record: it holds none of its parent's locks.

A batch's bytes taken through a whole lock file (:mod:`.lock_batches`: thousands of them)
are one record, a :class:`Run` (their sorted offsets, looked up by bisection), not one per
byte; a byte of it that its thread takes again (``share()`` inside the batch) gets a
:class:`Hold` of its own from then on.

Waits poll (1 ms doubling to 50 ms): F_SETLKW cannot be bounded or interrupted to look at
the holder (:mod:`.lock_holders` names it and says when to give up).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from .._disk.fs import raise_if_full, range_lock_conflict, try_lock_range, unlock_range
from .._disk.layout import Layout
from .lock_holders import LockWait

__all__ = [
    "TABLE",
    "Hold",
    "LockFile",
    "Locked",
    "Opener",
    "Run",
    "Waiting",
    "creating",
    "drop_file",
    "enter",
    "exit_one",
    "holds",
    "use_file",
    "wake",
]

_POLL_FIRST_S = 0.001
_POLL_S = 0.05
_NARROWING_S = 1.0
"""How long a wait, even one that may not wait, polls past another process's whole-file
lock on a key-slot file: a batch holds one only while it unlocks the gaps between its
keys (17-71 ms a file at 100,000 keys on 2 busy cores)."""


@dataclass(slots=True)
class Hold:
    """One locked byte in this process: who holds it, and whether the process has it yet."""

    shared: bool
    holders: dict[int, int]  # thread ident -> depth
    pending: bool = True  # its first holder is still taking the process's lock


@dataclass(slots=True)
class Run:
    """The bytes of one lock file a batch took through the whole file, held exclusive by
    one thread: one record for them all (one user of the file), its offsets sorted."""

    offsets: np.ndarray  # int64, sorted, each once
    owner: int  # thread ident
    epoch: int
    own: list[int] = field(default_factory=list)  # bytes given a Hold of their own since (nested takes)

    def has(self, offset: int) -> bool:
        at = int(self.offsets.searchsorted(offset))
        return at < len(self.offsets) and int(self.offsets[at]) == offset


@dataclass
class LockFile:
    """A lock file open in this process: a read-only and/or a writable descriptor."""

    fds: dict[bool, int] = field(default_factory=dict)  # writable -> fd
    users: int = 0  # bytes held or being taken (a run counts once)
    run: Run | None = None  # at most one: a batch locks a file whole only where none of it is held


Opener = Callable[[bool], int | None]
"""``opener(writable)``: a new descriptor of the lock file, or None when no lock is needed."""


class _Table:
    """The process's record (one, :data:`TABLE`): what is held, by which threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.slots: dict[tuple[str, int], Hold] = {}
        self.files: dict[str, LockFile] = {}
        self.epoch = 0  # bumped in a forked child, which holds none of its parent's locks
        self.waiting = 0  # threads waiting on cond for a lock another thread holds

    def after_fork_in_child(self) -> None:
        for file in self.files.values():
            for fd in file.fds.values():
                with suppress(OSError):
                    os.close(fd)  # the child's copy: the parent's locks stay the parent's
        self.cond, self.slots, self.files = threading.Condition(threading.Lock()), {}, {}
        self.epoch += 1
        self.waiting = 0


TABLE = _Table()
os.register_at_fork(after_in_child=TABLE.after_fork_in_child)


def wake() -> None:
    """Wake the threads waiting for a lock of this process (called holding ``TABLE.cond``)."""
    if TABLE.waiting:
        TABLE.cond.notify_all()


def holds(path: str, offset: int) -> bool:
    """Whether a thread of this process holds byte ``offset`` of ``path`` or is taking it
    (called holding ``TABLE.cond``)."""
    return (path, offset) in TABLE.slots or _run_at(path, offset) is not None


def _run_at(path: str, offset: int) -> Run | None:
    """The run holding byte ``offset`` of ``path``, if one does (holding ``TABLE.cond``)."""
    file = TABLE.files.get(path)
    run = None if file is None else file.run
    return run if run is not None and run.has(offset) else None


def use_file(path: str, writable: bool, opener: Opener) -> int | None:
    """A descriptor of ``path`` fit for the lock (called holding ``TABLE.cond``)."""
    file = TABLE.files.get(path)
    fd = None if file is None else file.fds.get(writable, file.fds.get(True))
    if fd is None:
        fd = opener(writable)
        if fd is None:
            return None
        if file is None:
            file = TABLE.files[path] = LockFile()
        file.fds[writable] = fd
    assert file is not None
    file.users += 1
    return fd


def drop_file(path: str, offset: int | None) -> None:
    """One user of ``path`` is done (called holding ``TABLE.cond``): unlock ``offset`` (if
    given), or close the file when it was the last, which releases everything at once."""
    file = TABLE.files[path]
    file.users -= 1
    if file.users == 0:
        del TABLE.files[path]
        for fd in file.fds.values():
            os.close(fd)
    elif offset is not None:
        unlock_range(next(iter(file.fds.values())), offset)


def enter(path: str, offset: int, shared: bool, wait: Waiting, opener: Opener) -> int | None:
    """Take byte ``offset`` of ``path`` for this thread; returns the epoch to release it
    with, or None when no lock was needed (``opener`` said so)."""
    me = threading.get_ident()
    slot = (path, offset)
    table = TABLE
    with table.cond:
        while True:
            hold = table.slots.get(slot)
            if hold is None:
                run = _run_at(path, offset)
                if run is None:
                    fd = use_file(path, not shared, opener)
                    if fd is None:
                        return None
                    hold = table.slots[slot] = Hold(shared, {me: 1})
                    epoch = table.epoch
                    break
                if run.owner == me:  # nested in this thread's batch: the byte's own hold from now on
                    run.own.append(offset)
                    table.slots[slot] = Hold(False, {me: 2}, pending=False)  # the run's depth and this
                    return table.epoch
            elif me in hold.holders:
                if shared or not hold.shared:  # nested (shared inside exclusive included)
                    hold.holders[me] += 1
                    return table.epoch
                raise RuntimeError(f"{wait.what}: this thread holds it shared and asked for it exclusive")
            elif shared and hold.shared and not hold.pending:
                hold.holders[me] = 1
                return table.epoch
            left = wait.waiting().left()
            if left is not None and left <= 0:
                raise wait.waiting().give_up_on_thread()
            table.waiting += 1
            try:
                table.cond.wait(_POLL_S if left is None else min(left, _POLL_S))
            finally:
                table.waiting -= 1
    try:
        if not try_lock_range(fd, offset, shared):
            _take(fd, offset, shared, wait.waiting())
    except BaseException:
        with table.cond:
            if epoch == TABLE.epoch:
                del table.slots[slot]
                drop_file(path, offset)  # no other thread of the process holds it: unlocking is safe
                wake()
        raise
    with table.cond:
        hold.pending = False
        wake()
    return epoch


def _take(fd: int, offset: int, shared: bool, wait: LockWait) -> None:
    """This process's lock on the byte, polled until it is free or ``wait`` gives up. A
    whole-file lock in the way is a big batch narrowing to its own bytes (milliseconds:
    :func:`.lock_batches.key_locks`): polled for up to :data:`_NARROWING_S` whatever the
    bound, so that a caller that does not wait (an eviction's ``timeout=0``) is not refused
    a key that the batch does not take."""
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


def exit_one(path: str, offset: int, epoch: int) -> None:
    """This thread lets go of byte ``offset`` of ``path`` taken by :func:`enter`."""
    me = threading.get_ident()
    table = TABLE
    with table.cond:
        if epoch != table.epoch:
            return  # taken before this process forked: the child never held it
        slot = (path, offset)
        hold = table.slots[slot]
        hold.holders[me] -= 1
        if hold.holders[me]:
            return
        del hold.holders[me]
        if not hold.holders:
            del table.slots[slot]
            drop_file(path, offset)
            wake()


class Waiting:
    """What a wait will need, built only when there is one (most locks are free)."""

    __slots__ = ("_wait", "timeout", "what")

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout, self.what = timeout, what
        self._wait: LockWait | None = None

    def waiting(self) -> LockWait:
        if self._wait is None:
            self._wait = LockWait(self.timeout, self.what)
        return self._wait


class Locked:
    """One lock held for a ``with`` block (a class: a generator costs more than the lock)."""

    __slots__ = ("epoch", "offset", "opener", "path", "shared", "timeout", "what")

    def __init__(
        self, path: str, offset: int, shared: bool, timeout: float | None, what: str, opener: Opener
    ) -> None:
        self.path, self.offset, self.shared, self.opener = path, offset, shared, opener
        self.timeout, self.what = timeout, what
        self.epoch: int | None = None

    def __enter__(self) -> None:
        waiting = Waiting(self.timeout, self.what)
        self.epoch = enter(self.path, self.offset, self.shared, waiting, self.opener)

    def __exit__(self, *exc: object) -> None:
        if self.epoch is not None:
            exit_one(self.path, self.offset, self.epoch)
            self.epoch = None


def creating(path: str, layout: Layout) -> Opener:
    """Open (creating, with the root's file mode) a lock file in the root, writable or not."""
    mode = layout.file_mode

    def opener(writable: bool) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        except OSError as exc:  # out of inodes: CacheFullError; of descriptors: TooManyOpenFilesError
            raise_if_full(path, exc)
            raise

    return opener
