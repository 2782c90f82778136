"""A directory put copies its files on several threads (issue 22 item 1, ``copy_pool``): the
same entries and manifest as one thread, the first error raised unchanged with nothing
published and nothing left in ``tmp/``, and progress reported exactly, from the calling
thread only."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import mounted_tmpfs, scratch_dir, temporary_root

from shmcache import CacheFullError, Store
from shmcache._disk import manifest
from shmcache._disk.layout import packed_range
from shmcache._sources import files
from shmcache._store import copy_pool, writing
from shmcache.errors import CorruptSourceError

THREADS = 3  # more than this machine's cores where it has 2: the pool runs whatever the host


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every batch copied by ``THREADS`` threads; yields the thread counts chosen."""
    chosen: list[int] = []

    def threads(plan: object) -> int:
        chosen.append(THREADS)
        return THREADS

    monkeypatch.setattr(writing, "copy_threads", threads)
    yield chosen


@pytest.fixture
def serial(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writing, "copy_threads", lambda plan: 1)


@pytest.fixture
def mixed_folder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Files of every copy path: read whole when checked (256 B), held open (67 KiB), held
    beyond what is read whole (the cap lowered), and copied through the buffer (5 MiB);
    some in a subdirectory."""
    monkeypatch.setattr(files, "_KEEP_TOTAL", 40 * 256)
    with scratch_dir("pool") as path:
        (path / "sub").mkdir()
        for i in range(120):
            shape = (4, 8) if i % 3 else (2100, 8)
            where = path / "sub" if i % 5 == 0 else path
            np.save(where / f"f{i:03d}.npy", np.full(shape, i, np.int32) + np.arange(8, dtype=np.int32))
        np.save(path / "big.npy", np.arange((5 << 20) // 8, dtype=np.int64))
        yield path


def _batch(root: Path) -> Path:
    (batch,) = [p for p in (root / "objects").iterdir() if p.is_dir()]
    return batch


def _manifest(batch: Path) -> tuple[dict[str, object], list[bytes]]:
    """A batch's manifest: its common object without its creation time, and its entries'
    lines, each as written."""
    raw = (batch / "manifest").read_bytes()
    _, count, common_length, table, live = manifest._HEAD2.unpack_from(raw)
    body = table + 8 * (count + 1)
    offsets = struct.unpack_from(f"<{count + 1}Q", raw, table)
    common = json.loads(raw[body : body + common_length])
    del common["created"]
    lines = [raw[offsets[i] : offsets[i + 1]] for i in range(count)]
    assert offsets[0] == body + common_length and offsets[-1] == live and live + count == len(raw)
    return common, lines


def _entry_bytes(store: Store, key: str) -> bytes:
    """The bytes of ``key``'s ``.npy``: its file, or its range of the manifest (packed)."""
    version = store.info(key).version
    packed = packed_range(version)
    if packed is None:
        return Path(store.layout.object_file(version, "data.npy")).read_bytes()
    batch, _, offset, length = packed
    return (store.layout.objects / batch / "manifest").read_bytes()[offset : offset + length]


def _nothing_left(store: Store, root: Path, folder: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub
    for name in os.listdir("/proc/self/fd"):
        try:
            assert not os.readlink(f"/proc/self/fd/{name}").startswith(f"{folder}/")
        except OSError:
            continue


def test_pooled_put_writes_what_one_thread_writes(
    mixed_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two roots, one put each of the same folder, one pooled and one on one thread: the
    same data files byte for byte and the same manifest (its creation time aside)."""
    with temporary_root() as pooled_root, temporary_root() as serial_root:
        calls: list[int] = []

        def pool_of(plan: object) -> int:
            calls.append(THREADS)
            return THREADS

        monkeypatch.setattr(writing, "copy_threads", pool_of)
        pooled_keys = Store(pooled_root).put_file("d", mixed_folder)
        monkeypatch.setattr(writing, "copy_threads", lambda plan: 1)
        serial_keys = Store(serial_root).put_file("d", mixed_folder)
        assert calls == [THREADS] and pooled_keys == serial_keys and len(pooled_keys) == 121
        pooled_batch, serial_batch = _batch(pooled_root), _batch(serial_root)
        pooled_store, serial_store = Store(pooled_root), Store(serial_root)
        for key in pooled_keys:
            assert _entry_bytes(pooled_store, key) == _entry_bytes(serial_store, key), key
            pooled_version = pooled_store.info(key).version.partition("/")[2]
            assert pooled_version == serial_store.info(key).version.partition("/")[2], key
        assert _manifest(pooled_batch) == _manifest(serial_batch)
        store = Store(pooled_root)
        assert all(store.verify(key) for key in pooled_keys)
        assert int(store.open_array("d/sub/f115")[1, 7]) == 115 + 7
        assert int(store.open_array("d/big")[-1]) == (5 << 20) // 8 - 1


def test_progress_is_exact_and_from_the_calling_thread(
    store: Store, mixed_folder: Path, pooled: list[int]
) -> None:
    calls: list[tuple[int, int, int]] = []
    me = threading.get_ident

    store.put_file("d", mixed_folder, progress=lambda done, total: calls.append((done, total, me())))
    assert pooled == [THREADS]
    total = sum(p.stat().st_size for p in mixed_folder.rglob("*.npy"))
    assert {thread for _, _, thread in calls} == {threading.get_ident()}
    assert {t for _, t, _ in calls} == {total}
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and done[0] == 0 and done[-1] == total


def test_a_progress_error_cancels_the_pooled_put(
    store: Store, root: Path, mixed_folder: Path, pooled: list[int]
) -> None:
    class Stop(Exception):
        pass

    def progress(done: int, total: int) -> None:
        if done > total // 3:
            raise Stop("cancelled")

    with pytest.raises(Stop):
        store.put_file("d", mixed_folder, progress=progress)
    _nothing_left(store, root, mixed_folder)


@pytest.mark.parametrize("victim", ["f063.npy", "f116.npy"], ids=["held", "small-held"])
def test_a_file_changed_in_the_middle_fails_the_pooled_put(
    store: Store, root: Path, mixed_folder: Path, pooled: list[int], victim: str
) -> None:
    """A middle file rewritten after its check (held open: a big one, or a small one
    beyond what is read whole): the pool raises the copy's own error, publishes nothing,
    leaves nothing in ``tmp/`` and closes every source. (One read whole is a snapshot:
    ``test_dir_put_sources``.)"""
    path = mixed_folder / victim
    changed: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not changed:  # the first report: every file checked, none copied
            changed.append(True)
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\x07" * 16, 130)
                os.utime(fd, ns=(0, 1))
            finally:
                os.close(fd)

    with pytest.raises(CorruptSourceError, match="changed while loading") as info:
        store.put_file("d", mixed_folder, progress=progress)
    assert str(path) in str(info.value)
    # small files are packed into the manifest by the calling thread, before the pool starts
    assert pooled == ([THREADS] if victim == "f063.npy" else [])
    _nothing_left(store, root, mixed_folder)


def test_running_out_of_inodes_in_the_middle_of_a_pooled_put(tmp_path: Path, pooled: list[int]) -> None:
    """The cache's file system runs out of inodes half way through the entries: the
    typed error, nothing published, nothing left in ``tmp/``."""
    with mounted_tmpfs(tmp_path / "few", "size=64m,nr_inodes=200") as mountpoint:
        root = mountpoint / "cache"
        store = Store(root)
        store.put_array("first", np.arange(3))
        with scratch_dir("pool-inodes") as folder:
            for i in range(150):  # two inodes an entry: a directory and its data file (not packed)
                np.save(folder / f"a{i:03d}.npy", np.full(9000, i))
            with pytest.raises(CacheFullError, match="inodes"):
                store.put_file("d", folder)
            assert pooled == [THREADS]
            assert os.listdir(root / "tmp") == []
            assert [e.key for e in store.list()] == ["first"]
            for name in os.listdir("/proc/self/fd"):
                try:
                    assert not os.readlink(f"/proc/self/fd/{name}").startswith(f"{folder}/")
                except OSError:
                    continue


def test_a_worker_error_is_raised_unchanged_once_every_thread_stopped() -> None:
    """``run_copies``: an error in a worker thread (not the caller) stops the others at
    their next item and is the very exception raised; no item runs twice, none after."""

    class Boom(Exception):
        pass

    boom = Boom("item failed")
    running = [0]
    ran: list[int] = []
    lock = threading.Lock()

    def work(index: int, add: object) -> None:
        with lock:
            running[0] += 1
            ran.append(index)
        try:
            time.sleep(0.001)
            if threading.current_thread() is not threading.main_thread() and index >= 10:
                raise boom
        finally:
            with lock:
                running[0] -= 1

    with pytest.raises(Boom) as info:
        copy_pool.run_copies(1000, work, THREADS, lambda n: None)
    assert info.value is boom
    assert running[0] == 0
    assert len(ran) == len(set(ran)) < 1000


def test_small_or_decoded_batches_stay_on_one_thread(store: Store) -> None:
    """The rule itself: many tiny files or a compressed member keep one thread."""
    with scratch_dir("pool-rule") as folder:
        for i in range(200):
            np.save(folder / f"s{i:03d}.npy", np.full(16, i))
        tiny = files.plan_sources("d", folder)
        assert copy_pool.copy_threads(tiny) == 1
        for i in range(80):
            np.save(folder / f"b{i:03d}.npy", np.zeros(64 << 10, np.float32))  # 256 KiB each
        plan = files.plan_sources("d", folder)
        cores = len(os.sched_getaffinity(0))
        assert copy_pool.copy_threads(plan) == min(cores, copy_pool.MAX_THREADS)
        np.savez_compressed(folder / "z.npz", x=np.zeros(1 << 16))
        assert copy_pool.copy_threads(files.plan_sources("d", folder)) == 1


def test_threads_that_cannot_start_leave_the_copy_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process at its thread limit (``RuntimeError: can't start new thread``): the items
    are all copied by the threads that did start, the calling one at least."""

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    done: list[int] = []
    reported: list[int] = []

    def work(index: int, add: Callable[[int], None]) -> None:
        done.append(index)
        add(10)

    copy_pool.run_copies(100, work, THREADS, reported.append)
    assert done == list(range(100)) and sum(reported) == 1000


def test_a_cancel_stops_a_worker_in_the_middle_of_its_file() -> None:
    """Progress raising in the calling thread stops a worker at its next chunk, not at the
    end of its (long) file: the daemon's job cancel stays prompt."""

    class Cancel(Exception):
        pass

    chunks: list[int] = []
    chunk_limit = 100_000

    def work(index: int, add: Callable[[int], None]) -> None:
        if threading.current_thread() is threading.main_thread():
            waited = 0
            while not chunks and waited < 60_000:  # until the worker is in its file (bounded)
                time.sleep(0.001)
                waited += 1
            add(1)  # the caller's item: its report raises Cancel
            return
        for _ in range(chunk_limit):  # a worker's huge file, one chunk at a time
            time.sleep(0.0001)
            chunks.append(index)
            add(1)

    def advance(nbytes: int) -> None:
        if chunks:
            raise Cancel("cancelled")

    with pytest.raises(Cancel):
        copy_pool.run_copies(4, work, 2, advance)
    assert 0 < len(chunks) < chunk_limit
