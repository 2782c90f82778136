"""Key locks across real processes: a namespace of their own, roots made before it, and
``cache()`` loads that fail while other callers wait for them."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import time
import traceback
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

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
    assert not any(path.suffix == ".lock" for path in keys.iterdir())  # no file per key any more
    assert any(path.name.startswith("key-slots.") for path in (root / "locks").iterdir())


# ---------------------------------------------------------------------- failed loads


class LoaderExplodedError(RuntimeError):
    pass


def _failing_loader(runs: Path, release: Event | None = None) -> np.ndarray:
    with open(runs, "a") as fp:
        fp.write(f"{os.getpid()}\n")
    if release is not None:
        release.wait(WAIT_S)
    raise LoaderExplodedError("loader exploded")


def _load_and_fail(root: str, runs: str, loading: Event, release: Event) -> None:
    def loader() -> np.ndarray:
        loading.set()
        return _failing_loader(Path(runs), release)

    try:
        Store(root).cache("k", loader, timeout=WAIT_S)
    except LoaderExplodedError:
        return
    raise AssertionError("the loader did not raise")


def _wait_for_the_load(root: str, runs: str, calling: Any, results: Any) -> None:
    calling.put(os.getpid())
    try:
        Store(root).cache("k", lambda: _failing_loader(Path(runs)), timeout=WAIT_S)
        results.put(("returned", "", ""))
    except Exception as exc:
        cause = "".join(traceback.format_exception(exc.__cause__)) if exc.__cause__ else ""
        results.put((type(exc).__name__, str(exc), cause))


def test_waiters_of_a_failed_load_get_its_error_without_running_the_loader(root: Path) -> None:
    runs = root.parent / f"{root.name}-runs.txt"
    waiters = 4
    loading, release = CTX.Event(), CTX.Event()
    calling, results = CTX.Queue(), CTX.Queue()
    first = CTX.Process(target=_load_and_fail, args=(str(root), str(runs), loading, release), daemon=True)
    first.start()
    procs = []
    try:
        assert loading.wait(WAIT_S)
        for _ in range(waiters):
            proc = CTX.Process(
                target=_wait_for_the_load, args=(str(root), str(runs), calling, results), daemon=True
            )
            proc.start()
            procs.append(proc)
        for _ in range(waiters):
            calling.get(timeout=WAIT_S)
        time.sleep(1.0)  # each waiter is now queued on the key's lock (a few hundred µs after calling)
        release.set()
        outcomes = [results.get(timeout=WAIT_S) for _ in range(waiters)]
    finally:
        release.set()
        for proc in [first, *procs]:
            proc.join(WAIT_S)
        runs_text = runs.read_text() if runs.exists() else ""
        runs.unlink(missing_ok=True)
    assert [proc.exitcode for proc in [first, *procs]] == [0] * (waiters + 1)
    assert runs_text.splitlines() == [str(first.pid)]  # the loader ran once, in the first caller
    for raised, message, cause in outcomes:
        assert (raised, message) == ("LoaderExplodedError", "loader exploded")
        assert f"failed in process {first.pid}" in cause and "_failing_loader" in cause  # its traceback
    assert Store(root).list() == []


def test_a_call_after_a_failed_load_tries_again(store: Store, tmp_path: Path) -> None:
    runs = tmp_path / "runs.txt"
    for _ in range(2):  # no one waited: each call runs the loader
        with pytest.raises(LoaderExplodedError, match="loader exploded"):
            store.cache("k", lambda: _failing_loader(runs))
    assert len(runs.read_text().splitlines()) == 2
    assert store.cache("k", lambda: np.arange(3)).tolist() == [0, 1, 2]
    assert not store.layout.key_failure("k").exists()  # forgotten once a load succeeds
