"""A directory put publishes its entries as one batch (issue 11, item 5): all of them or
none, and readers that list or open the group meanwhile see the whole old set or the whole
new one, never a mix. Real processes, a real root on the tmpfs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmcache import KeyExistsError, KeyNotFoundError, Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 120.0  # bound on every wait, so a broken build fails instead of hanging
FILES = 200
ROUNDS = 12


def _write_sources(directory: Path, generation: int, files: int = FILES) -> None:
    """``files`` small arrays whose every value is ``generation`` (so a reader can tell)."""
    directory.mkdir(parents=True)
    for i in range(files):
        np.save(directory / f"f{i:04d}.npy", np.full(16, generation, dtype=np.int64))


def _generation_of_source(source: str | None) -> int:
    assert source is not None
    return int(Path(source).parent.name.removeprefix("gen"))


def _read_snapshots(root: str, done: Event, results: Any) -> None:
    """List and open the group in a loop; report the generations each snapshot held."""
    store = Store(root)
    listed: list[list[int]] = []
    opened: list[list[int]] = []
    stale = 0
    while True:
        last = done.is_set()  # one more full round after the writer finished
        infos = store.list("d")
        listed.append([*sorted({_generation_of_source(info.source) for info in infos}), len(infos)])
        try:
            group = store.open_group("d")
            values = {int(group[name][0]) for name in group}
            opened.append([*sorted(values), len(group)])
        except KeyNotFoundError:  # republished before this snapshot was read: open it again
            stale += 1
        if last:
            break
    results.put((listed, opened, stale))


def _start(target: Any, *args: Any) -> BaseProcess:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def test_readers_see_a_republished_directory_all_old_or_all_new(
    store: Store, root: Path, tmp_path: Path
) -> None:
    _write_sources(tmp_path / "gen0", 0)
    store.put_file("d", tmp_path / "gen0")
    done, results = CTX.Event(), CTX.Queue()
    readers = [_start(_read_snapshots, str(root), done, results) for _ in range(2)]
    try:
        for generation in range(1, ROUNDS + 1):
            _write_sources(tmp_path / f"gen{generation}", generation)
            store.put_file("d", tmp_path / f"gen{generation}", overwrite=True)
    finally:
        done.set()
        reports = [results.get(timeout=WAIT_S) for _ in readers]
        for proc in readers:
            proc.join(WAIT_S)
            assert proc.exitcode == 0
    seen = set()
    for listed, opened, _stale in reports:
        assert listed and opened
        for snapshot in listed + opened:
            *generations, count = snapshot
            assert len(generations) == 1, f"a snapshot mixed generations {generations}"
            assert count == FILES
            seen.add(generations[0])
        assert listed[-1] == [ROUNDS, FILES] and opened[-1] == [ROUNDS, FILES]
    assert seen <= set(range(ROUNDS + 1))


def _publish_one(root: str, key: str) -> None:
    code = f"import numpy as np, shmcache; shmcache.Store({root!r}).put_array({key!r}, np.full(16, -1))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_S)


def test_a_conflict_in_a_batch_publishes_none_of_it(store: Store, root: Path, tmp_path: Path) -> None:
    _write_sources(tmp_path / "src", 7, files=500)
    raced = False

    def progress(done: int, total: int) -> None:
        nonlocal raced
        if not raced and done > total // 2:  # after the checks, before the publish
            raced = True
            _publish_one(str(root), "d/f0450")

    with pytest.raises(KeyExistsError, match="d/f0450"):
        store.put_file("d", tmp_path / "src", progress=progress)
    assert raced
    assert [info.key for info in store.list()] == ["d/f0450"]  # the other process's entry only
    np.testing.assert_array_equal(store.open_array("d/f0450"), np.full(16, -1))
    assert os.listdir(root / "tmp") == []
    assert len(os.listdir(root / "objects")) == 1


def test_a_batch_replaces_every_entry_and_removes_the_old_versions(
    store: Store, root: Path, tmp_path: Path
) -> None:
    _write_sources(tmp_path / "a", 1, files=50)
    _write_sources(tmp_path / "b", 2, files=50)
    keys = store.put_file("d", tmp_path / "a")
    assert store.put_file("d", tmp_path / "b", overwrite=True) == keys
    assert {int(store.open_array(key)[0]) for key in keys} == {2}
    (batch,) = os.listdir(root / "objects")  # issue 22: one version for the whole directory
    assert sorted(os.listdir(root / "objects" / batch)) == ["manifest", "packed"]  # small files packed
    assert {store.info(key).version.partition("/")[0] for key in keys} == {batch}
    assert os.listdir(root / "tmp") == []
    assert all(store.verify(key) for key in keys)


def test_a_group_is_a_snapshot_of_versions(store: Store, tmp_path: Path) -> None:
    _write_sources(tmp_path / "a", 1, files=3)
    _write_sources(tmp_path / "b", 2, files=4)
    store.put_file("d", tmp_path / "a")
    group = store.open_group("d")
    kept = group["f0000"]
    store.put_file("d", tmp_path / "b", overwrite=True)
    assert list(group) == ["f0000", "f0001", "f0002"]  # the names it was opened with
    assert int(group["f0000"][0]) == 1 and kept is group["f0000"]  # opened before: kept
    with pytest.raises(KeyNotFoundError, match="open the group again"):
        group["f0001"]  # not opened before the republish, and that version is gone
    again = store.open_group("d")
    assert len(again) == 4 and {int(again[name][0]) for name in again} == {2}


@pytest.mark.parametrize("lock_file", [True, False], ids=["with-publish-lock", "root-older-than-it"])
def test_a_cache_mounted_read_only_lists_and_opens_groups(tmp_path: Path, lock_file: bool) -> None:
    """Readers never write: a pod that mounts the node's cache read-only (deploy/kubernetes)
    lists and opens groups, whether or not a publisher ever created the publish lock."""
    from tests.service_helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "node", "size=8m") as mountpoint:
        source = tmp_path / "src"
        source.mkdir()
        for i in range(3):
            np.save(source / f"part{i}.npy", np.full(4, i))
        Store(mountpoint / "cache").put_file("d", source)
        lock = mountpoint / "cache" / "locks" / "publish.lock"
        assert lock.exists()
        if not lock_file:
            lock.unlink()
        command = ["mount", "-o", "remount,ro", str(mountpoint)]
        remount = subprocess.run(command, capture_output=True, text=True)
        if remount.returncode:
            pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
        reader = Store(mountpoint / "cache")
        assert [e.key for e in reader.list()] == ["d/part0", "d/part1", "d/part2"]
        group = reader.open_group("d")
        assert sorted(group) == ["part0", "part1", "part2"] and group["part2"][0] == 2
        assert reader.open_array("d/part1")[-1] == 1
