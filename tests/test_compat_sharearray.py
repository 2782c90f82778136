"""shmcache.compat.sharearray keeps python-sharearray's call signatures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shmcache import KeyNotFoundError, LockTimeoutError
from shmcache.compat import sharearray


def test_cache_stores_once_and_returns_read_only_view(root: Path) -> None:
    calls: list[int] = []

    def load() -> np.ndarray:
        calls.append(1)
        return np.arange(10, dtype=np.int64)

    first = sharearray.cache("ids", load, shm_path=str(root), verbose=False)
    second = sharearray.cache("ids", load, shm_path=str(root), verbose=False)
    assert calls == [1]
    assert np.array_equal(first, np.arange(10)) and np.array_equal(second, first)
    with pytest.raises(ValueError):
        first[0] = 1


def test_ids_with_sharearray_only_characters(root: Path) -> None:
    array = np.ones((2, 3), dtype=np.float32)
    out = sharearray.cache("a=b+c", array, shm_path=str(root), verbose=False)
    assert np.array_equal(out, array)
    assert sharearray.valid_id("a=b+c") and not sharearray.valid_id("a/b")
    with pytest.raises(ValueError):
        sharearray.cache("a/b", array, shm_path=str(root), verbose=False)


def test_free_removes_and_tolerates_missing(root: Path) -> None:
    sharearray.cache("x", np.zeros(3), shm_path=str(root), verbose=False)
    sharearray.free("x", shm_path=str(root))
    sharearray.free("x", shm_path=str(root))
    store_root = root / f"sharearray_shmcache-{__import__('os').getuid()}"
    from shmcache import Store

    with pytest.raises(KeyNotFoundError):
        Store(store_root).open_array("plain/x")


def test_verbose_logs_through_log_func(root: Path) -> None:
    lines: list[str] = []
    sharearray.cache("v", np.zeros(1), shm_path=str(root), log_func=lines.append)
    assert len(lines) == 1 and "'v'" in lines[0]


def test_timeout_exception_is_the_lock_timeout() -> None:
    assert sharearray.TimeoutException is LockTimeoutError
    assert issubclass(sharearray.TimeoutException, TimeoutError)
