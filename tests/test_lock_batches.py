"""A batch with many keys in one lock file locks the file whole: seen from other processes
(``F_GETLK``) as holding every byte of it; falling back to bytes where another process
holds any; narrowed to its bytes before it waits (so a process that locks keys out of
order cannot deadlock with it where it could not before); and, inside this process,
exactly the per-key locks it was before (other threads wait for its keys, get the file's
others, keep theirs when it lets go; a thread's own key lock nests)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shmcache import LockTimeoutError, Store
from shmcache._store import locks
from shmcache._store.locks import WHOLE_FILE_KEYS, key_lock, key_locks

WAIT_S = 60.0  # bound on every wait, so a broken build fails instead of hanging
FAR = (1 << 58) + 7  # a byte of a lock file that no key maps to (hashes are 58 bits)

_PROBE = """
import os, sys
from shmcache._disk.fs import range_lock_holder
fd = os.open(sys.argv[1], os.O_RDWR)
print(" ".join(str(range_lock_holder(fd, int(o), False)) for o in sys.argv[2:]))
"""

_BYTE_HOLDER = """
import os, sys
from shmcache._disk.fs import try_lock_range
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
assert try_lock_range(fd, int(sys.argv[2]), False)
print("held", flush=True)
sys.stdin.readline()
"""


def _holders(path: str, *offsets: int) -> list[int | None]:
    """Who holds each byte of ``path``, asked by another process: a pid, or None if free."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, path, *map(str, offsets)], capture_output=True, text=True, check=True
    ).stdout.split()
    return [None if word == "None" else int(word) for word in out]


def _keys_by_file(store: Store, count: int) -> dict[int, list[str]]:
    """At least ``count`` keys for each lock file, by file index."""
    files = locks._slot_files(store.layout)
    found: dict[int, list[str]] = {i: [] for i in range(len(files))}
    n = 0
    while min(map(len, found.values())) < count:
        key = f"d/f{n:06d}"
        found[files.index(locks._key_slot(store.layout, key)[0])].append(key)
        n += 1
    return found


def _slot(store: Store, key: str) -> tuple[str, int]:
    return locks._key_slot(store.layout, key)


@pytest.fixture
def store(root: Path) -> Store:
    store = Store(root)
    store.prepare()
    return store


def test_a_batch_with_many_keys_in_a_file_locks_it_whole(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 10)
    path0, path1 = (locks._slot_files(store.layout)[i] for i in (0, 1))
    me = os.getpid()
    many, few = keys[0][:WHOLE_FILE_KEYS], keys[1][:10]
    with key_locks(store.layout, many + few, 0):
        # a byte no key maps to: held in the file of many keys, free in the file of few
        assert _holders(path0, FAR, 12345) == [me, me]
        assert _holders(path1, FAR, _slot(store, few[0])[1]) == [None, me]
    assert _holders(path0, FAR, _slot(store, many[0])[1]) == [None, None]
    with key_locks(store.layout, keys[0][: WHOLE_FILE_KEYS - 1], 0):  # below the threshold: bytes
        assert _holders(path0, FAR) == [None]


def test_a_file_another_process_holds_a_byte_of_is_taken_byte_by_byte(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS)
    path0, path1 = (locks._slot_files(store.layout)[i] for i in (0, 1))
    holder = subprocess.Popen(
        [sys.executable, "-c", _BYTE_HOLDER, path0, str(FAR)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        me = os.getpid()
        with key_locks(store.layout, keys[0] + keys[1], 0):  # no wait: the holder's byte is no key's
            assert _holders(path0, FAR, FAR + 1, _slot(store, keys[0][5])[1]) == [holder.pid, None, me]
            assert _holders(path1, FAR) == [me]  # the next file is still taken whole
        assert _holders(path0, FAR, _slot(store, keys[0][5])[1]) == [holder.pid, None]
    finally:
        holder.communicate("\n", timeout=WAIT_S)


_OUT_OF_ORDER = """
import sys
from shmcache import Store
from shmcache._store.locks import key_lock
layout = Store(sys.argv[1]).layout
with key_lock(layout, sys.argv[2], 5):
    print("held", flush=True)
    sys.stdin.readline()
    with key_lock(layout, sys.argv[3], 20):  # a key of an earlier lock file: out of order
        print("got it", flush=True)
"""


def test_a_batch_narrows_its_whole_files_before_it_waits(store: Store) -> None:
    """Another process holds key A (lock file 1) and then wants key B of file 0, which the
    batch does not lock; the batch has many keys of file 0 and A. It takes file 0 whole,
    then must wait for A: had it kept file 0 whole, the two would wait on each other (until
    the other process's bound); it holds only its keys' bytes while waiting, so B is free."""
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 1)
    b, a = keys[0][0], keys[1][0]
    batch = [*keys[0][1:], a]
    other = subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_ORDER, str(store.root), a, b],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    errors: list[BaseException] = []

    def put() -> None:
        try:
            with key_locks(store.layout, batch, 30):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=put)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        thread.start()
        deadline = time.monotonic() + WAIT_S
        while _slot(store, batch[0]) not in locks._slots:  # it got file 0 and now waits for A
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        out, err = other.communicate("\n", timeout=WAIT_S)
        assert (out, other.returncode) == ("got it\n", 0), err
    finally:
        other.kill()
        other.wait()
        thread.join(WAIT_S)
    assert not thread.is_alive() and errors == []


_BATCHES = """
import random, sys
from shmcache import Store
from shmcache._store import locks
if sys.argv[2] == "bytes":  # as a version before whole files does
    locks.WHOLE_FILE_KEYS = 1 << 62
layout = Store(sys.argv[1]).layout
keys = [f"d/f{i:06d}" for i in range(12000)]
rng = random.Random(sys.argv[2])
for _ in range(15):
    with locks.key_locks(layout, rng.sample(keys, 9000), 30):  # ~280 keys a file
        pass
print("done", flush=True)
"""


def test_a_whole_file_batch_and_a_byte_batch_of_an_older_process_never_deadlock(store: Store) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BATCHES, str(store.root), way], stdout=subprocess.PIPE, text=True
        )
        for way in ("bytes", "whole", "whole")
    ]
    try:
        outs = [proc.communicate(timeout=2 * WAIT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0] and outs == ["done\n"] * 3


def test_other_threads_wait_for_the_batchs_keys_get_the_files_others_and_keep_them(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 2)
    path0 = locks._slot_files(store.layout)[0]
    batch, outside, later = keys[0][:WHOLE_FILE_KEYS], keys[0][WHOLE_FILE_KEYS], keys[0][WHOLE_FILE_KEYS + 1]
    me = os.getpid()
    got, release, done = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with (
                pytest.raises(LockTimeoutError, match="another thread of this process"),
                key_lock(store.layout, batch[7], 0.2),
            ):
                pass
            with key_lock(store.layout, outside, 0):  # the process holds it already: no wait
                with key_lock(store.layout, later, 0):
                    pass  # taken and let go while the file is held whole
                got.set()
                release.wait(WAIT_S)
        except BaseException as exc:
            errors.append(exc)
        finally:
            got.set()
            done.set()

    thread = threading.Thread(target=other)
    outside_byte, later_byte = _slot(store, outside)[1], _slot(store, later)[1]
    try:
        with key_locks(store.layout, batch, 0):
            assert _holders(path0, FAR) == [me]  # whole
            thread.start()
            assert got.wait(WAIT_S) and errors == []
        # the batch let go: its keys and the rest of the file are free, the other thread's key is not
        probed = [outside_byte, later_byte, _slot(store, batch[7])[1], FAR, outside_byte + 1, 0]
        assert _holders(path0, *probed) == [me, None, None, None, None, None]
    finally:
        release.set()
    assert done.wait(WAIT_S) and errors == []
    thread.join(WAIT_S)
    assert _holders(path0, outside_byte) == [None]


def test_a_thread_nests_key_locks_and_a_batch_either_way(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 1)
    path0 = locks._slot_files(store.layout)[0]
    batch, outside = keys[0][:WHOLE_FILE_KEYS], keys[0][WHOLE_FILE_KEYS]
    me = os.getpid()
    # a batch inside a key lock of this thread (one of its keys): bytes, the key reentered
    with key_lock(store.layout, batch[3], 0):
        with key_locks(store.layout, batch, 0):
            assert _holders(path0, FAR, _slot(store, batch[9])[1]) == [None, me]
        assert _holders(path0, _slot(store, batch[3])[1], _slot(store, batch[9])[1]) == [me, None]
    # key locks inside a whole-file batch (``share()`` publishes under its key's lock)
    with key_locks(store.layout, batch, 0):
        with key_lock(store.layout, batch[3], 0), key_lock(store.layout, outside, 0):
            pass
        assert _holders(path0, FAR, _slot(store, batch[3])[1]) == [me, me]  # still whole
        with key_locks(store.layout, [*batch[:5], outside], 0):  # a nested batch of some of them
            pass
        assert _holders(path0, FAR, _slot(store, batch[3])[1]) == [me, me]
    assert _holders(path0, FAR, _slot(store, batch[3])[1], _slot(store, outside)[1]) == [None, None, None]
    assert locks._slots == {} and locks._files == {}
