"""A drop-in for python-sharearray's ``cache``/``decorator``/``free``, built on the shmcache store.

Scripts written against ``sharearray`` keep their calls and gain what the original
lacks: atomic publish (no partial array after a crash), a lock that dies with its
holder (``kill -9`` never blocks the next run), a loader that really runs once per id
(the original runs it, and rewrites the file, on every call no other process contends
for), and arrays that pickle by reference.

Where the bytes live: in a store at ``<shm_path>/<prefix>shmcache-<uid>``. The path the
original used, ``<shm_path>/<prefix><id>.npy``, is a symlink into that store's entry:
it exists exactly while the id is cached, ``np.load`` reads it, and ``free`` removes it.
Deleting the link alone frees nothing (``cache`` puts it back); ``free(id)``, or
``rm -rf <shm_path>/<prefix>*`` for everything, does. There is no ``.lock`` file. Do not
run the original on the same ids at the same time: it would write through the link.

Differences kept on purpose:

- ``cache`` returns a read-only plain ``np.ndarray`` over the shared mapping, not the
  ``np.memmap`` the original's ``open_memmap(mode='r')`` gives: the same values, shape,
  dtype, order and read-only flag, but no ``.filename``/``.offset``/``.mode``, and
  ``isinstance(a, np.memmap)`` is false. In exchange indexing runs at full ndarray speed
  and pickling sends a reference, not a copy.
- What the original refuses with ``ValueError`` (not an ndarray or callable, a callback
  returning something else, an object dtype) raises :class:`UnsupportedArrayError`, a
  ``ValueError`` and a :class:`shmcache.UnsupportedDataError`; so does a masked array,
  which the original stores without its mask.
- ``verbose`` prints one line, in the process that creates the array.
- ``TimeoutException`` is :class:`shmcache.LockTimeoutError` (a ``TimeoutError``);
  ``timeout`` may be fractional.
- ``free`` of an invalid id raises ``ValueError`` rather than doing nothing.
- ``<shm_path>/<prefix><id>.npy`` owned by another user (``/dev/shm`` is everyone's) is
  never used: ``cache`` raises :class:`shmcache.CacheRootError` (a ``PermissionError``)
  naming its owner before anything is loaded, and ``free`` leaves it with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .._api import get_store
from .._disk.layout import ARRAY_FILE as _ARRAY_FILE
from .._disk.layout import entry_path
from .._disk.trust import describe_uid
from .._store import Store
from ..errors import CacheRootError, InvalidKeyError, KeyNotFoundError, LockTimeoutError, UnsupportedDataError

__all__ = ["TimeoutException", "UnsupportedArrayError", "cache", "decorator", "free", "valid_id"]

TimeoutException = LockTimeoutError
"""sharearray's name for a lock wait that timed out."""

_Loader = Callable[[], np.ndarray]


class UnsupportedArrayError(UnsupportedDataError, ValueError):
    """What sharearray refuses with ``ValueError`` (not an ndarray, object dtype...):
    still caught by ``except ValueError`` as well as by shmcache's ``UnsupportedDataError``."""


_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789=+._-")
_KEY_CHARS = _ID_CHARS - {"=", "+"}


def valid_id(id: str) -> bool:
    """Whether ``id`` is a valid sharearray id (``[A-Za-z0-9=+._-]+``)."""
    return isinstance(id, str) and bool(id) and set(id) <= _ID_CHARS


def _key(id: str) -> str:
    if not valid_id(id):
        raise InvalidKeyError(f"invalid sharearray id {id!r}: use [A-Za-z0-9=+._-]+")
    if set(id) <= _KEY_CHARS and id not in (".", ".."):
        return f"plain/{id}"
    return f"hex/{id.encode().hex()}"  # '=' and '+' are not key characters


def _store_name(prefix: str) -> str:
    return f"{prefix}shmcache-{os.getuid()}"


def _store(shm_path: str, prefix: str) -> Store:
    return get_store(os.path.join(shm_path, _store_name(prefix)))


def _build_path(id: str, prefix: str, shm_path: str) -> tuple[str, str]:
    """The original's ``(file, lock file)`` paths of ``id``: its users' scripts look there."""
    path = os.path.join(shm_path, prefix + id + ".npy")
    return path, path + ".lock"


def _check_not_taken(id: str, path: str) -> None:
    """Refuse (:class:`~shmcache.CacheRootError`, a ``PermissionError``) when another user
    owns what lies at ``path``: ``/dev/shm`` is shared by every user, and a file planted
    there would be what scripts that ``np.load`` the path read (and, being theirs, we could
    neither replace nor remove it)."""
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return
    if owner != os.getuid():
        raise CacheRootError(
            f"sharearray id {id!r}: {path} belongs to {describe_uid(owner)}, not to you "
            f"({describe_uid(os.getuid())}), so it cannot be made to point at your array; ask its owner "
            "(or root) to remove it, or pass another prefix= or shm_path= (a directory of your own)"
        )


def _link(id: str, key: str, prefix: str, shm_path: str) -> None:
    """Point ``<shm_path>/<prefix><id>.npy`` at the entry's current file (relative: the link
    and the store share a directory, since both names start with ``prefix``)."""
    path = _build_path(id, prefix, shm_path)[0]
    _check_not_taken(id, path)
    target = f"{os.path.basename(_store_name(prefix))}/entries/{entry_path(key)}/{_ARRAY_FILE}"
    try:
        if os.readlink(path) == target:
            return
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # a concurrent caller made the same link
            os.symlink(target, path)
            return
    except OSError:  # a regular file: what the original wrote; the link replaces it
        pass
    staging = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    os.symlink(target, staging)
    try:
        os.replace(staging, path)
    except BaseException:
        os.unlink(staging)
        raise


def _checked_array(value: object, id: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise UnsupportedArrayError(
            f"the callback for sharearray id {id!r} returned {type(value).__name__}, not a "
            "numpy.ndarray; return np.asarray(...) of it"
        )
    return value


def cache(
    id: str,
    array_or_callback: np.ndarray | _Loader,
    shm_path: str = "/dev/shm",
    prefix: str = "sharearray_",
    timeout: float = -1,
    verbose: bool = True,
    log_func: Callable[[str], Any] | None = None,
) -> np.ndarray:
    """Return a read-only shared array for ``id``, storing it first if needed.

    ``array_or_callback`` is the array, or a function returning it that runs at most
    once across all processes. ``timeout`` < 0 waits for another process's load forever.
    Raises ``ValueError`` for an invalid id and :class:`UnsupportedArrayError` (also a
    ``ValueError``) for anything but an ndarray of plain values.
    """
    key = _key(id)
    if not (isinstance(array_or_callback, np.ndarray) or callable(array_or_callback)):
        raise UnsupportedArrayError(
            f"array_or_callback for sharearray id {id!r} should be a numpy.ndarray or a "
            f"zero-argument callable, not {type(array_or_callback).__name__}"
        )
    _check_not_taken(id, _build_path(id, prefix, shm_path)[0])  # before anything is loaded
    store = _store(shm_path, prefix)

    def load() -> np.ndarray:
        if verbose:
            (log_func or print)(f"sharearray: {id!r} doesn't exist yet; creating it in {store.root}")
        if isinstance(array_or_callback, np.ndarray):
            return array_or_callback
        return _checked_array(array_or_callback(), id)

    try:
        array = store.cache(key, load, timeout=None if timeout < 0 else timeout)
    except UnsupportedArrayError:
        raise
    except UnsupportedDataError as exc:  # object dtype, masked array: a ValueError in sharearray
        raise UnsupportedArrayError(f"sharearray id {id!r}: {exc}") from exc
    _link(id, key, prefix, shm_path)
    return array


def decorator(
    id: str,
    *,
    shm_path: str = "/dev/shm",
    prefix: str = "sharearray_",
    timeout: float = -1,
    verbose: bool = True,
    log_func: Callable[[str], Any] | None = None,
) -> Callable[[_Loader], _Loader]:
    """``cache`` as a memoizing decorator of a zero-argument function returning the array.

    The function runs at most once across all processes (the original calls it on every
    call and throws the result away when the id exists). ``id`` is checked now.
    """
    _key(id)

    def decorate(function: _Loader) -> _Loader:
        @functools.wraps(function)
        def cached() -> np.ndarray:
            return cache(id, function, shm_path, prefix, timeout, verbose, log_func)

        return cached

    return decorate


def free(id: str, shm_path: str = "/dev/shm", prefix: str = "sharearray_") -> None:
    """Remove ``id`` from shared memory, and its ``.npy`` link (no error if it is not there).

    Processes that still map the array keep reading it; the memory returns when they let go.
    A ``.lock`` file left by the original sharearray is removed with a warning, as it does.
    """
    key = _key(id)
    path, lock = _build_path(id, prefix, shm_path)
    if os.path.lexists(lock):
        warnings.warn(f"lock still exists: removing {lock} (left by python-sharearray)", stacklevel=2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
    with contextlib.suppress(KeyNotFoundError):
        _store(shm_path, prefix).evict(key)
    try:
        _check_not_taken(id, path)
    except CacheRootError as exc:  # not ours to remove: our array is freed all the same
        warnings.warn(str(exc), stacklevel=2)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
