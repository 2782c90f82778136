"""Where the cache lives: default root, SHMCACHE_ROOT, fallback, ownership."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache._disk import layout as _root


def test_default_root_is_per_user_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHMCACHE_ROOT", raising=False)
    assert shmcache.default_root() == Path("/dev/shm") / f"shmcache-{os.getuid()}"


def test_environment_overrides_default(root: Path) -> None:
    assert shmcache.default_root() == root
    shmcache.put_array("k", np.arange(3))
    assert (root / "entries" / "k").is_symlink()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_missing_dev_shm_falls_back_to_temp_dir_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SHMCACHE_ROOT", raising=False)
    monkeypatch.setattr(_root, "SHM_DIR", str(tmp_path / "no-such-shm"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.warns(RuntimeWarning, match="does not exist"):
        fallback = shmcache.default_root()
    assert fallback == tmp_path / f"shmcache-{os.getuid()}"


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(shmcache.CacheRootError, match="not a directory"):
        shmcache.Store(target).put_array("k", np.arange(2))


def test_root_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    """Another user's directory (e.g. planted in world-writable /dev/shm) is never used,
    not even by root."""
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    try:
        os.chown(planted, 54321, 54321)
    except PermissionError:
        pytest.skip("needs root to create a directory owned by another user")
    with pytest.raises(shmcache.CacheRootError, match="belongs to uid 54321"):
        shmcache.Store(planted).put_array("k", np.arange(2))
    assert list(planted.iterdir()) == []


def test_store_pickles_as_its_settings(root: Path) -> None:
    store = shmcache.Store(root, max_bytes=1 << 20, lock_timeout=3.0)
    store.put_array("k", np.arange(4))
    store.open_array("k")
    payload = pickle.dumps(store)
    assert len(payload) < 1024
    clone = pickle.loads(payload)
    assert (clone.root, clone.max_bytes, clone.lock_timeout) == (store.root, 1 << 20, 3.0)
    np.testing.assert_array_equal(clone.open_array("k"), np.arange(4))
