"""Partial writes in ``<root>/tmp`` (issue: a load killed by ``kill -9`` left its copy there,
invisible to ``stats``, blamed on the tmpfs by ``doctor``, and the next put failed with
"evict entries" although there was nothing to evict): a put short of room removes what dead
writers left, as ``cleanup`` does, and never a live writer's; what is left is named.

Real processes on a small tmpfs of their own (needs root: skipped elsewhere), real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import CLI, save
from service_helpers import clean_env, disk_usage, mounted_tmpfs, running_daemon, wait_for

from shmcache import CacheFullError, Store
from shmcache._diagnose.doctor import run_checks

MiB = 1 << 20
WAIT_S = 60.0

_PAUSED_PUT = """
import signal, sys
from shmcache import Store
root, source, ready = sys.argv[1:]
def pause(done, total):  # every byte copied into tmp/, nothing published: wait here
    if done >= total:
        open(ready, "w").close()
        while True:
            signal.pause()
Store(root).put_file("paused", source, progress=pause)
"""


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of its own (needs root); unmounted afterwards whatever happens."""
    with mounted_tmpfs(tmp_path / "tmpfs", "size=32m") as mountpoint:
        yield mountpoint


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    """A 16 MiB source (the write left partial) and a 20 MiB one (the put that needs its room),
    outside the small tmpfs."""
    return (
        save(tmp_path / "e16.npy", np.full(16 * MiB, 16, np.uint8)),
        save(tmp_path / "e20.npy", np.full(20 * MiB, 20, np.uint8)),
    )


def _paused_writer(root: Path, source: Path, ready: Path) -> subprocess.Popen[bytes]:
    """A process paused inside ``put_file`` with all of ``source`` copied into ``root/tmp``."""
    writer = subprocess.Popen([sys.executable, "-c", _PAUSED_PUT, str(root), str(source), str(ready)],
                              env=clean_env())
    wait_for(lambda: ready.exists() or writer.poll() is not None, timeout=WAIT_S, what="the writer to pause")
    assert writer.poll() is None, f"the writer exited ({writer.returncode}) before pausing"
    return writer


def _kill_9(writer: subprocess.Popen[bytes]) -> None:
    if writer.poll() is None:
        os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait(WAIT_S) == -signal.SIGKILL


def _put_in_a_fresh_process(root: Path, source: Path, key: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "put", str(source), "--key", key, "--root", str(root)],
                          capture_output=True, text=True, env=clean_env(), timeout=WAIT_S)


def test_a_put_short_of_room_removes_what_a_killed_writer_left(
    tmpfs: Path, tmp_path: Path, sources: tuple[Path, Path]
) -> None:
    root = tmpfs / "cache"
    _kill_9(_paused_writer(root, sources[0], tmp_path / "ready"))
    assert disk_usage(root / "tmp") >= 16 * MiB  # the killed writer's partial copy

    put = _put_in_a_fresh_process(root, sources[1], "again")  # 20 MiB: only fits without it

    assert put.returncode == 0, put.stderr
    assert put.stdout.split() == ["again"]
    assert os.listdir(root / "tmp") == []  # the dead partial is gone, and nothing else is left
    store = Store(root)
    assert [e.key for e in store.list()] == ["again"]
    np.testing.assert_array_equal(store.open_array("again")[-4:], [20] * 4)
    assert store.cleanup() == 0


def test_a_live_writers_partial_is_never_removed_and_the_error_names_it(
    tmpfs: Path, tmp_path: Path, sources: tuple[Path, Path]
) -> None:
    root = tmpfs / "cache"
    writer = _paused_writer(root, sources[0], tmp_path / "ready")
    try:
        before = sorted(os.listdir(root / "tmp"))
        put = _put_in_a_fresh_process(root, sources[1], "again")
        assert put.returncode == 1, put.stderr
        error = put.stderr.strip().splitlines()[-1]
        assert f"16.0 MiB is held by other writes in progress in {root}/tmp (not entries)" in error, error
        assert "evict" not in error, error  # the root holds no entry to evict
        assert "wait for those writes to end or enlarge /dev/shm" in error, error
        with pytest.raises(CacheFullError, match="held by other writes in progress") as raised:
            Store(root).put_array("here", np.ones(20 * MiB, np.uint8))
        assert type(raised.value) is CacheFullError
        assert Store(root).cleanup() == 0  # cleanup keeps it too
        assert sorted(os.listdir(root / "tmp")) == before
        assert disk_usage(root / "tmp") >= 16 * MiB
        assert writer.poll() is None
    finally:
        _kill_9(writer)
    assert _put_in_a_fresh_process(root, sources[1], "again").returncode == 0  # its writer died


def test_stats_and_doctor_show_partial_writes(
    tmpfs: Path, tmp_path: Path, sources: tuple[Path, Path]
) -> None:
    root = tmpfs / "cache"
    writer = _paused_writer(root, sources[0], tmp_path / "ready")
    try:
        assert Store(root).stats().partial_bytes == disk_usage(root / "tmp") >= 16 * MiB
        with running_daemon(root) as daemon, daemon.client() as http:  # its start's cleanup keeps it
            assert http.get("/v1/stats").json()["partial_bytes"] >= 16 * MiB
    finally:
        _kill_9(writer)
    stats = subprocess.run([*CLI, "stats", "--root", str(root)], capture_output=True, text=True,
                           env=clean_env(), timeout=WAIT_S)
    assert stats.returncode == 0, stats.stderr
    assert ("partial:  16.0 MiB in writes in progress or left by dead writers (shmcache cleanup frees "
            "the dead ones)") in stats.stdout, stats.stdout
    shm = next(check for check in run_checks(root) if check.name == "shm")
    assert f"16.0 MiB of what is used is partial writes in {root}/tmp" in shm.summary, shm.summary
    assert shm.details["partial_bytes"] >= 16 * MiB

    assert Store(root).cleanup() >= 16 * MiB
    assert Store(root).stats().partial_bytes == 0
    stats = subprocess.run([*CLI, "stats", "--root", str(root)], capture_output=True, text=True,
                           env=clean_env(), timeout=WAIT_S)
    assert "partial:" not in stats.stdout, stats.stdout


def test_a_migrations_staged_link_is_kept_while_fresh(store: Store) -> None:
    """A format-1 migration stages its link in tmp/ with no writer's lock: the sweep of a
    put short of room leaves it alone for the staging grace, as a staging lock file."""
    from shmcache._disk.entry_tree import MIGRATING_PREFIX
    from shmcache._store.maintenance import remove_dead_partials

    store.put_array("k", np.arange(4))
    link = store.layout.tmp / f"{MIGRATING_PREFIX}{os.getpid()}-0a0b0c0d.link"
    link.symlink_to("../objects/none")
    remove_dead_partials(store.layout)
    assert link.is_symlink()
    old = os.lstat(link).st_mtime - 3600
    os.utime(link, (old, old), follow_symlinks=False)
    remove_dead_partials(store.layout)
    assert not link.is_symlink() and store.open_array("k").tolist() == [0, 1, 2, 3]
