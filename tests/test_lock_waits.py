"""Every wait on a lock is bounded and explained: a holder stopped by SIGSTOP (Ctrl+Z) fails
its waiters within seconds with the holder's pid and ``kill -CONT``; a running holder is
waited for; the kernel releases the locks of a killed holder; a fork inherits none; and a
batch holds no descriptor per key."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import LockTimeoutError, Store
from shmcache._store.locks import (
    KEY_LOCK_FILES,
    STOPPED_GRACE_S,
    key_lock,
    key_locks,
    publish_lock,
    snapshot_lock,
)

WAIT_S = 60.0  # bound on every wait, so a broken build fails instead of hanging

_HOLDER = """
import sys, time, numpy as np
from shmcache import Store
store = Store(sys.argv[1])
def loader():
    print("loading", flush=True)
    sys.stdin.readline()  # until the test says so
    return np.arange(3)
store.cache(sys.argv[2], loader)
print("published", flush=True)
"""


class Holder:
    """A real process running ``cache(key)`` whose loader holds the key's lock until told."""

    def __init__(self, root: Path, key: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(root), key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "loading\n"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self) -> str:
        """Let the loader return; what the holder printed after."""
        os.kill(self.pid, signal.SIGCONT)
        out, _ = self.proc.communicate("go\n", timeout=WAIT_S)
        assert self.proc.returncode == 0
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(WAIT_S)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fp:
        return fp.read().rsplit(")", 1)[1].split()[0]


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while _state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_waiter_on_a_stopped_holder_fails_naming_it_and_resumes_after_sigcont(root: Path) -> None:
    """The issue's case: the default Store waited forever, without a word, on a lock held
    by a process stopped with Ctrl+Z. Now: a typed error naming the pid, its state and
    the fix, within seconds; after SIGCONT the holder finishes normally."""
    Store(root).prepare()
    holder = Holder(root, "k")
    try:
        _stop(holder.pid)
        store = Store(root)  # the default lock_timeout: an hour for a running holder
        started = time.monotonic()
        with pytest.raises(LockTimeoutError) as info:
            store.put_array("k", np.zeros(3))
        waited = time.monotonic() - started
        message = str(info.value)
        assert f"process {holder.pid} (python" in message and "stopped" in message
        assert f"kill -CONT {holder.pid}" in message and "'k'" in message
        assert STOPPED_GRACE_S <= waited < WAIT_S
        assert isinstance(info.value, TimeoutError) and type(info.value)(message).args == (message,)
        with pytest.raises(LockTimeoutError, match=f"kill -CONT {holder.pid}"):
            shmcache.cache("k", lambda: np.zeros(3), root=root)  # cache()'s default follows the store
        assert holder.finish() == "published\n"  # resumed, it goes on and publishes
    finally:
        holder.kill()
    assert store.open_array("k").tolist() == [0, 1, 2]


def test_a_running_holder_is_waited_for_beyond_the_stopped_grace(root: Path) -> None:
    """A loader that runs (here: for twice the grace a stopped one gets) is waited for, and
    its value is what the waiter gets."""
    Store(root).prepare()
    holder = Holder(root, "k")
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(Store(root).cache("k", lambda: np.full(3, 9))), daemon=True
    )
    try:
        waiter.start()
        time.sleep(2 * STOPPED_GRACE_S)
        assert waiter.is_alive() and not got  # still waiting, no error
        assert holder.finish() == "published\n"
        waiter.join(WAIT_S)
    finally:
        holder.kill()
    assert not waiter.is_alive()
    assert [a.tolist() for a in got] == [[0, 1, 2]]  # type: ignore[attr-defined]


def test_the_bound_on_a_running_holder_names_it_and_its_state(root: Path) -> None:
    Store(root).prepare()
    holder = Holder(root, "k")
    try:
        with pytest.raises(LockTimeoutError) as info:
            Store(root, lock_timeout=0.3).put_array("k", np.zeros(3))
        message = str(info.value)
        assert "gave up after 0.3 s" in message and f"process {holder.pid} (python" in message
        assert "running" in message and "lock_timeout" in message
    finally:
        holder.kill()


def test_lock_timeout_none_waits_for_a_stopped_holder_and_warns(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Store(root).prepare()
    holder = Holder(root, "k")
    done: list[str] = []

    def put() -> None:
        Store(root, lock_timeout=None).put_array("k", np.zeros(3), overwrite=True)
        done.append("put")

    waiter = threading.Thread(target=put, daemon=True)
    try:
        _stop(holder.pid)
        with caplog.at_level("WARNING", logger="shmcache._store.lock_holders"):
            waiter.start()
            time.sleep(STOPPED_GRACE_S + 1.0)
            assert waiter.is_alive() and not done  # still waiting, as asked
        assert f"kill -CONT {holder.pid}" in caplog.text
        assert holder.finish() == "published\n"
        waiter.join(WAIT_S)
    finally:
        holder.kill()
    assert done == ["put"] and Store(root).open_array("k").tolist() == [0.0, 0.0, 0.0]


def test_a_killed_holder_releases_its_locks(root: Path) -> None:
    Store(root).prepare()
    holder = Holder(root, "k")
    _stop(holder.pid)
    holder.proc.kill()  # kill -9 of a stopped process: the kernel drops its locks
    holder.proc.wait(WAIT_S)
    assert shmcache.cache("k", lambda: np.arange(2), root=root).tolist() == [0, 1]


_FORKING_HOLDER = """
import os, sys, time
from shmcache import Store
from shmcache._store.locks import key_lock
with key_lock(Store(sys.argv[1]).layout, "k", 0):
    child = os.fork()
    if child == 0:
        time.sleep(60)  # a DataLoader worker forked during the load, living on
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
"""


def test_a_fork_does_not_inherit_the_lock(root: Path) -> None:
    """A child forked while its parent holds a key (a DataLoader worker forked during a
    load) does not hold it: once the parent is killed, the key is free though the child
    lives on (an ``flock`` stayed locked as long as the child lived)."""
    store = Store(root)
    store.prepare()
    command = [sys.executable, "-c", _FORKING_HOLDER, str(root)]
    parent = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        with pytest.raises(LockTimeoutError, match=f"process {parent.pid} "), key_lock(store.layout, "k", 0):
            pass
        parent.kill()
        parent.wait(WAIT_S)
        assert _state(child) in "RS"  # alive
        with key_lock(store.layout, "k", 0):
            pass
    finally:
        parent.kill()
        os.kill(child, signal.SIGKILL)


def test_threads_of_one_process_wait_for_each_other_and_reenter(root: Path) -> None:
    store = Store(root)
    store.prepare()
    with key_lock(store.layout, "k", 0), key_lock(store.layout, "k", 0):  # reentrant per thread
        errors: list[BaseException] = []

        def other() -> None:
            try:
                with key_lock(store.layout, "k", 0.2):
                    pass
            except LockTimeoutError as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(WAIT_S)
        assert len(errors) == 1 and "another thread of this process" in str(errors[0])
    with key_lock(store.layout, "k", 0):  # released by the outermost exit
        pass


def test_a_reader_of_several_links_names_a_stopped_publisher(root: Path) -> None:
    """``list()`` waits on the publish lock while a batch swaps its links: a batch stopped
    there (Ctrl+Z during a big directory put) is named, not waited for forever."""
    store = Store(root)
    store.put_array("a", np.arange(2))
    code = (
        "import sys\n"
        "from shmcache import Store\n"
        "from shmcache._store.locks import publish_lock\n"
        "with publish_lock(Store(sys.argv[1]).layout, shared=False):\n"
        "    print('held', flush=True); sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        _stop(proc.pid)
        with pytest.raises(LockTimeoutError, match=f"the publish lock.*kill -CONT {proc.pid}"):
            store.list()
        os.kill(proc.pid, signal.SIGCONT)
        proc.communicate("go\n", timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(WAIT_S)
    assert [e.key for e in store.list()] == ["a"]
    with publish_lock(store.layout, shared=False):
        pass


def test_a_batch_of_many_keys_holds_a_bounded_number_of_descriptors(root: Path) -> None:
    store = Store(root)
    store.prepare()
    keys = [f"d/f{i:05d}" for i in range(5000)]
    before = len(os.listdir("/proc/self/fd"))
    with key_locks(store.layout, keys, 0):
        during = len(os.listdir("/proc/self/fd"))
        assert during - before <= KEY_LOCK_FILES
        taken = subprocess.run(
            [sys.executable, "-c", _TAKE_ONE, str(root), keys[1234]], capture_output=True, text=True
        )
        assert taken.returncode == 1 and "LockTimeoutError" in taken.stderr  # held: another process waits
        assert f"process {os.getpid()}" in taken.stderr
    assert len(os.listdir("/proc/self/fd")) <= before  # every lock file closed again
    subprocess.run([sys.executable, "-c", _TAKE_ONE, str(root), keys[1234]], check=True)


_TAKE_ONE = """
import sys
from shmcache import Store
from shmcache._store.locks import key_lock
with key_lock(Store(sys.argv[1]).layout, sys.argv[2], 0):
    pass
"""


def test_the_daemon_setting_bounds_its_loads_waits(root: Path) -> None:
    from shmcache.service.settings import Settings
    from shmcache.service.state import Service

    assert Service(Settings(root=root, lock_timeout=7.5)).load_store.lock_timeout == 7.5
    assert Service(Settings(root=root, lock_timeout="inf")).load_store.lock_timeout is None
    assert Service(Settings(root=root)).load_store.lock_timeout == 60.0


@pytest.mark.integration
def test_a_daemon_load_behind_a_stopped_holder_fails_naming_it(root: Path, tmp_path: Path) -> None:
    """Through the daemon, a load of a key whose lock a stopped process holds fails within
    seconds (not the load's 60 s), its error naming the pid and ``kill -CONT``."""
    from service_helpers import running_daemon, wait_job

    source = tmp_path / "x.npy"
    np.save(source, np.arange(4))
    with running_daemon(root, "--allow-source", str(tmp_path)) as daemon, daemon.client() as client:
        holder = Holder(root, "k")
        try:
            _stop(holder.pid)
            response = client.put("/v1/entries/k", json={"source": str(source)})
            assert response.status_code == 202, response.text
            job = wait_job(client, response.json()["id"], timeout=WAIT_S)
            assert job["state"] == "failed", job
            assert f"kill -CONT {holder.pid}" in str(job) and "LockTimeoutError" in str(job)
            assert holder.finish() == "published\n"
        finally:
            holder.kill()


def test_threads_and_processes_exclude_each_other_on_every_key(root: Path) -> None:
    """Mutual exclusion under contention: 4 threads in each of 2 processes increment counters
    in files under 3 keys' locks (a batch of all three, or one), read-modify-write with a
    yield in between; no increment is lost."""
    store = Store(root)
    store.prepare()
    counters = root.parent / f"{root.name}-counters"
    counters.mkdir()
    keys = ["a", "b", "c"]
    for key in keys:
        (counters / key).write_text("0")
    code = """
import sys, threading, time
from pathlib import Path
from shmcache import Store
from shmcache._store.locks import key_lock, key_locks
layout, counters, keys = Store(sys.argv[1]).layout, Path(sys.argv[2]), ["a", "b", "c"]
def bump(key):
    value = int((counters / key).read_text())
    time.sleep(0)
    (counters / key).write_text(str(value + 1))
def work(n):
    for i in range(100):
        if (i + n) % 4 == 0:
            with key_locks(layout, keys, 60):
                for key in keys:
                    bump(key)
        else:
            key = keys[(i + n) % 3]
            with key_lock(layout, key, 60), key_lock(layout, key, 60):
                bump(key)
threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
for thread in threads: thread.start()
for thread in threads: thread.join()
"""
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(counters)]) for _ in range(2)]
        assert [proc.wait(WAIT_S) for proc in procs] == [0, 0]
        expected = {key: 0 for key in keys}
        for n in range(4):
            for i in range(100):
                if (i + n) % 4 == 0:
                    for key in keys:
                        expected[key] += 2
                else:
                    expected[keys[(i + n) % 3]] += 2
        assert {key: int((counters / key).read_text()) for key in keys} == expected
    finally:
        shutil.rmtree(counters, ignore_errors=True)


def test_readers_share_the_publish_lock_and_a_publisher_waits_for_them(root: Path) -> None:
    store = Store(root)
    store.prepare()
    inside = threading.Barrier(3, timeout=WAIT_S)
    order: list[str] = []

    def reader() -> None:
        with snapshot_lock(store.layout):
            inside.wait()  # both readers hold it at once
            time.sleep(0.3)
            order.append("read")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers:
        thread.start()
    inside.wait()
    with publish_lock(store.layout, shared=False):
        order.append("published")
    for thread in readers:
        thread.join(WAIT_S)
    assert order == ["read", "read", "published"]


def test_overlapping_batches_in_two_processes_never_deadlock(root: Path) -> None:
    """Batches of hundreds of keys spread over every lock file, overlapping, taken over and
    over by 2 threads in each of 2 processes (the order each batch takes its locks in is
    the one thing that keeps them from waiting on each other in a cycle): all finish, none
    reaches its bound, and a single-key lock of a batched key is free again after."""
    store = Store(root)
    store.prepare()
    code = """
import random, sys, threading
from shmcache import Store
from shmcache._store.locks import key_locks
layout = Store(sys.argv[1]).layout
keys = [f"d/f{i:04d}" for i in range(600)]
def work(seed):
    rng = random.Random(seed)
    for _ in range(40):
        with key_locks(layout, rng.sample(keys, 300), 60):
            pass
threads = [threading.Thread(target=work, args=(int(sys.argv[2]) * 2 + n,)) for n in range(2)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print("done", flush=True)
"""
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(root), str(n)], stdout=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    try:
        outs = [proc.communicate(timeout=WAIT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0] and outs == ["done\n", "done\n"]
    subprocess.run([sys.executable, "-c", _TAKE_ONE, str(root), "d/f0123"], check=True)
