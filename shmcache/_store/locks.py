"""Cross-process locks of a root: one per key (publish, evict, ``cache()``), one for
space accounting, in separate namespaces (``layout``) so that no key shares the root's
lock. flock-based (``filelock``): the kernel releases them when the holder dies, even
by ``kill -9``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from .._disk.fs import full_is_cache_full
from .._disk.layout import Layout
from ..errors import LockTimeoutError

__all__ = ["key_lock", "space_lock"]


@contextmanager
def _acquired(lock: FileLock, timeout: float | None, what: str) -> Iterator[None]:
    wait = -1 if timeout is None else timeout
    try:
        with full_is_cache_full(lock.lock_file):  # creating the lock file can run out of inodes
            lock.acquire(timeout=wait)
    except FileLockTimeout:
        raise LockTimeoutError(
            f"gave up after {wait:g} s waiting for the lock on {what} held by another "
            "process; raise the timeout, or look for a stuck loading process"
        ) from None
    try:
        yield
    finally:
        lock.release()


def key_lock(layout: Layout, key: str, timeout: float | None) -> AbstractContextManager[None]:
    """The lock of one key; ``timeout`` None waits forever, 0 does not wait."""
    lock = FileLock(layout.key_lock(key), mode=0o600, is_singleton=True)
    return _acquired(lock, timeout, f"key {key!r}")


def space_lock(layout: Layout, timeout: float | None) -> AbstractContextManager[None]:
    """The lock that serializes checking room and recording a reservation."""
    lock = FileLock(layout.space_lock, mode=0o600, is_singleton=True)
    return _acquired(lock, timeout, "space accounting")
