"""A directory put keeps each checked ``.npy`` open from its check to its copy, or reads a
small one whole when it checks it (issue 22 item 1): bounded by the descriptor limit and
a total of bytes, released on every outcome, and a file replaced or rewritten meanwhile
still fails the put with nothing published."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import scratch_dir
from source_times import age

from shmcache import Store
from shmcache._sources import files
from shmcache.errors import CorruptSourceError, KeyExistsError

FILES = 60
BIG = (2100, 8)  # int32: 67,328 bytes with its header, above what is read whole (64 KiB)
SMALL = (4, 8)  # 256 bytes: read whole when checked


def _folder(shape: tuple[int, int]) -> Iterator[Path]:
    with scratch_dir("dirput") as path:
        for i in range(FILES):
            np.save(path / f"f{i:03d}.npy", np.full(shape, i, np.int32))
        yield path


@pytest.fixture
def folder() -> Iterator[Path]:
    """Files too big to be read whole when checked: held open until copied."""
    yield from _folder(BIG)


@pytest.fixture
def small_folder() -> Iterator[Path]:
    yield from _folder(SMALL)


@pytest.fixture(params=["held", "read-whole"])
def any_folder(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from _folder(BIG if request.param == "held" else SMALL)


def _open_under(folder: Path) -> int:
    """Descriptors of this process open on files under ``folder``."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith(f"{folder}/")
        except OSError:
            continue
    return count


def _at_first_progress(action: Callable[[], None]) -> Callable[[int, int], None]:
    """A progress callback running ``action`` once: after every check, before any copy."""
    done: list[bool] = []

    def progress(_done: int, _total: int) -> None:
        if not done:
            done.append(True)
            action()

    return progress


def _nothing_published(store: Store, root: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub


def test_checked_files_stay_open_until_copied_then_close(store: Store, folder: Path) -> None:
    held: list[int] = []
    keys = store.put_file("d", folder, progress=_at_first_progress(lambda: held.append(_open_under(folder))))
    assert held == [FILES]  # every file checked is held, none reopened for its copy
    assert _open_under(folder) == 0
    assert len(keys) == FILES and int(store.open_array("d/f007")[0, 0]) == 7


def test_beyond_the_descriptor_budget_files_are_reopened(store: Store, folder: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    budget = 20
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (2 * (open_now + budget), hard))
    try:
        count = _at_first_progress(lambda: held.append(_open_under(folder)))
        keys = store.put_file("d", folder, progress=count)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(held) == 1 and 0 < held[0] <= budget + 2  # half the limit, less what was open
    assert len(keys) == FILES and int(store.open_array(f"d/f{FILES - 1:03d}")[0, 0]) == FILES - 1
    assert _open_under(folder) == 0


def test_small_files_are_read_whole_when_checked_and_closed(store: Store, small_folder: Path) -> None:
    held: list[int] = []
    count = _at_first_progress(lambda: held.append(_open_under(small_folder)))
    keys = store.put_file("d", small_folder, progress=count)
    assert held == [0]  # every file read whole and closed when checked, none open for its copy
    assert len(keys) == FILES and int(store.open_array("d/f007")[3, 7]) == 7
    assert store.verify("d/f059") is True  # the CRC recorded is that of the bytes written


def test_what_is_read_whole_is_capped_the_rest_held(
    store: Store, small_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = (small_folder / "f000.npy").stat().st_size
    monkeypatch.setattr(files, "_KEEP_TOTAL", 10 * size)  # room for 10 files' bytes
    held: list[int] = []
    keys = store.put_file(
        "d", small_folder, progress=_at_first_progress(lambda: held.append(_open_under(small_folder)))
    )
    assert held == [FILES - 10]
    assert _open_under(small_folder) == 0
    assert [int(store.open_array(k)[0, 0]) for k in keys] == list(range(FILES))


def test_a_failed_put_releases_what_it_held(store: Store, root: Path, any_folder: Path) -> None:
    folder = any_folder
    store.put_file("d", folder)
    with pytest.raises(KeyExistsError):
        store.put_file("d", folder)  # refused after planning: the plan's descriptors close
    assert _open_under(folder) == 0
    (folder / "zz.npy").write_bytes((folder / "f000.npy").read_bytes()[:100])  # truncated, planned last
    with pytest.raises(CorruptSourceError, match=r"zz\.npy"):
        store.put_file("e", folder)
    assert _open_under(folder) == 0


def _replace(path: Path) -> Callable[[], None]:
    def replace() -> None:
        path.with_suffix(".new").write_bytes(path.read_bytes())
        os.replace(path.with_suffix(".new"), path)

    return replace


def _rewrite(path: Path) -> Callable[[], None]:
    def rewrite() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x07" * 16, 200)
            os.utime(fd, ns=(0, 1))  # a time stamp the check cannot have seen
        finally:
            os.close(fd)

    return rewrite


@pytest.mark.parametrize("change", [_replace, _rewrite], ids=["replaced", "rewritten"])
def test_a_held_file_changed_before_its_copy_publishes_nothing(
    store: Store, root: Path, folder: Path, change: Callable[[Path], Callable[[], None]]
) -> None:
    """Held open when checked (bigger than what is read whole): changed before its copy,
    it fails the put."""
    victim = folder / "f030.npy"
    with pytest.raises(CorruptSourceError, match="changed while loading") as info:
        store.put_file("d", folder, progress=_at_first_progress(change(victim)))
    assert str(victim) in str(info.value)
    _nothing_published(store, root)
    assert _open_under(folder) == 0


def _replace_with_other(path: Path) -> Callable[[], None]:
    def replace() -> None:
        np.save(path.with_suffix(".new.npy"), np.full((2, 8), -1, np.int32))  # another size
        os.replace(path.with_suffix(".new.npy"), path)

    return replace


@pytest.mark.parametrize("change", [_replace_with_other, _rewrite], ids=["replaced", "rewritten"])
def test_a_file_read_whole_is_published_as_it_was_read(
    store: Store, small_folder: Path, change: Callable[[Path], Callable[[], None]]
) -> None:
    """Read whole when checked, a small file is a snapshot (as ``cp`` takes one): changed
    after that read, before the copy, the put publishes the bytes read, checksummed, and
    records the fingerprint of the file as it was read (which tells it from the new one)."""
    victim = small_folder / "f030.npy"
    age(victim)  # else racily clean (source_files.RACY_NS), as its fingerprint would say
    before = victim.stat()
    store.put_file("d", small_folder, progress=_at_first_progress(change(victim)))
    assert np.array_equal(store.open_array("d/f030"), np.full(SMALL, 30, np.int32))
    assert not np.array_equal(np.load(victim), np.full(SMALL, 30, np.int32))
    assert store.verify("d/f030") is True
    recorded = store.info("d/f030").source_fingerprint
    assert recorded == {"size": before.st_size, "mtime_ns": before.st_mtime_ns}
    assert recorded != {"size": victim.stat().st_size, "mtime_ns": victim.stat().st_mtime_ns}


def test_a_file_written_to_while_read_whole_publishes_nothing(
    store: Store, root: Path, small_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that begins between a small file's ``fstat`` and the end of its whole read
    (here: just before the read) moves its time stamps: the read may mix two states of
    the file, and the put fails naming it, with nothing published."""
    victim = str(small_folder / "f030.npy")
    pread = os.pread

    def written_meanwhile(fd: int, count: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == victim:
            _rewrite(Path(victim))()
        return pread(fd, count, offset)

    monkeypatch.setattr(os, "pread", written_meanwhile)
    with pytest.raises(CorruptSourceError, match="written to while read") as info:
        store.put_file("d", small_folder)
    assert victim in str(info.value)
    monkeypatch.undo()
    _nothing_published(store, root)
    assert _open_under(small_folder) == 0


def test_a_shared_header_is_parsed_once_but_each_size_is_checked(
    store: Store, root: Path, any_folder: Path
) -> None:
    """Every file of ``folder`` has the same header bytes: one truncated after its header
    (planned last) is still refused, naming it, though its header was parsed before."""
    folder = any_folder
    whole = (folder / "f000.npy").read_bytes()
    (folder / "zz.npy").write_bytes(whole[: len(whole) - 4])
    with pytest.raises(CorruptSourceError, match=r"zz\.npy: truncated"):
        store.put_file("d", folder)
    _nothing_published(store, root)
    assert _open_under(folder) == 0
