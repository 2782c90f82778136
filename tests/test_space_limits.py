"""Room on small tmpfs mounts of their own (needs root; skipped otherwise): running out of
inodes is a CacheFullError wherever it happens, and a free-space check counts what other
live writers reserved and have not written yet (issue 10, items 11 and 12)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import mounted_tmpfs

from shmcache import CacheFullError, Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0
MiB = 1 << 20


# ---------------------------------------------------------------------- out of inodes


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for bytes but for 64 files only."""
    with mounted_tmpfs(tmp_path / "few-inodes", "size=32m,nr_inodes=64") as mountpoint:
        yield mountpoint


def _free_inodes(path: Path) -> int:
    return os.statvfs(path).f_favail


def _leave_free(fillers: Path, inodes: int) -> None:
    """Fill the file system with empty files until exactly ``inodes`` are free."""
    fillers.mkdir(exist_ok=True)
    count = len(os.listdir(fillers))
    while _free_inodes(fillers) > inodes:
        (fillers / str(count)).touch()
        count += 1
    while _free_inodes(fillers) < inodes:
        count -= 1
        (fillers / str(count)).unlink()


def _what(message: str, root: Path) -> str:
    """What a CacheFullError says it was creating."""
    path = Path(message.split(" while creating ", 1)[1].split(": it has no free inodes", 1)[0])
    if path.name.endswith(".lock.new"):
        return "writer lock"
    if path.name.endswith(".link"):
        return "entry link"
    if path.name in ("data.npy", "meta.json"):
        return path.name
    if path.parent == root / "tmp":
        return "version directory"
    if path.name.endswith(".lock") and root / "locks" in path.parents:
        return "key lock"
    return str(path)


def _put_array(store: Store, key: str, _source: Path) -> None:
    store.put_array(key, np.arange(1000))


def _put_file(store: Store, key: str, source: Path) -> None:
    store.put_file(key, source)


def _cache(store: Store, key: str, _source: Path) -> None:
    store.cache(key, lambda: np.arange(1000))  # its key lock is the first file it creates


@pytest.mark.parametrize("put", [_put_array, _put_file, _cache], ids=["put_array", "put_file", "cache"])
def test_running_out_of_inodes_is_cache_full(
    few_inodes: Path, tmp_path: Path, put: Callable[[Store, str, Path], None]
) -> None:
    """With 0, 1, 2... inodes free, a put fails at each of the files it creates (writer lock,
    version directory, data, meta.json, key lock, entry link), always with CacheFullError
    and nothing left behind, until there are enough."""
    root = few_inodes / "cache"
    store = Store(root)
    store.put_array("first", np.arange(3))
    source = tmp_path / "x.npy"  # on another file system
    np.save(source, np.arange(1000))
    fillers = few_inodes / "fillers"
    failures = []
    for inodes in range(12):
        for slots in (root / "locks").glob("key-slots.*.lock"):  # shared by keys: each put creates
            slots.unlink()  # its key's lock file again, as when every key had a file of its own
        _leave_free(fillers, inodes)
        key = f"k{inodes}"
        try:
            put(store, key, source)
        except CacheFullError as exc:
            failures.append(str(exc))
            assert "inodes" in str(exc) and "nr_inodes" in str(exc)
            assert os.listdir(root / "tmp") == []
            assert [e.key for e in store.list()] == ["first"]
            assert not store.exists(key)
            continue
        assert store.open_array(key)[-1] == 999
        break
    else:
        pytest.fail(f"no put succeeded with up to 11 free inodes: {failures[-1]}")
    assert {_what(message, root) for message in failures} == {
        "writer lock", "version directory", "data.npy", "meta.json", "key lock", "entry link"
    }


def test_a_directory_put_out_of_inodes_is_cache_full(few_inodes: Path, tmp_path: Path) -> None:
    """A directory put (one batch version) run out of inodes at each file it creates, the
    entries' directories and data files among them (made relative to the batch's
    directory): always CacheFullError naming what it was creating, nothing left behind."""
    root = few_inodes / "cache"
    store = Store(root)
    store.put_array("first", np.arange(3))
    folder = tmp_path / "folder"  # on another file system
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"a{i}.npy", np.full(9000, i))  # over PACK_MAX: an entry directory each
    fillers = few_inodes / "fillers"
    named = set()
    for inodes in range(24):
        for slots in (root / "locks").glob("key-slots.*.lock"):
            slots.unlink()
        _leave_free(fillers, inodes)
        try:
            keys = store.put_file("d", folder)
        except CacheFullError as exc:
            assert "inodes" in str(exc) and "nr_inodes" in str(exc)
            assert os.listdir(root / "tmp") == []
            assert [e.key for e in store.list()] == ["first"]
            path = Path(str(exc).split(" while creating ", 1)[1].split(": it has no free inodes", 1)[0])
            if path.name == "data.npy" and path.parent.parent.parent == root / "tmp":
                named.add("entry data.npy")
            elif path.name.isdigit() and path.parent.parent == root / "tmp":
                named.add("entry directory")
            continue
        assert [int(store.open_array(key)[0]) for key in keys] == [0, 1, 2]
        break
    else:
        pytest.fail("no directory put succeeded with up to 23 free inodes")
    assert named == {"entry directory", "entry data.npy"}


# ---------------------------------------------------------------------- other writers' reservations


@pytest.fixture
def eight_mib(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "eight-mib", "size=8m") as mountpoint:
        yield mountpoint


def _load_and_hold(root: str, source: str, reserved: Event, go: Event, results: Any) -> None:
    """Load ``source``; after the room check (the first progress call), wait for ``go``."""

    def progress(done: int, _total: int) -> None:
        if done == 0:
            reserved.set()
            go.wait(WAIT_S)

    try:
        Store(root).put_file("first", source, progress=progress)
    except BaseException as exc:
        results.put(("first", type(exc).__name__, str(exc)))
    else:
        results.put(("first", "ok", ""))


def _put_now(root: str, results: Any) -> None:
    try:
        Store(root).put_array("second", np.ones(5 * MiB, np.uint8))
    except BaseException as exc:
        results.put(("second", type(exc).__name__, str(exc)))
    else:
        results.put(("second", "ok", ""))


def test_free_space_check_counts_other_writers(eight_mib: Path, tmp_path: Path) -> None:
    """Two real processes, no budget, 8 MiB: each 5 MiB load fits alone, not both. The
    second is refused at its check while the first, which checked first, is still writing;
    the first then completes (before: the second wrote, and the first failed midway)."""
    root = eight_mib / "cache"
    Store(root).prepare()
    source = tmp_path / "first.npy"  # on another file system
    np.save(source, np.full(5 * MiB, 7, np.uint8))
    reserved, go, results = CTX.Event(), CTX.Event(), CTX.Queue()
    first = CTX.Process(target=_load_and_hold, args=(str(root), str(source), reserved, go, results))
    first.start()
    try:
        assert reserved.wait(WAIT_S), "the first load never reached its copy"
        second = CTX.Process(target=_put_now, args=(str(root), results))
        second.start()
        second.join(WAIT_S)
        outcome = dict((who, (name, message)) for who, name, message in [results.get(timeout=WAIT_S)])
    finally:
        go.set()
        first.join(WAIT_S)
    outcome |= dict((who, (name, message)) for who, name, message in [results.get(timeout=WAIT_S)])
    assert outcome["second"][0] == "CacheFullError", outcome
    assert "reserved by writers still writing" in outcome["second"][1]
    assert outcome["first"] == ("ok", ""), outcome
    store = Store(root)
    assert [e.key for e in store.list()] == ["first"]
    assert int(store.open_array("first")[-1]) == 7
    assert os.listdir(root / "tmp") == []
