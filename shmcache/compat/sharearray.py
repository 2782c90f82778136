"""A drop-in for python-sharearray's ``cache``/``free``, built on the shmcache store.

Scripts written against ``sharearray`` keep their calls and gain what the original
lacks: atomic publish (no partial array after a crash), a lock that dies with its
holder (``kill -9`` never blocks the next run), and arrays that pickle by reference.

Ids may use ``[A-Za-z0-9=+._-]`` as in sharearray; they live in a store rooted at
``<shm_path>/<prefix>shmcache-<uid>``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .._store import Store
from ..errors import InvalidKeyError, KeyNotFoundError, LockTimeoutError

__all__ = ["TimeoutException", "cache", "free", "valid_id"]

TimeoutException = LockTimeoutError
"""sharearray's name for a lock wait that timed out."""

_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789=+._-")
_KEY_CHARS = _ID_CHARS - {"=", "+"}


def valid_id(id: str) -> bool:
    """Whether ``id`` is a valid sharearray id (``[A-Za-z0-9=+._-]+``)."""
    return isinstance(id, str) and bool(id) and set(id) <= _ID_CHARS


def _store(shm_path: str, prefix: str) -> Store:
    return Store(os.path.join(shm_path, f"{prefix}shmcache-{os.getuid()}"))


def _key(id: str) -> str:
    if not valid_id(id):
        raise InvalidKeyError(f"invalid sharearray id {id!r}: use [A-Za-z0-9=+._-]+")
    if set(id) <= _KEY_CHARS and id not in (".", ".."):
        return f"plain/{id}"
    return f"hex/{id.encode().hex()}"  # '=' and '+' are not key characters


def cache(
    id: str,
    array_or_callback: np.ndarray | Callable[[], np.ndarray],
    shm_path: str = "/dev/shm",
    prefix: str = "sharearray_",
    timeout: float = -1,
    verbose: bool = True,
    log_func: Callable[[str], Any] | None = None,
) -> np.ndarray:
    """Return a read-only shared array for ``id``, storing it first if needed.

    ``array_or_callback`` is the array, or a function returning it that runs at most
    once across all processes. ``timeout`` < 0 waits for another process's load forever.
    """
    store = _store(shm_path, prefix)
    key = _key(id)
    loader = array_or_callback if callable(array_or_callback) else (lambda: array_or_callback)
    try:
        return store.open_array(key)
    except KeyNotFoundError:
        pass
    if verbose:
        (log_func or print)(f"sharearray: loading {id!r} into {store.root}")
    return store.cache(key, loader, timeout=None if timeout < 0 else timeout)


def free(id: str, shm_path: str = "/dev/shm", prefix: str = "sharearray_") -> None:
    """Remove ``id`` from shared memory (no error if it is not there)."""
    with contextlib.suppress(KeyNotFoundError):
        _store(shm_path, prefix).evict(_key(id))
