"""Key locks across real processes: a namespace of their own, and roots made before it."""

from __future__ import annotations

import multiprocessing
import shutil
import stat
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0  # bound on every wait, so a broken build fails instead of hanging


def _load_slowly(root: str, key: str, loading: Event, release: Event) -> None:
    def loader() -> np.ndarray:
        loading.set()
        release.wait(WAIT_S)
        return np.arange(3)

    Store(root).cache(key, loader, timeout=WAIT_S)


@pytest.mark.parametrize("key", ["space", "keys"])
def test_a_key_named_like_a_root_lock_blocks_no_other_writer(root: Path, key: str) -> None:
    """``cache("space", ...)`` holds the lock of the key ``space`` only: another process's
    put (which takes the root's space-accounting lock) goes on while the loader runs."""
    loading, release = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_load_slowly, args=(str(root), key, loading, release), daemon=True)
    holder.start()
    try:
        assert loading.wait(WAIT_S)
        writer = Store(root, lock_timeout=2.0)
        writer.put_array("other", np.arange(5))
        assert writer.open_array("other").tolist() == [0, 1, 2, 3, 4]
    finally:
        release.set()
        holder.join(WAIT_S)
    assert holder.exitcode == 0
    assert Store(root).open_array(key).tolist() == [0, 1, 2]


def test_a_root_from_before_the_key_lock_directory_still_works(root: Path) -> None:
    Store(root).put_array("a", np.arange(2))
    shutil.rmtree(root / "locks" / "keys")  # what older versions made: key locks beside space.lock
    (root / "locks" / "a.lock").touch()
    store = Store(root)
    assert shmcache.cache("b", lambda: np.arange(4), root=root).tolist() == [0, 1, 2, 3]
    assert store.evict("a") > 0
    keys = root / "locks" / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert {path.name for path in keys.iterdir()} >= {"a.lock", "b.lock"}
