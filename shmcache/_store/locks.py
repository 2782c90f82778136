"""Cross-process locks of a root: one per key (publish, evict, ``cache()``), one for
space accounting, in separate namespaces (``layout``) so that no key shares the root's
lock, and the root-wide publish lock that makes a multi-key publish all-or-nothing for
readers (``publish.lock``: exclusive while a batch swaps its links, shared while a reader
takes a snapshot of several links).

``flock`` on a file under ``locks/``: the kernel releases it when the holder dies, even by
``kill -9``. Compatible with ``filelock``'s Unix locks (also ``flock``), which earlier
versions used; ours cost ~5 us instead of ~400 us, which matters for a directory of a
thousand files. Within a process a lock is reentrant per thread (as ``filelock``'s
singletons were): ``share()`` publishes under the key lock it already holds, while another
thread of the same process waits for it like another process would.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from .._disk.fs import full_is_cache_full
from .._disk.layout import Layout, encode_key
from ..errors import LockTimeoutError

__all__ = ["key_lock", "key_locks", "publish_lock", "snapshot_lock", "space_lock"]

_POLL_S = 0.05  # how often a bounded wait retries a taken lock
_held: dict[tuple[str, int, bool], list[int]] = {}  # (path, thread, shared) -> [fd, depth]


@contextmanager
def _flocked(path: str | Path, timeout: float | None, what: str, shared: bool = False) -> Iterator[None]:
    """Hold an flock on ``path`` (created if missing); ``timeout`` None waits forever,
    0 does not wait. Reentrant within one thread."""
    slot = (str(path), threading.get_ident(), shared)
    held = _held.get(slot)
    if held is not None:
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
        return
    with full_is_cache_full(path):  # creating the lock file can run out of inodes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, timeout, what)
    except BaseException:
        os.close(fd)
        raise
    _held[slot] = [fd, 1]
    try:
        yield
    finally:
        del _held[slot]
        os.close(fd)  # drops the flock


def _acquire(fd: int, mode: int, timeout: float | None, what: str) -> None:
    if timeout is None:
        fcntl.flock(fd, mode)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeoutError(
                    f"gave up after {timeout:g} s waiting for the lock on {what} held by another "
                    "process; raise the timeout, or look for a stuck loading process"
                ) from None
            time.sleep(min(_POLL_S, left))


def key_lock(layout: Layout, key: str, timeout: float | None) -> AbstractContextManager[None]:
    """The lock of one key; ``timeout`` None waits forever, 0 does not wait."""
    return _flocked(f"{layout.root}/locks/keys/{encode_key(key)}.lock", timeout, f"key {key!r}")


@contextmanager
def key_locks(layout: Layout, keys: Iterable[str], timeout: float | None) -> Iterator[None]:
    """The locks of several keys, taken in sorted order (two batches never deadlock)."""
    with ExitStack() as stack:
        for key in sorted(set(keys)):
            stack.enter_context(key_lock(layout, key, timeout))
        yield


def space_lock(layout: Layout, timeout: float | None) -> AbstractContextManager[None]:
    """The lock that serializes checking room and recording a reservation."""
    return _flocked(layout.space_lock, timeout, "space accounting")


def publish_lock(layout: Layout, *, shared: bool) -> AbstractContextManager[None]:
    """The root-wide publish lock: exclusive while a multi-key publish swaps its links
    (microseconds per link), shared while a reader reads several links as one snapshot."""
    return _flocked(f"{layout.root}/locks/publish.lock", None, "publishing", shared)


@contextmanager
def snapshot_lock(layout: Layout) -> Iterator[None]:
    """The publish lock shared, for a reader reading several links as one set.

    A reader never needs to write: the lock file is opened read-only (``flock`` works on
    such a descriptor; a cache mounted read-only into a pod stays readable). Where the file
    does not exist and cannot be created (no ``locks/`` yet, no inode left, a read-only
    mount, another user's root), no publisher could have created it either, so no batch
    publish is under way and the links are read without it."""
    path = f"{layout.root}/locks/publish.lock"
    slot = (path, threading.get_ident(), True)
    if slot in _held:  # this thread holds it shared already
        yield
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in _NO_LOCK_NEEDED:
                raise
            yield
            return
    except (NotADirectoryError, PermissionError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # drops the flock


_NO_LOCK_NEEDED = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
)
"""Why a reader may fail to create the publish lock file, each meaning no publisher made it."""
