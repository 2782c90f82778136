"""Space: a full tmpfs, the byte budget and its eviction, stats, listing, permissions."""

from __future__ import annotations

import gc
import multiprocessing
import os
import stat
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import mounted_tmpfs

import shmcache
from shmcache import CacheFullError, Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0
MiB = 1 << 20


def _join(proc: BaseProcess, exitcode: int = 0) -> None:
    proc.join(WAIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(WAIT_S)
        pytest.fail(f"child {proc.pid} did not finish within {WAIT_S} s")
    assert proc.exitcode == exitcode


def _files(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _keys(store: Store, prefix: str | None = None) -> list[str]:
    return [e.key for e in store.list(prefix)]


# ---------------------------------------------------------------------- a full tmpfs


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of its own (needs root); unmounted afterwards whatever happens."""
    with mounted_tmpfs(tmp_path / "small-tmpfs", "size=8m") as mountpoint:
        yield mountpoint


def _in_child(action: Callable[[], Any]) -> tuple[str, str, bool]:
    """Run ``action`` in a forked child: a SIGBUS there fails this test instead of killing pytest.

    Returns the (exception class name, message, isinstance OSError) it raised.
    """
    results = CTX.Queue()

    def run() -> None:
        try:
            action()
        except BaseException as exc:
            results.put((type(exc).__name__, str(exc), isinstance(exc, OSError)))
        else:
            results.put(("no error", "", False))

    proc = CTX.Process(target=run, daemon=True)
    proc.start()
    _join(proc)  # exit code 0: not killed by SIGBUS
    return results.get(timeout=WAIT_S)  # type: ignore[no-any-return]


def test_put_larger_than_the_tmpfs(small_tmpfs: Path) -> None:
    root = small_tmpfs / "cache"
    capacity = os.statvfs(small_tmpfs).f_blocks * os.statvfs(small_tmpfs).f_frsize
    name, message, is_os_error = _in_child(lambda: Store(root).put_array("big", np.ones(16 * MiB, np.uint8)))
    assert (name, is_os_error) == ("CacheFullError", True)
    assert "free" in message and "enlarge /dev/shm" in message
    assert "evict" not in message  # the root holds no entry to evict
    store = Store(root)
    assert store.list() == []
    assert _files(root / "tmp") == [] and _files(root / "objects") == []
    assert _free(small_tmpfs) >= capacity - 64 * 1024  # nearly all of it is free again
    store.put_array("small", np.ones(MiB, np.uint8))  # and usable
    np.testing.assert_array_equal(store.open_array("small"), np.ones(MiB, np.uint8))


@pytest.mark.parametrize("how", ["put_array", "put_file"])
def test_write_that_runs_out_of_space_midway(small_tmpfs: Path, tmp_path: Path, how: str) -> None:
    """The free-space check passes, then the tmpfs fills while writing: ENOSPC, not SIGBUS."""
    root = small_tmpfs / "cache"
    store = Store(root)
    first = np.arange(5 * MiB // 8, dtype=np.int64)
    store.put_array("first", first)
    free = _free(small_tmpfs)
    # Room by the store's own check (payload + a page per file for headers and metadata), but
    # not once the writer's lock page is counted too: the write fails with ENOSPC.
    if how == "put_array":
        tight = np.ones(free - 8192, np.uint8)
        name, message, is_os_error = _in_child(lambda: Store(root).put_array("tight", tight))
    else:
        source = tmp_path / "tight.npy"  # on the big /dev/shm or disk, not on the small tmpfs
        np.save(source, np.ones(free - 8192, np.uint8))
        name, message, is_os_error = _in_child(lambda: Store(root).put_file("tight", source))
    assert (name, is_os_error) == ("CacheFullError", True)
    assert "no space left" in message.lower()  # from the write itself, not from the check
    assert _keys(store) == ["first"]
    np.testing.assert_array_equal(store.open_array("first"), first)
    assert _files(root / "tmp") == []
    assert _files(root / "objects") == [store.info("first").version]
    assert _free(small_tmpfs) >= free - 4096
    assert store.cleanup() == 0


def test_writer_hitting_enospc_discards_its_version(small_tmpfs: Path) -> None:
    """The writer itself, with no free-space check in front of it."""
    root = small_tmpfs / "cache"

    def write_too_much() -> None:
        with Store(root)._writer() as writer:
            version = writer.new_version()
            writer.write_array(version, "data.npy", np.ones(12 * MiB, np.uint8))

    name, message, is_os_error = _in_child(write_too_much)
    assert (name, is_os_error) == ("CacheFullError", True)
    assert "No space left" in message or "no space left" in message
    assert _files(root / "tmp") == [] and _files(root / "objects") == []
    assert _free(small_tmpfs) >= 8 * MiB - 64 * 1024


# ---------------------------------------------------------------------- the byte budget


def _put(store: Store, key: str, value: int, size: int = MiB, pin: bool = False) -> None:
    store.put_array(key, np.full(size, value, np.uint8), pin=pin)
    time.sleep(0.05)  # distinct last-used times, whatever the file system's clock granularity


def _not_mapped_here(store: Store, key: str) -> None:
    gc.collect()
    assert store.info(key).version not in Path("/proc/self/maps").read_text()


def test_budget_evicts_least_recently_used(root: Path) -> None:
    store = Store(root, max_bytes=int(3.5 * MiB))
    for value, key in enumerate("abc"):
        _put(store, key, value)
    reader = Store(root)
    assert int(reader.open_array("a")[0]) == 0  # "a" is now the most recently used
    del reader
    _not_mapped_here(store, "a")
    time.sleep(0.05)
    _put(store, "d", 3)
    assert _keys(store) == ["a", "c", "d"]  # "b" was the least recently used
    _put(store, "e", 4)
    assert _keys(store) == ["a", "d", "e"]
    stats = store.stats()
    assert stats.used <= int(3.5 * MiB)
    assert stats.budget == store.max_bytes


def test_budget_never_evicts_pinned(root: Path) -> None:
    store = Store(root, max_bytes=int(2.5 * MiB))
    _put(store, "pinned", 1, pin=True)
    for value, key in enumerate(["x", "y", "z"]):
        _put(store, key, value)
        assert _keys(store) == sorted(["pinned", key])
    assert store.info("pinned").pinned
    with pytest.raises(CacheFullError) as info:
        store.put_array("huge", np.zeros(2 * MiB, np.uint8))
    assert isinstance(info.value, OSError)
    assert "Pinned: pinned" in str(info.value)
    assert _keys(store) == ["pinned", "z"]  # nothing evicted in vain
    assert _files(root / "tmp") == []
    assert store.evict("pinned") > MiB  # an explicit evict does remove a pinned entry
    assert _keys(store) == ["z"]


def test_budget_larger_than_everything(root: Path) -> None:
    store = Store(root, max_bytes=MiB)
    with pytest.raises(CacheFullError):
        store.put_array("too-big", np.zeros(2 * MiB, np.uint8))
    assert store.list() == []
    assert _files(root / "tmp") == [] and _files(root / "objects") == []
    with pytest.raises(ValueError):
        Store(root, max_bytes=-1)


def _hold(root: str, key: str, ready: Event, go: Event) -> None:
    array = Store(root).open_array(key)
    ready.set()
    go.wait(WAIT_S)
    assert array[0] == 7


def test_budget_never_evicts_what_another_process_maps(root: Path) -> None:
    store = Store(root, max_bytes=int(2.5 * MiB))
    _put(store, "mapped", 7)
    _put(store, "x", 1)
    ready, go = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold, args=(str(root), "mapped", ready, go), daemon=True)
    holder.start()
    try:
        assert ready.wait(WAIT_S)
        _not_mapped_here(store, "mapped")
        _put(store, "y", 2)  # "mapped" is the least recently used, but a live process maps it
        assert _keys(store) == ["mapped", "y"]
        with pytest.raises(CacheFullError) as info:
            store.put_array("huge", np.zeros(2 * MiB, np.uint8))
        assert "mapped by live processes: mapped" in str(info.value)
        assert _keys(store) == ["mapped", "y"]
    finally:
        go.set()
    _join(holder)
    store.put_array("huge", np.zeros(2 * MiB, np.uint8))  # nobody maps it any more
    assert _keys(store) == ["huge"]


def test_budget_never_evicts_what_this_process_maps(root: Path) -> None:
    store = Store(root, max_bytes=int(2.5 * MiB))
    _put(store, "held", 5)
    held = store.open_array("held")
    _put(store, "x", 1)
    _put(store, "y", 2)
    assert _keys(store) == ["held", "y"]
    assert int(held[0]) == 5


def test_budget_overwrite_does_not_evict_others_needlessly(root: Path) -> None:
    store = Store(root, max_bytes=int(2.5 * MiB))
    _put(store, "other", 1)
    _put(store, "k", 2)
    store.put_array("k", np.full(MiB, 3, np.uint8), overwrite=True)  # 2 MiB in all afterwards
    assert _keys(store) == ["k", "other"]


# ---------------------------------------------------------------------- stats and list


def test_stats(root: Path) -> None:
    empty = Store(root, max_bytes=64 * MiB).stats()
    assert (empty.entries, empty.used, empty.budget) == (0, 0, 64 * MiB)
    store = Store(root, max_bytes=64 * MiB)
    store.put_array("a", np.zeros(1000))
    store.put_array("b/c", np.zeros((10, 10), np.int8))
    store.put_array("b/d", np.array(["x", "yy"]))
    stats = store.stats()
    assert stats.entries == 3
    assert stats.used == sum(e.size for e in store.list()) > 8000
    assert stats.budget == 64 * MiB
    assert stats.capacity > 0 and stats.free > 0 and stats.free <= stats.capacity
    assert stats.root == str(root)
    assert Store(root).stats().budget is None
    assert shmcache.stats().entries == 3  # module level, SHMCACHE_ROOT
    for info in store.list():
        assert info.size >= info.nbytes
        assert info.size == (root / "objects" / info.version / "data.npy").stat().st_size


def test_list_prefix_is_segment_wise(store: Store) -> None:
    for key in ["a", "a/x", "a/x/y", "ab", "ab/x", "b", "a.b"]:
        store.put_array(key, np.arange(2))
    assert _keys(store) == sorted(["a", "a/x", "a/x/y", "ab", "ab/x", "b", "a.b"])
    assert _keys(store, "a") == ["a", "a/x", "a/x/y"]
    assert _keys(store, "a/") == ["a", "a/x", "a/x/y"]
    assert _keys(store, "a/x") == ["a/x", "a/x/y"]
    assert _keys(store, "ab") == ["ab", "ab/x"]
    assert _keys(store, "a/x/y") == ["a/x/y"]
    assert _keys(store, "c") == []
    assert [e.key for e in shmcache.list_entries("a/x")] == ["a/x", "a/x/y"]


def test_list_reports_metadata(store: Store, tmp_path: Path) -> None:
    before = time.time()
    store.put_array("arr", np.zeros((3, 4), np.float32), pin=True)
    (info,) = store.list()
    assert (info.key, info.kind, info.dtype, info.shape) == ("arr", "array", "float32", (3, 4))
    assert info.nbytes == 48 and info.pinned and info.source is None
    assert before <= info.created <= time.time()
    assert info.last_used >= info.created


# ---------------------------------------------------------------------- permissions


def test_everything_is_private(root: Path, tmp_path: Path) -> None:
    old_umask = os.umask(0)  # nothing may depend on the caller's umask
    try:
        store = Store(root)
        store.put_array("a/b", np.arange(10))
        np.save(tmp_path / "f.npy", np.arange(3))
        store.put_file("f", tmp_path / "f.npy")
        shmcache.cache("c", lambda: np.arange(2), root=root)
        store.open_array("a/b")
    finally:
        os.umask(old_umask)
    checked = {"dirs": 0, "files": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames]:
            mode = stat.S_IMODE(os.stat(Path(dirpath, name)).st_mode)
            assert mode == 0o700, (Path(dirpath, name), oct(mode))
            checked["dirs"] += 1
        for name in filenames:
            path = Path(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            assert stat.S_IMODE(st.st_mode) & 0o177 == 0, (path, oct(st.st_mode))
            checked["files"] += 1
    for path in [root, root / "entries", root / "objects", root / "tmp", root / "locks"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    version = root / "objects" / store.info("a/b").version
    assert stat.S_IMODE(version.stat().st_mode) == 0o700
    for name in ["data.npy", "meta.json"]:
        assert stat.S_IMODE((version / name).stat().st_mode) == 0o600, name
    assert checked["files"] >= 7 and checked["dirs"] >= 8
