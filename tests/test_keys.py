"""Key validation: every malformed key is refused with InvalidKeyError and touches nothing."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmcache
from shmcache import MAX_KEY_LENGTH, InvalidKeyError, Store

BAD_KEYS: list[Any] = [
    "",
    "/abs",
    "/",
    "a//b",
    "a/",
    ".",
    "..",
    "./a",
    "a/..",
    "a/../b",
    "a/./b",
    "a b",
    "a\x00b",
    "a\nb",
    "é",
    "a~b",
    "a\\b",
    None,
    1,
    b"x",
    "x" * (MAX_KEY_LENGTH + 1),
]
GOOD_KEYS = ["a", "a/b.c-d_e", ".hidden", "...", "a/.../b", "A-Z_0.9", "x" * MAX_KEY_LENGTH]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its (mode, size): what "nothing changed" compares."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            found[str(path.relative_to(root))] = (st.st_mode, st.st_size)
    return found


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_key_is_refused(key: Any) -> None:
    with pytest.raises(InvalidKeyError) as info:
        shmcache.validate_key(key)
    assert isinstance(info.value, ValueError)
    assert str(info.value)  # says what was wrong


@pytest.mark.parametrize("key", GOOD_KEYS)
def test_good_key_is_accepted_and_round_trips(store: Store, key: str) -> None:
    assert shmcache.validate_key(key) == key
    store.put_array(key, np.arange(3))
    assert store.exists(key)
    assert [e.key for e in store.list()] == [key]
    np.testing.assert_array_equal(store.open_array(key), np.arange(3))


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_key_changes_nothing_on_disk(store: Store, root: Path, tmp_path: Path, key: Any) -> None:
    store.put_array("keep", np.arange(4))
    source = tmp_path / "src.npy"
    np.save(source, np.arange(2))
    before = _tree(root)
    loader_calls: list[int] = []

    def loader() -> np.ndarray:
        loader_calls.append(1)
        return np.arange(2)

    operations: dict[str, Callable[[], object]] = {
        "put_array": lambda: store.put_array(key, np.arange(2), overwrite=True),
        "put_file": lambda: store.put_file(key, source, overwrite=True),
        "open_array": lambda: store.open_array(key),
        "evict": lambda: store.evict(key),
        "exists": lambda: store.exists(key),
        "info": lambda: store.info(key),
        "cache": lambda: store.cache(key, loader),
    }
    for name, operation in operations.items():
        with pytest.raises(InvalidKeyError):
            operation()
        assert _tree(root) == before, name
    assert loader_calls == []
    assert [e.key for e in store.list()] == ["keep"]


def test_module_level_functions_validate_keys(root: Path) -> None:
    for key in ("", "a/../b", None):
        with pytest.raises(InvalidKeyError):
            shmcache.put_array(key, np.arange(2))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            shmcache.open_array(key)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            shmcache.evict(key)  # type: ignore[arg-type]
    assert not root.exists() or shmcache.list_entries() == []


@pytest.mark.parametrize("key", ["a", "a/b"])
def test_keys_that_share_a_prefix_are_distinct_entries(store: Store, key: str) -> None:
    store.put_array("a", np.arange(1))
    store.put_array("a/b", np.arange(2))
    store.put_array("ab", np.arange(3))
    assert store.open_array(key).shape == ((1,) if key == "a" else (2,))
    assert [e.key for e in store.list()] == ["a", "a/b", "ab"]


@pytest.mark.parametrize("prefix", ["", "a b", "a/../b"])
def test_list_with_bad_prefix(store: Store, prefix: str) -> None:
    store.put_array("a", np.arange(1))
    if prefix == "":  # empty prefix means "everything"
        assert [e.key for e in store.list(prefix)] == ["a"]
    else:
        with pytest.raises(InvalidKeyError):
            store.list(prefix)


@pytest.mark.parametrize("key", [["a"], {"a": 1}], ids=["list", "dict"])
def test_unhashable_key_is_invalid_key_for_open_array(store: Store, key: Any) -> None:
    with pytest.raises(InvalidKeyError):
        store.open_array(key)


@pytest.mark.parametrize("prefix", [1, b"a"], ids=repr)
def test_non_str_prefix_is_invalid_key_for_list(store: Store, prefix: Any) -> None:
    with pytest.raises(InvalidKeyError):
        store.list(prefix)
