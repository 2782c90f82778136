"""Module-level functions over a per-process :class:`Store` for each root.

``root=None`` means the default root (``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ._root import ENV_ROOT
from ._store import EntryInfo, Store, StoreStats

__all__ = [
    "cache",
    "cleanup",
    "evict",
    "get_store",
    "list_entries",
    "open_array",
    "put_array",
    "put_file",
    "stats",
]

_stores: dict[str | None, Store] = {}
_default_by_env: dict[str | None, Store] = {}


def get_store(root: str | os.PathLike[str] | None = None) -> Store:
    """The shared per-process store of ``root`` (so attachments are reused)."""
    if root is None:
        env = os.environ.get(ENV_ROOT)
        store = _default_by_env.get(env)
        if store is None:
            store = _default_by_env[env] = get_store(Store(None).root)
        return store
    name = os.fspath(root)
    store = _stores.get(name)
    if store is None:
        store = Store(name)
        store = _stores.setdefault(str(store.root), store)
        _stores[name] = store
    return store


def open_array(key: str, *, root: str | os.PathLike[str] | None = None) -> np.ndarray:
    """Read-only array over the shared entry ``key`` (pickles by reference)."""
    return get_store(root).open_array(key)


def put_array(
    key: str,
    array: Any,
    *,
    root: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish ``array`` under ``key`` atomically."""
    return get_store(root).put_array(key, array, overwrite=overwrite, pin=pin)


def put_file(
    key: str,
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> list[str]:
    """Publish a ``.npy``, ``.npz`` or directory of them; returns the keys."""
    return get_store(root).put_file(key, path, overwrite=overwrite, pin=pin)


def cache(
    key: str,
    loader: Callable[[], Any],
    *,
    root: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """Get-or-create ``key``: ``loader`` runs once across all processes."""
    return get_store(root).cache(key, loader, timeout=timeout)


def evict(key: str, *, root: str | os.PathLike[str] | None = None) -> int:
    """Remove ``key``; readers that mapped it keep their version."""
    return get_store(root).evict(key)


def list_entries(
    prefix: str | None = None, *, root: str | os.PathLike[str] | None = None
) -> list[EntryInfo]:
    """Entries under ``prefix`` (all when None)."""
    return get_store(root).list(prefix)


def stats(*, root: str | os.PathLike[str] | None = None) -> StoreStats:
    """Capacity, use, budget and entry count of the cache root."""
    return get_store(root).stats()


def cleanup(*, root: str | os.PathLike[str] | None = None) -> int:
    """Remove partial writes and orphans of dead writers; returns bytes freed."""
    return get_store(root).cleanup()
