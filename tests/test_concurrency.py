"""Several real processes: readers of replaced/evicted versions, cache() races, kill -9."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmcache
from shmcache import KeyExistsError, KeyNotFoundError, LockTimeoutError, Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0  # bound on every wait, so a broken build fails instead of hanging
OLD = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: many pages
NEW = OLD[::-1] * 2


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _start(target: Any, *args: Any) -> BaseProcess:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _join(proc: BaseProcess, exitcode: int = 0) -> None:
    proc.join(WAIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(WAIT_S)
        pytest.fail(f"child {proc.pid} did not finish within {WAIT_S} s")
    assert proc.exitcode == exitcode


def _kill(proc: BaseProcess) -> None:
    assert proc.pid is not None
    with contextlib.suppress(ProcessLookupError):  # already gone: _join then reports its exit code
        os.kill(proc.pid, signal.SIGKILL)


def _files(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


# ---------------------------------------------------------------------- readers keep their version


def _hold_and_reread(root: str, key: str, ready: Event, go: Event, results: Any) -> None:
    array = Store(root).open_array(key)
    first = (float(array.sum()), _digest(array))
    ready.set()
    if not go.wait(WAIT_S):
        results.put("parent never said go")
        return
    results.put((first, bool(np.array_equal(array, OLD)), float(array.sum()), _digest(array)))


def _maps_of(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("change", ["replace", "evict"])
def test_reader_keeps_old_version(store: Store, root: Path, change: str) -> None:
    old_version = store.put_array("k", OLD).version
    ready, go, results = CTX.Event(), CTX.Event(), CTX.Queue()
    proc = _start(_hold_and_reread, str(root), "k", ready, go, results)
    try:
        assert ready.wait(WAIT_S)
        assert f"objects/{old_version}/data.npy" in _maps_of(proc.pid or 0)
        if change == "replace":
            new_version = store.put_array("k", NEW, overwrite=True).version
            assert new_version != old_version
            np.testing.assert_array_equal(store.open_array("k"), NEW)
            np.testing.assert_array_equal(Store(root).open_array("k"), NEW)
            np.testing.assert_array_equal(shmcache.open_array("k"), NEW)
        else:
            store.evict("k")
            for reader in (store, Store(root)):
                with pytest.raises(KeyNotFoundError):
                    reader.open_array("k")
            assert store.list() == []
        assert not (root / "objects" / old_version).exists()  # unlinked, yet still mapped:
        assert f"objects/{old_version}/data.npy (deleted)" in _maps_of(proc.pid or 0)
        go.set()
        result = results.get(timeout=WAIT_S)
    finally:
        go.set()
        _join(proc)
    expected = (float(OLD.sum()), _digest(OLD))
    assert result == (expected, True, *expected)


def _read_while_replaced(root: str, key: str, stop: Event, results: Any) -> None:
    store = Store(root)
    seen: set[float] = set()
    torn = 0
    while not stop.is_set():
        array = store.open_array(key)
        first, last = float(array[0]), float(array[-1])
        if first != last or not (array == first).all():
            torn += 1
        seen.add(first)
    results.put((torn, sorted(seen)))


def test_readers_never_see_a_partial_version(store: Store, root: Path) -> None:
    store.put_array("k", np.full(1 << 18, 0.0))
    stop, results = CTX.Event(), CTX.Queue()
    readers = [_start(_read_while_replaced, str(root), "k", stop, results) for _ in range(2)]
    try:
        for value in range(1, 31):
            store.put_array("k", np.full(1 << 18, float(value)), overwrite=True)
    finally:
        stop.set()
        reports = [results.get(timeout=WAIT_S) for _ in readers]
        for proc in readers:
            _join(proc)
    for torn, seen in reports:
        assert torn == 0
        assert seen and set(seen) <= {float(v) for v in range(31)}
    np.testing.assert_array_equal(store.open_array("k"), np.full(1 << 18, 30.0))


def _put_once(root: str, key: str, value: int, barrier: Barrier, results: Any) -> None:
    barrier.wait(WAIT_S)
    try:
        Store(root).put_array(key, np.full(1000, value))
    except KeyExistsError:
        results.put((value, "exists"))
    else:
        results.put((value, "published"))


def test_concurrent_puts_without_overwrite_publish_exactly_one(store: Store, root: Path) -> None:
    count = 6
    barrier, results = CTX.Barrier(count), CTX.Queue()
    procs = [_start(_put_once, str(root), "k", value, barrier, results) for value in range(count)]
    outcomes = dict(results.get(timeout=WAIT_S) for _ in procs)
    for proc in procs:
        _join(proc)
    winners = [value for value, outcome in outcomes.items() if outcome == "published"]
    assert len(winners) == 1
    assert sorted(outcomes.values()).count("exists") == count - 1
    np.testing.assert_array_equal(store.open_array("k"), np.full(1000, winners[0]))
    assert len(os.listdir(root / "objects")) == 1
    assert _files(root / "tmp") == []


# ---------------------------------------------------------------------- cache()


def _expensive() -> np.ndarray:
    return np.arange(50_000, dtype=np.int64) * 3


def _cache_in_child(root: str, key: str, counter: str, barrier: Barrier, results: Any) -> None:
    def loader() -> np.ndarray:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        time.sleep(0.3)
        return _expensive()

    barrier.wait(WAIT_S)
    array = shmcache.cache(key, loader, root=root, timeout=WAIT_S)
    results.put((os.getpid(), _digest(array), array.dtype.str, array.shape, type(array) is np.ndarray))


def test_cache_runs_the_loader_once_across_processes(store: Store, root: Path, tmp_path: Path) -> None:
    count = 16
    counter = tmp_path / "loads.txt"
    barrier, results = CTX.Barrier(count), CTX.Queue()
    args = (str(root), "vocab", str(counter), barrier, results)
    procs = [_start(_cache_in_child, *args) for _ in range(count)]
    reports = [results.get(timeout=WAIT_S) for _ in procs]
    for proc in procs:
        _join(proc)
    assert len(counter.read_text().splitlines()) == 1
    expected = (_digest(_expensive()), _expensive().dtype.str, _expensive().shape, True)
    assert {report[1:] for report in reports} == {expected}
    assert len({report[0] for report in reports}) == count
    assert [e.key for e in store.list()] == ["vocab"]


def test_cache_loader_error_publishes_nothing(store: Store, root: Path) -> None:
    def failing() -> np.ndarray:
        raise RuntimeError("loader exploded")

    with pytest.raises(RuntimeError, match="loader exploded"):
        shmcache.cache("k", failing, root=root)
    with pytest.raises(shmcache.UnsupportedDataError):
        shmcache.cache("k", lambda: np.array([object()]), root=root)
    assert store.list() == []
    assert _files(root / "tmp") == [] and _files(root / "objects") == []
    with pytest.raises(KeyNotFoundError):
        store.open_array("k")

    calls: list[int] = []

    def loader() -> np.ndarray:
        calls.append(1)
        return np.arange(4)

    np.testing.assert_array_equal(shmcache.cache("k", loader, root=root, timeout=WAIT_S), np.arange(4))
    np.testing.assert_array_equal(shmcache.cache("k", loader, root=root, timeout=WAIT_S), np.arange(4))
    assert calls == [1]


def _cache_with_stuck_loader(root: str, key: str, loading: Event) -> None:
    def loader() -> np.ndarray:
        loading.set()
        time.sleep(10 * WAIT_S)
        return np.zeros(1)

    shmcache.cache(key, loader, root=root)


def test_cache_lock_timeout_and_kill_of_the_loader(store: Store, root: Path) -> None:
    loading = CTX.Event()
    holder = _start(_cache_with_stuck_loader, str(root), "k", loading)
    calls: list[str] = []

    def loader() -> np.ndarray:
        calls.append("loaded")
        return np.arange(6)

    try:
        assert loading.wait(WAIT_S)
        with pytest.raises(LockTimeoutError) as info:
            shmcache.cache("k", loader, root=root, timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        assert "'k'" in str(info.value)
        assert calls == []
        assert store.list() == []
        with pytest.raises(KeyNotFoundError):
            store.open_array("k")
    finally:
        _kill(holder)
    _join(holder, -signal.SIGKILL)
    with pytest.raises(KeyNotFoundError):  # the dead loader published nothing
        store.open_array("k")
    result = shmcache.cache("k", loader, root=root, timeout=WAIT_S)
    np.testing.assert_array_equal(result, np.arange(6))
    assert calls == ["loaded"]
    assert [e.key for e in store.list()] == ["k"]


# ---------------------------------------------------------------------- kill -9 of writers

BIG_ROWS = 50_000  # 50_000 x 1024 float64 = 390 MiB, written in 16 MiB chunks


def _put_big(root: str, key: str) -> None:
    # A broadcast view: no memory of its own, and not contiguous, so the writer goes chunk by chunk.
    array = np.broadcast_to(np.arange(1024, dtype=np.float64), (BIG_ROWS, 1024))
    Store(root).put_array(key, array)


def _partial_files(tmp: Path) -> list[Path]:
    found = []
    for path in tmp.glob("*/data.npy") if tmp.exists() else []:
        try:
            if path.stat().st_size > 0:
                found.append(path)
        except FileNotFoundError:
            pass
    return found


def test_kill_9_during_put_leaves_no_entry_and_cleanup_frees_it(store: Store, root: Path) -> None:
    writer = _start(_put_big, str(root), "big")
    deadline = time.monotonic() + WAIT_S
    try:
        while not _partial_files(root / "tmp"):
            assert writer.is_alive(), "the writer finished before it could be killed mid-write"
            assert time.monotonic() < deadline, "no partial write appeared"
            time.sleep(0.001)
    finally:
        _kill(writer)
    _join(writer, -signal.SIGKILL)

    full_size = BIG_ROWS * 1024 * 8
    (partial,) = _partial_files(root / "tmp")
    assert 0 < partial.stat().st_size < full_size
    with pytest.raises(KeyNotFoundError):
        store.open_array("big")
    assert store.list() == []
    assert not store.exists("big")
    assert _files(root / "objects") == []

    partial_bytes = partial.stat().st_blocks * 512
    freed = store.cleanup()
    assert freed >= partial_bytes > 0
    assert _files(root / "tmp") == []
    assert _files(root / "objects") == []
    assert store.cleanup() == 0
    store.put_array("big", np.arange(3))  # the key is usable again
    np.testing.assert_array_equal(store.open_array("big"), np.arange(3))


def _writer_in_child(root: str, stage: str, ready: Event, go: Event, report: Any) -> None:
    """Start a version and stop at ``stage``: 'written' (in tmp/) or 'promoted' (in objects/)."""
    store = Store(root)
    with store._writer() as writer:
        version = writer.new_version()
        writer.write_array(version, "data.npy", np.arange(1 << 18))
        if stage == "promoted":
            writer.promote(version)
        report.put(version)
        ready.set()
        go.wait(WAIT_S)


def test_cleanup_spares_live_writers_and_removes_dead_ones(store: Store, root: Path) -> None:
    store.put_array("published", np.arange(10))
    channels = {name: (CTX.Event(), CTX.Event(), CTX.Queue()) for name in ("live", "dead", "orphan")}
    stages = {"live": "written", "dead": "written", "orphan": "promoted"}
    procs = {name: _start(_writer_in_child, str(root), stages[name], *channels[name]) for name in channels}
    try:
        versions = {name: channels[name][2].get(timeout=WAIT_S) for name in procs}
        for name in procs:
            assert channels[name][0].wait(WAIT_S)
        for name in ("dead", "orphan"):
            _kill(procs[name])
            _join(procs[name], -signal.SIGKILL)
        live_file = root / "tmp" / versions["live"] / "data.npy"
        live_lock = root / "tmp" / f"{versions['live'].split('.')[0]}.lock"
        assert (root / "tmp" / versions["dead"] / "data.npy").exists()
        assert (root / "objects" / versions["orphan"] / "data.npy").exists()

        freed = Store(root).cleanup()

        assert freed >= 2 * (1 << 18) * 8  # both dead versions
        assert _files(root / "tmp") == sorted([versions["live"], live_lock.name])
        assert live_file.stat().st_size == (1 << 18) * 8 + 128
        assert _files(root / "objects") == [store.info("published").version]
        np.testing.assert_array_equal(Store(root).open_array("published"), np.arange(10))
        assert Store(root).cleanup() == 0  # the live writer is still spared
        assert live_file.exists()
    finally:
        channels["live"][1].set()
    _join(procs["live"])
    assert _files(root / "tmp") == []  # the live writer cleaned up after itself
    assert [e.key for e in store.list()] == ["published"]


def _die_while_publishing(root: str, ready: Event, report: Any) -> None:
    """Stop where ``Store._publish`` has promoted a version and staged its link, then wait."""
    store = Store(root)
    with store._writer() as writer:
        version = writer.new_version()
        writer.write_array(version, "data.npy", np.arange(1 << 18))
        writer.write_meta(version, {"key": "k", "version": version, "kind": "array"})
        writer.promote(version)
        os.symlink(f"../objects/{version}", store.layout.tmp / f"{version}.link")
        report.put(version)
        ready.set()
        time.sleep(10 * WAIT_S)  # killed here


def test_cleanup_after_kill_between_staging_and_publishing(store: Store, root: Path) -> None:
    store.put_array("published", np.arange(10))
    ready, report = CTX.Event(), CTX.Queue()
    proc = _start(_die_while_publishing, str(root), ready, report)
    try:
        version = report.get(timeout=WAIT_S)
        assert ready.wait(WAIT_S)
    finally:
        _kill(proc)
    _join(proc, -signal.SIGKILL)
    orphan_bytes = (root / "objects" / version / "data.npy").stat().st_blocks * 512
    freed = store.cleanup()
    assert _files(root / "objects") == [store.info("published").version]
    assert _files(root / "tmp") == []
    assert orphan_bytes <= freed < 2 * orphan_bytes  # counted once
    assert store.cleanup() == 0


def test_cleanup_spares_a_starting_writers_lock(store: Store, root: Path) -> None:
    store.put_array("published", np.arange(10))
    ready, go, report = CTX.Event(), CTX.Event(), CTX.Queue()
    proc = _start(_lock_like_a_starting_writer, str(root), ready, go, report)
    try:
        staging = Path(report.get(timeout=WAIT_S))
        assert ready.wait(WAIT_S)
        old = time.time() - 3600
        os.utime(staging, (old, old))  # however old it looks: its writer holds the lock
        assert store.cleanup() == 0
        assert staging.exists()
    finally:
        go.set()
    _join(proc)


def test_cleanup_removes_a_dead_writers_old_staging_lock(store: Store, root: Path) -> None:
    store.put_array("published", np.arange(10))
    ready, go, report = CTX.Event(), CTX.Event(), CTX.Queue()
    proc = _start(_lock_like_a_starting_writer, str(root), ready, go, report)
    try:
        staging = Path(report.get(timeout=WAIT_S))
        assert ready.wait(WAIT_S)
    finally:
        _kill(proc)
    _join(proc, -signal.SIGKILL)
    store.cleanup()
    assert staging.exists()  # unlocked but fresh: maybe a writer that has not locked it yet
    old = time.time() - 3600
    os.utime(staging, (old, old))
    store.cleanup()
    assert _files(root / "tmp") == []
    np.testing.assert_array_equal(store.open_array("published"), np.arange(10))


def _lock_like_a_starting_writer(root: str, ready: Event, go: Event, report: Any) -> None:
    """What ``VersionWriter.__init__`` holds between its flock and its rename."""
    staging = Path(root) / "tmp" / f"{time.time_ns():x}-{os.getpid()}-0badcafe.lock.new"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    report.put(str(staging))
    ready.set()
    go.wait(WAIT_S)
    os.close(fd)
