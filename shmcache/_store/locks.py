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
  gaps between its keys at once (:func:`key_locks`): about 0.2 s of CPU for 100,000 keys.
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
- **Per thread.** fcntl locks belong to the process, so :mod:`.lock_table` keeps, per lock, which
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

This module gives the locks by name; :mod:`.key_slots` maps a key to its byte,
:mod:`.lock_table` records what this process holds, :mod:`.lock_batches` takes a batch's.
"""

from __future__ import annotations

import errno
import os
from contextlib import AbstractContextManager

from .._disk.fs import too_many_open_files
from .._disk.layout import Layout
from .key_slots import KEY_LOCK_FILES, key_slot, lock_path
from .lock_batches import WHOLE_FILE_KEYS, key_locks
from .lock_holders import STOPPED_GRACE_S
from .lock_table import Locked, Opener, creating
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


def key_lock(layout: Layout, key: str, timeout: float | None) -> AbstractContextManager[None]:
    """The lock of one key; ``timeout`` bounds the wait on a running holder (None: no
    bound, 0: no wait); a holder stopped for :data:`STOPPED_GRACE_S` ends it sooner."""
    path, offset = key_slot(layout, key)
    return Locked(path, offset, False, timeout, f"the lock of key {key!r}", creating(path, layout))


# ---------------------------------------------------------------------- root locks


def space_lock(layout: Layout, timeout: float | None) -> AbstractContextManager[None]:
    """The lock that serializes checking room and recording a reservation."""
    path = lock_path(str(layout.space_lock))
    return Locked(path, 0, False, timeout, "the space-accounting lock", creating(path, layout))


def publish_lock(
    layout: Layout, *, shared: bool, timeout: float | None = DEFAULT_LOCK_TIMEOUT
) -> AbstractContextManager[None]:
    """The root-wide publish lock: exclusive while a multi-key publish swaps its links
    (microseconds per link), shared while a reader reads several links as one snapshot."""
    path = lock_path(f"{layout.root}/locks/publish.lock")
    return Locked(path, 0, shared, timeout, "the publish lock", creating(path, layout))


def snapshot_lock(
    layout: Layout, timeout: float | None = DEFAULT_LOCK_TIMEOUT
) -> AbstractContextManager[None]:
    """The publish lock shared, for a reader reading several links as one set.

    A reader never needs to write: the lock file is opened read-only (a read lock needs no
    more; a cache mounted read-only into a pod stays readable). Where the file does not
    exist and cannot be created (no ``locks/`` yet, no inode left, a read-only mount,
    another user's root), no publisher could have created it either, so no batch publish
    is under way and the links are read without it."""
    path = lock_path(f"{layout.root}/locks/publish.lock")
    return Locked(path, 0, True, timeout, "the publish lock", _reader_opener(path, layout))


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
