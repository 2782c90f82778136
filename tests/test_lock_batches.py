"""A batch with many keys in one lock file locks the file whole (one ``fcntl``, seen going
to the kernel), then unlocks the gaps between its keys: seen from other processes
(``F_GETLK``) it holds its keys' bytes and no other; it takes a file byte by byte where
another process holds any byte of it; it never waits holding a whole file (a process that
locks keys out of order cannot deadlock with it where it could not before, nor can a
batch of an older version); and, inside this process, it is the per-key locks it was
(other threads wait for its keys, get the file's others, keep theirs when it lets go; a
thread's own key lock nests either way)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from shmcache import LockTimeoutError, Store
from shmcache._store import key_slots, lock_batches, lock_table
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
    files = key_slots.slot_files(store.layout)
    found: dict[int, list[str]] = {i: [] for i in range(len(files))}
    n = 0
    while min(map(len, found.values())) < count:
        key = f"d/f{n:06d}"
        found[files.index(key_slots.key_slot(store.layout, key)[0])].append(key)
        n += 1
    return found


def _slot(store: Store, key: str) -> tuple[str, int]:
    return key_slots.key_slot(store.layout, key)


@pytest.fixture
def store(root: Path) -> Store:
    store = Store(root)
    store.prepare()
    return store


_AUDITED_BATCH = """
import collections, fcntl, json, os, struct, sys
from shmcache import Store
from shmcache._store.locks import key_locks
calls = collections.Counter()
def audit(event, args):  # every fcntl F_SETLK this process makes, by file and kind
    if event == "fcntl.fcntl" and args[1] == fcntl.F_SETLK:
        kind, _, start, length, _ = struct.unpack("hhqqi4x", args[2])
        what = "unlock" if kind == fcntl.F_UNLCK else "whole" if (start, length) == (0, 0) else "byte"
        calls[f"{os.path.basename(os.readlink(f'/proc/self/fd/{args[0]}'))} {what}"] += 1
sys.addaudithook(audit)
with key_locks(Store(sys.argv[1]).layout, sys.argv[2:], 0):
    print(json.dumps(calls), flush=True)
    sys.stdin.readline()
"""


class AuditedBatch:
    """A real process holding ``key_locks`` of ``keys`` until closed; ``calls`` counts its
    ``F_SETLK`` calls (``"key-slots.00.lock whole"``: locks of a whole file, ``byte``: of
    one byte, ``unlock``: unlocks), as Python's audit hook saw them go to the kernel."""

    def __init__(self, store: Store, keys: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _AUDITED_BATCH, str(store.root), *keys],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.calls: dict[str, int] = json.loads(self.proc.stdout.readline())

    def __enter__(self) -> AuditedBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.communicate("\n", timeout=WAIT_S)
        assert self.proc.returncode == 0


def test_a_batch_with_many_keys_in_a_file_locks_it_whole_then_unlocks_the_gaps(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 10)
    path0 = key_slots.slot_files(store.layout)[0]
    many, few, outside = keys[0][:WHOLE_FILE_KEYS], keys[1][:10], keys[0][WHOLE_FILE_KEYS]
    with AuditedBatch(store, many + few) as batch:
        calls = batch.calls
        assert (calls["key-slots.00.lock whole"], calls.get("key-slots.00.lock byte")) == (1, None)
        assert calls["key-slots.00.lock unlock"] == WHOLE_FILE_KEYS + 1  # the gaps around its keys
        assert (calls.get("key-slots.01.lock whole"), calls["key-slots.01.lock byte"]) == (None, 10)
        # it holds its keys' bytes and nothing else, as byte by byte
        probed = [_slot(store, key)[1] for key in (many[0], many[-1], outside)]
        assert _holders(path0, *probed, FAR, 0) == [batch.proc.pid, batch.proc.pid, None, None, None]
        with (
            pytest.raises(LockTimeoutError, match=f"process {batch.proc.pid} "),
            key_lock(store.layout, many[5], 0),
        ):
            pass
    assert _holders(path0, _slot(store, many[0])[1]) == [None]
    with AuditedBatch(store, many[1:]) as batch:  # below the threshold: byte by byte
        assert batch.calls.get("key-slots.00.lock whole") is None
        assert batch.calls["key-slots.00.lock byte"] == WHOLE_FILE_KEYS - 1


def test_a_file_another_process_holds_a_byte_of_is_taken_byte_by_byte(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS)
    path0 = key_slots.slot_files(store.layout)[0]
    holder = subprocess.Popen(
        [sys.executable, "-c", _BYTE_HOLDER, path0, str(FAR)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        # no wait (timeout 0): the holder's byte is no key's
        with AuditedBatch(store, keys[0][:WHOLE_FILE_KEYS] + keys[1][:WHOLE_FILE_KEYS]) as batch:
            calls = batch.calls
            assert (calls["key-slots.00.lock whole"], calls["key-slots.00.lock byte"]) == (1, WHOLE_FILE_KEYS)
            assert (calls["key-slots.01.lock whole"], calls.get("key-slots.01.lock byte")) == (1, None)
            assert _holders(path0, FAR, _slot(store, keys[0][5])[1]) == [holder.pid, batch.proc.pid]
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


def test_a_batch_holds_no_whole_file_while_it_waits(store: Store) -> None:
    """Another process holds key A (lock file 1) and then wants key B of file 0, which the
    batch does not lock; the batch has many keys of file 0 and A. It takes file 0 through
    the whole file, then must wait for A: had it kept file 0 whole, the two would wait on
    each other (until the other process's bound); it holds only its keys' bytes, so B is
    free, as it is for a batch that locks byte by byte."""
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
        while not lock_table.holds(*_slot(store, batch[0])):  # it got file 0 and now waits for A
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
from shmcache._store import lock_batches, locks
if sys.argv[2] == "bytes":  # as a version before whole files does
    lock_batches.WHOLE_FILE_KEYS = 1 << 62
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
    path0 = key_slots.slot_files(store.layout)[0]
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
            assert _holders(path0, FAR) == [None]  # its keys' bytes only
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
    path0 = key_slots.slot_files(store.layout)[0]
    batch, outside = keys[0][:WHOLE_FILE_KEYS], keys[0][WHOLE_FILE_KEYS]
    me = os.getpid()
    byte = {key: _slot(store, key)[1] for key in (batch[3], batch[9], outside)}
    # a batch inside a key lock of this thread, in the same file: byte by byte (a whole file
    # narrowed to the batch's keys would have let go of the outer lock's byte too)
    with key_lock(store.layout, outside, 0):
        with key_locks(store.layout, batch, 0):
            assert _holders(path0, byte[outside], byte[batch[9]], FAR) == [me, me, None]
        assert _holders(path0, byte[outside], byte[batch[9]]) == [me, None]
    with key_lock(store.layout, batch[3], 0):  # one of its keys: reentered
        with key_locks(store.layout, batch, 0):
            pass
        assert _holders(path0, byte[batch[3]], byte[batch[9]]) == [me, None]
    # key locks inside a whole-file batch (``share()`` publishes under its key's lock)
    with key_locks(store.layout, batch, 0):
        with key_lock(store.layout, batch[3], 0), key_lock(store.layout, outside, 0):
            pass
        assert _holders(path0, byte[batch[3]], byte[outside], FAR) == [me, None, None]
        with key_locks(store.layout, [*batch[:5], outside], 0):  # a nested batch of some of them
            pass
        assert _holders(path0, byte[batch[3]], byte[outside]) == [me, None]
    assert _holders(path0, byte[batch[3]], byte[outside]) == [None, None]
    assert lock_table.TABLE.slots == {} and lock_table.TABLE.files == {}


_WHOLE_FILE_HOLDER = """
import os, sys, time
from shmcache._disk.fs import try_lock_range, unlock_range
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
assert try_lock_range(fd, 0, False, 0)  # what a big batch holds while it narrows
print("held", flush=True)
time.sleep(float(sys.argv[2]))
unlock_range(fd, 0, 0)
sys.stdin.readline()
"""


def test_a_caller_that_does_not_wait_gets_its_key_past_a_narrowing_batch(store: Store) -> None:
    """A whole-file lock of another process is a batch narrowing to its own keys: a key
    lock with ``timeout=0`` (an eviction's) polls past it, briefly, rather than being
    refused a key the batch does not hold; a byte lock still refuses it at once."""
    key = "d/alone"
    path, offset = _slot(store, key)
    with subprocess.Popen(
        [sys.executable, "-c", _WHOLE_FILE_HOLDER, path, "0.3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with key_lock(store.layout, key, 0):  # waits out the 0.3 s narrowing
            assert _holders(path, offset) == [os.getpid()]
        holder.communicate("", timeout=WAIT_S)
    with subprocess.Popen(
        [sys.executable, "-c", _BYTE_HOLDER, path, str(offset)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeoutError), key_lock(store.layout, key, 0):
            pass
        holder.communicate("", timeout=WAIT_S)


def test_an_interrupted_whole_file_take_leaves_nothing_locked(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception (Ctrl+C, MemoryError) after the whole-file lock, while the batch records
    its keys and narrows to them, releases the file: no key of it stays locked for the life
    of the process."""
    keys = _keys_by_file(store, WHOLE_FILE_KEYS)[0][:WHOLE_FILE_KEYS]
    path = _slot(store, keys[0])[0]
    real_unlock = lock_batches.unlock_all_but

    def failing_unlock(fd: int, keep: np.ndarray) -> None:
        real_unlock(fd, keep[-10:])  # some gaps unlocked, then Ctrl+C
        raise KeyboardInterrupt

    monkeypatch.setattr(lock_batches, "unlock_all_but", failing_unlock)
    with pytest.raises(KeyboardInterrupt), key_locks(store.layout, keys, 0):
        pass
    monkeypatch.setattr(lock_batches, "unlock_all_but", real_unlock)
    assert path not in lock_table.TABLE.files
    assert not [slot for slot in lock_table.TABLE.slots if slot[0] == path]
    assert _holders(path, *(_slot(store, k)[1] for k in keys[:20]), FAR) == [None] * 21


def test_a_batchs_bytes_through_a_whole_file_are_one_record(store: Store) -> None:
    """The bytes a batch takes through a whole file are one record of this process (their
    sorted offsets), not one per byte: 100,000 keys cost 32 records, not 100,000."""
    keys = _keys_by_file(store, WHOLE_FILE_KEYS + 40)
    path0, path1 = (key_slots.slot_files(store.layout)[i] for i in (0, 1))
    batch = keys[0][: WHOLE_FILE_KEYS + 40] + keys[1][:WHOLE_FILE_KEYS]
    with key_locks(store.layout, batch, 0):
        table = lock_table.TABLE
        assert table.slots == {}
        runs = [table.files[path].run for path in (path0, path1)]
        assert [len(r.offsets) for r in runs if r is not None] == [WHOLE_FILE_KEYS + 40, WHOLE_FILE_KEYS]
        assert [table.files[path].users for path in (path0, path1)] == [1, 1]
        assert lock_table.holds(*_slot(store, batch[7])) and not lock_table.holds(path0, FAR)
    assert lock_table.TABLE.slots == {} and lock_table.TABLE.files == {}


def test_a_nested_take_that_outlives_the_batch_keeps_its_byte(store: Store) -> None:
    keys = _keys_by_file(store, WHOLE_FILE_KEYS)[0][:WHOLE_FILE_KEYS]
    path0 = key_slots.slot_files(store.layout)[0]
    mine, other = _slot(store, keys[3])[1], _slot(store, keys[9])[1]
    inner = key_lock(store.layout, keys[3], 0)
    with key_locks(store.layout, keys, 0):
        inner.__enter__()  # not nested as a with block: it outlives the batch
    assert _holders(path0, mine, other, FAR) == [os.getpid(), None, None]
    inner.__exit__(None, None, None)
    assert _holders(path0, mine) == [None]
    assert lock_table.TABLE.slots == {} and lock_table.TABLE.files == {}


@pytest.mark.parametrize("others", [1, WHOLE_FILE_KEYS + 20])
def test_a_released_batch_leaves_other_threads_bytes_of_its_files_held(store: Store, others: int) -> None:
    """Another thread holds bytes of a file the batch took whole (byte by byte: the file is
    open): releasing the batch unlocks all of the file but those (few: one call a gap; many:
    one a batch byte), which stay this process's."""
    keys = _keys_by_file(store, 2 * WHOLE_FILE_KEYS + 20)[0]
    path0 = key_slots.slot_files(store.layout)[0]
    batch, theirs = keys[:WHOLE_FILE_KEYS], keys[WHOLE_FILE_KEYS : WHOLE_FILE_KEYS + others]
    probed = [_slot(store, key)[1] for key in (batch[0], batch[-1], theirs[0], theirs[-1])]
    held, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with key_locks(store.layout, theirs, 0):
                held.set()
                release.wait(WAIT_S)
        except BaseException as exc:
            errors.append(exc)
        finally:
            held.set()

    thread = threading.Thread(target=other)
    me = os.getpid()
    try:
        with key_locks(store.layout, batch, 0):
            thread.start()
            assert held.wait(WAIT_S) and errors == []
            assert lock_table.TABLE.files[path0].run is not None
            assert _holders(path0, *probed, FAR) == [me, me, me, me, None]
        assert _holders(path0, *probed, FAR) == [None, None, me, me, None]
        assert not lock_table.holds(path0, probed[0]) and lock_table.holds(path0, probed[2])
    finally:
        release.set()
        thread.join(WAIT_S)
    assert errors == [] and _holders(path0, *probed) == [None] * 4
    assert lock_table.TABLE.slots == {} and lock_table.TABLE.files == {}


def test_a_keys_lock_byte_is_the_roots_format_for_one_key_and_for_a_batch(store: Store) -> None:
    """The byte of a key is part of the root's format (every version must lock a key at the
    same place): blake2b-64 of the key, low 5 bits the file, the rest the byte; a batch
    maps its keys as one key does, sorted by file then byte, each once."""
    digest = int.from_bytes(hashlib.blake2b(b"d/f000001.npy", digest_size=8).digest(), "little")
    files = key_slots.slot_files(store.layout)
    assert key_slots.key_slot(store.layout, "d/f000001.npy") == (files[digest % 32], digest >> 6)
    assert files[digest % 32].endswith(f"key-slots.{digest % 32:02d}.lock")
    keys = [f"d/f{i:06d}.npy" for i in range(2000)]
    indexes, offsets = key_slots.key_slots([*keys, keys[5]])
    each = map(partial(key_slots.key_slot, store.layout), keys)
    one = sorted({(files.index(path), offset) for path, offset in each})
    assert list(zip(indexes.tolist(), offsets.tolist(), strict=True)) == one


def test_threads_of_batches_and_single_keys_never_hold_one_key_at_once(store: Store) -> None:
    """Two threads take random batches of one file's keys (whole-file records where the
    file is free in the process, byte by byte where not) while two others take single keys
    of them: no key is ever held by two threads, and none of them waits forever."""
    keys = _keys_by_file(store, 600)[0][:600]
    inside: dict[str, int] = {}
    guard = threading.Lock()
    errors: list[BaseException] = []

    def hold(held: list[str]) -> None:
        with guard:
            clash = [key for key in held if key in inside]
            assert not clash, f"held twice: {clash[:3]}"
            inside.update(dict.fromkeys(held, threading.get_ident()))
        time.sleep(0.001)
        with guard:
            for key in held:
                del inside[key]

    def batches(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                batch = rng.sample(keys, 300)
                with key_locks(store.layout, batch, WAIT_S):
                    hold(batch)
        except BaseException as exc:
            errors.append(exc)

    def singles(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                key = rng.choice(keys)
                with key_lock(store.layout, key, WAIT_S):
                    hold([key])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=batches, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=singles, args=(i,)) for i in range(2, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * WAIT_S)
    assert not any(thread.is_alive() for thread in threads) and errors == []
    assert lock_table.TABLE.slots == {} and lock_table.TABLE.files == {}


def test_unlock_all_but_keeps_byte_zero_and_offsets_past_float_precision(tmp_path: Path) -> None:
    """The gaps are computed in int64 whatever ``keep`` holds: with byte 0 kept, an empty
    piece once made numpy round the 58-bit gap starts through float64, and kept bytes near
    2**57 were unlocked (another process could then take those keys)."""
    from shmcache._disk.fs import try_lock_range, unlock_all_but, unlock_range

    path = tmp_path / "slots.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    base = 1 << 57
    try:
        for keep in ([1, base + 1, base + 3], [0, base + 1, base + 3]):
            assert try_lock_range(fd, 0, False, 0)  # the whole file
            unlock_all_but(fd, np.array(keep, np.int64))
            free = [2, base, base + 2, base + 4]
            seen = subprocess.run(
                [sys.executable, "-c", _PROBE, str(path), *map(str, keep + free)],
                capture_output=True,
                text=True,
                check=True,
                timeout=WAIT_S,
            ).stdout.split()
            assert seen[: len(keep)] == [str(os.getpid())] * len(keep), (keep, seen)
            assert seen[len(keep) :] == ["None"] * len(free), (keep, seen)
            unlock_range(fd, 0, 0)
    finally:
        os.close(fd)


def test_one_root_reached_through_a_symlink_is_one_set_of_locks(store: Store, tmp_path: Path) -> None:
    """The process's record of held bytes is keyed by the lock file's path, and fcntl locks of
    one process never exclude each other: a root opened as itself and through a symlink must
    name each lock file once, or two threads hold one key at once."""
    store.prepare()
    link = tmp_path / "root-link"
    link.symlink_to(store.layout.root)
    through_link = Store(link)
    got: list[str] = []

    def second() -> None:
        try:
            with key_lock(through_link.layout, "victim", 0):
                got.append("held it too")
        except LockTimeoutError:
            got.append("refused")

    with key_lock(store.layout, "victim", 0):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(WAIT_S)
    assert got == ["refused"]
    with key_lock(through_link.layout, "victim", 0):  # free again, through either spelling
        pass
