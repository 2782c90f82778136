"""shmcache.compat.sharearray keeps python-sharearray's call signatures; these tests pin
where it differs on purpose (``tests/test_sharearray_upstream.py`` holds what it shares)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from shmcache import KeyNotFoundError, LockTimeoutError, Store, UnsupportedDataError
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


def _store_root(shm_path: Path, prefix: str = "sharearray_") -> Path:
    return shm_path / f"{prefix}shmcache-{os.getuid()}"


def test_free_removes_and_tolerates_missing(root: Path) -> None:
    sharearray.cache("x", np.zeros(3), shm_path=str(root), verbose=False)
    sharearray.free("x", shm_path=str(root))
    sharearray.free("x", shm_path=str(root))
    with pytest.raises(KeyNotFoundError):
        Store(_store_root(root)).open_array("plain/x")


def test_verbose_logs_through_log_func(root: Path) -> None:
    lines: list[str] = []
    sharearray.cache("v", np.zeros(1), shm_path=str(root), log_func=lines.append)
    assert len(lines) == 1 and "'v'" in lines[0]


def test_timeout_exception_is_the_lock_timeout() -> None:
    assert sharearray.TimeoutException is LockTimeoutError
    assert issubclass(sharearray.TimeoutException, TimeoutError)


def test_decorated_function_runs_once(root: Path) -> None:
    """The original calls the function on every call and drops the result if the id exists."""
    calls: list[int] = []

    @sharearray.decorator("once", shm_path=str(root), verbose=False)
    def make() -> np.ndarray:
        """Docstring kept."""
        calls.append(1)
        return np.arange(4)

    assert np.array_equal(make(), make()) and calls == [1]
    assert make.__doc__ == "Docstring kept."


@pytest.mark.parametrize(
    "value",
    [[1, 2], lambda: (1, 2), np.array([None]), np.ma.masked_array([1, 2], mask=[0, 1])],
    ids=["list", "callback-returning-tuple", "object-dtype", "masked"],
)
def test_refusals_are_value_errors_and_unsupported_data(root: Path, value: object) -> None:
    with pytest.raises(sharearray.UnsupportedArrayError) as info:
        sharearray.cache("refused", value, shm_path=str(root), verbose=False)  # type: ignore[arg-type]
    error = info.value
    assert isinstance(error, ValueError) and isinstance(error, UnsupportedDataError)
    assert isinstance(error, TypeError)  # what UnsupportedDataError always was
    assert "'refused'" in str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    assert not Store(_store_root(root)).exists("plain/refused")


def test_returns_a_plain_ndarray_that_pickles_by_reference(root: Path) -> None:
    """Not the original's np.memmap: full-speed indexing, and no copy when pickled."""
    array = sharearray.cache("big", np.zeros(1 << 20), shm_path=str(root), verbose=False)
    assert type(array) is np.ndarray and not array.flags.writeable
    payload = pickle.dumps(array[10:])
    assert len(payload) < 1024
    assert np.array_equal(pickle.loads(payload), np.zeros((1 << 20) - 10))


def test_the_original_path_is_a_link_into_the_store(root: Path) -> None:
    sharearray.cache("linked", np.arange(3), shm_path=str(root), verbose=False)
    path = root / "sharearray_linked.npy"
    assert path.is_symlink() and not os.path.isabs(os.readlink(path))
    assert path.resolve().parent.parent == (_store_root(root) / "objects").resolve()
    path.unlink()  # removing the link alone frees nothing: the next call puts it back
    sharearray.cache("linked", np.zeros(1), shm_path=str(root), verbose=False)
    assert np.array_equal(np.load(path), np.arange(3))


def test_the_link_follows_the_entry(root: Path) -> None:
    """Evicted behind the compat's back (``shmcache evict``): the link dangles, so the
    file no longer exists, and the next call loads again and the link sees the new version."""
    sharearray.cache("moving", np.arange(3), shm_path=str(root), verbose=False)
    Store(_store_root(root)).evict("plain/moving")
    path = root / "sharearray_moving.npy"
    assert path.is_symlink() and not path.exists()
    sharearray.cache("moving", np.ones(2), shm_path=str(root), verbose=False)
    assert np.array_equal(np.load(path), np.ones(2))


def test_a_file_left_by_the_original_is_replaced(root: Path) -> None:
    root.mkdir()
    path, lock = sharearray._build_path("old", "sharearray_", str(root))
    np.save(path, np.full(3, 7))
    out = sharearray.cache("old", lambda: np.arange(3), shm_path=str(root), verbose=False)
    assert np.array_equal(out, np.arange(3)) and os.path.islink(path)
    open(lock, "w").close()  # the original's lock, left by a killed process
    with pytest.warns(UserWarning, match="lock still exists"):
        sharearray.free("old", shm_path=str(root))
    assert not os.path.lexists(path) and not os.path.lexists(lock)


def test_ids_outside_the_key_alphabet_get_their_own_files(root: Path) -> None:
    for id in ("a=b", "a+b", "..", "."):
        sharearray.cache(id, np.array([len(id)]), shm_path=str(root), verbose=False)
    for id in ("a=b", "a+b", "..", "."):
        assert np.load(root / f"sharearray_{id}.npy").tolist() == [len(id)]
        sharearray.free(id, shm_path=str(root))
    assert sorted(p.name for p in root.iterdir()) == [_store_root(root).name]


def test_free_refuses_an_invalid_id(root: Path) -> None:
    with pytest.raises(ValueError):
        sharearray.free("../etc/x", shm_path=str(root))
