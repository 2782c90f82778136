"""Regressions from the core review: lock order, recreated roots, descriptors, odd views."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import resource
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmcache

MiB = 1 << 20


def _hold_key_lock(root: str, key: str, ready: Any, release: Any) -> None:
    store = shmcache.Store(root)
    with store._key_lock(key, None):
        ready.set()
        release.wait(60)


def test_budget_eviction_skips_entries_whose_lock_is_held(store: shmcache.Store) -> None:
    """Eviction never waits for a key lock while holding the space lock (no deadlock with a
    cache() loader holding its key lock and waiting for space)."""
    budget = shmcache.Store(store.root, max_bytes=3 * MiB)
    budget.put_array("old", np.zeros(MiB, np.uint8))
    budget.put_array("older", np.zeros(MiB, np.uint8))
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_key_lock, args=(str(store.root), "old", ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        shmcache.get_store(store.root)._reader.forget()
        budget.put_array("new", np.zeros(int(1.5 * MiB), np.uint8))  # evicts "older", skips "old"
        assert sorted(e.key for e in budget.list()) == ["new", "old"]
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0


def test_own_cached_attachment_does_not_pin_an_entry(root: Path) -> None:
    budget = shmcache.Store(root, max_bytes=2 * MiB)
    budget.put_array("a", np.zeros(MiB, np.uint8))
    opened = budget.open_array("a")
    del opened
    budget.put_array("c", np.zeros(int(1.5 * MiB), np.uint8))
    assert [e.key for e in budget.list()] == ["c"]


def test_entry_still_held_by_the_program_stays(root: Path) -> None:
    budget = shmcache.Store(root, max_bytes=2 * MiB)
    budget.put_array("a", np.zeros(MiB, np.uint8))
    held = budget.open_array("a")
    with pytest.raises(shmcache.CacheFullError, match="mapped by live processes: a"):
        budget.put_array("c", np.zeros(int(1.5 * MiB), np.uint8))
    assert held.sum() == 0


def test_root_deleted_and_recreated_is_noticed(store: shmcache.Store) -> None:
    store.put_array("k", np.zeros(4))
    old = store.open_array("k")
    shutil.rmtree(store.root)
    other = shmcache.Store(store.root)
    other.put_array("k", np.ones(4))
    store._last_sweep = 0.0  # the identity check runs at most once a second
    store.put_array("j", np.arange(2))  # the same store writes again: no raw FileNotFoundError
    np.testing.assert_array_equal(store.open_array("k"), np.ones(4))
    np.testing.assert_array_equal(old, np.zeros(4))  # the old mapping still reads


def test_short_generation_file_reads_as_empty(store: shmcache.Store) -> None:
    store.root.mkdir(mode=0o700)
    (store.root / "generation").write_bytes(b"")
    with pytest.raises(shmcache.KeyNotFoundError):
        shmcache.Store(store.root).open_array("k")


@pytest.mark.parametrize("bad", ["1G", -1, 1.5, True])
def test_max_bytes_must_be_a_byte_count(root: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        shmcache.Store(root, max_bytes=bad)


def test_unusable_roots_give_cache_root_errors(tmp_path: Path) -> None:
    file_root = tmp_path / "file"
    file_root.write_text("x")
    with pytest.raises(shmcache.CacheRootError):
        shmcache.Store(file_root).list()
    with pytest.raises(shmcache.CacheRootError):
        shmcache.Store(file_root / "below").put_array("k", np.arange(2))
    stats = shmcache.Store(tmp_path / "missing" / "deeper").stats()
    assert stats.entries == 0 and stats.capacity > 0


def test_sliding_window_views_pickle_by_reference(store: shmcache.Store) -> None:
    store.put_array("series", np.arange(100_000, dtype=np.float64))
    windows = np.lib.stride_tricks.sliding_window_view(store.open_array("series"), 1000)
    payload = pickle.dumps(windows)
    assert len(payload) < 1024
    np.testing.assert_array_equal(pickle.loads(payload), windows)


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_npz_with_a_repeated_member_publishes_nothing(store: shmcache.Store, tmp_path: Path) -> None:
    path = tmp_path / "dup.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for value in (1, 2):
            with archive.open("a.npy", "w") as member:
                np.save(member, np.full(3, value))
    with pytest.raises(shmcache.CorruptSourceError, match=r"dup\.npz: the archive holds two members named"):
        store.put_file("dup", path)
    assert store.list() == []


def test_many_attached_entries_under_a_low_soft_descriptor_limit(store: shmcache.Store) -> None:
    """Each mapping holds a descriptor before Python 3.13: the soft limit is raised, and
    running out is a clear error, not a bare OSError."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"hard descriptor limit {hard} too low for this test")
    for i in range(1200):
        store.put_array(f"k{i}", np.arange(2))
    code = (
        "import resource, shmcache\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        f"store = shmcache.Store({str(store.root)!r})\n"
        "held = [store.open_array(f'k{i}') for i in range(1200)]\n"
        "print(len(held))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1200"]
    if sys.version_info >= (3, 13):
        return  # no descriptor per mapping: nothing runs out
    capped = code.replace("resource.getrlimit(resource.RLIMIT_NOFILE)[1]", "256")
    capped = capped.replace("held = [", "try:\n    held = [").replace(
        "print(len(held))\n",
        "except shmcache.ShmCacheError as exc:\n    print(type(exc).__name__, exc)\n",
    )
    done = subprocess.run([sys.executable, "-c", capped], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("TooManyOpenFilesError") and "too many open files" in done.stdout


def test_checksums_recorded_at_put_and_verified(store: shmcache.Store, tmp_path: Path) -> None:
    store.put_array("a", np.arange(1000))
    store.put_strings("s", ["x", "y"])
    np.save(tmp_path / "f.npy", np.ones((100, 3)))
    np.savez_compressed(tmp_path / "z.npz", m=np.arange(7))
    store.put_file("f", tmp_path / "f.npy")
    store.put_file("z", tmp_path / "z.npz")
    for key in ("a", "s", "f", "z/m"):
        assert (store.info(key).checksum or "").startswith("crc32:")
        assert store.verify(key) is True
    data = store.root / "objects" / store.info("f").version / "data.npy"
    with open(data, "r+b") as fp:  # damage one payload byte behind the cache's back
        fp.seek(200)
        fp.write(b"\x7f")
    with pytest.raises(shmcache.CorruptEntryError, match="checksum"):
        store.verify("f")
