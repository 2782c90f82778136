"""Racily-clean sources (git's rule, ``_sources/source_files.RACY_NS``): Linux moves a
file's mtime when a ``write`` BEGINS, so a same-size write in place that began just before
a put's first ``fstat`` and still copies during its read leaves both ``fstat`` calls equal
and the file's time stamps already final: the bytes read may be torn, and a fingerprint of
``(size, mtime_ns)`` would match the file forever. A source modified within 2 s of its read
(or later: a clock ahead) is recorded ``"racy": 1``, which no up-to-date check accepts, so
the next preload loads it again; a source modified earlier is recorded as before.

No race is run here: the time stamps are set with ``os.utime`` (ahead of the clock: racy
however slow the machine; an hour back: clean)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from source_times import age

from shmcache import Store
from shmcache._sources.source_files import RACY_NS

pytest.importorskip("fastapi")
from shmcache.service.sources import is_up_to_date

SMALL = (4, 8)  # packed into the manifest, read whole when planned
BIG = (2100, 8)  # above 64 KiB: an entry directory of its own, copied from the file


def _modified_now(path: Path) -> None:
    """Modified now, as far as the put can tell (10 minutes ahead: racy whatever the delay
    before the put reads it)."""
    ahead = time.time_ns() + 600 * 1_000_000_000
    os.utime(path, ns=(ahead, ahead))


def _fingerprint(path: Path, racy: bool = False) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, **({"racy": 1} if racy else {})}


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["packed", "apart"])
def test_a_directory_put_records_a_file_modified_just_before_its_read_as_never_current(
    store: Store, tmp_path: Path, shape: tuple[int, int]
) -> None:
    top = tmp_path / "d"
    top.mkdir()
    for i in range(3):
        np.save(top / f"f{i}.npy", np.full(shape, i, np.int32))
    age(top)
    _modified_now(top / "f1.npy")
    store.put_file("d", top)
    assert store.info("d/f1").source_fingerprint == _fingerprint(top / "f1.npy", racy=True)
    assert store.info("d/f0").source_fingerprint == _fingerprint(top / "f0.npy")  # old: as before
    assert all(store.verify(f"d/f{i}") for i in range(3))
    assert not is_up_to_date(store, "d", top)  # unchanged since, yet not trusted: loaded again
    assert not is_up_to_date(store, "d", top)  # ... however often asked
    age(top / "f1.npy")  # left alone for a while: the next put records it clean
    store.put_file("d", top, overwrite=True)
    assert store.info("d/f1").source_fingerprint == _fingerprint(top / "f1.npy")
    assert is_up_to_date(store, "d", top)


def test_a_single_file_put_records_a_file_modified_just_before_its_read_as_never_current(
    store: Store, tmp_path: Path
) -> None:
    source = tmp_path / "a.npy"
    np.save(source, np.arange(10))
    _modified_now(source)
    store.put_file("a", source)
    assert store.info("a").source_fingerprint == _fingerprint(source, racy=True)
    assert not is_up_to_date(store, "a", source)
    age(source)
    store.put_file("a", source, overwrite=True)
    assert store.info("a").source_fingerprint == _fingerprint(source)
    assert is_up_to_date(store, "a", source)


def test_a_packed_directory_with_one_file_modified_just_before_its_read_is_never_current(
    store: Store, tmp_path: Path
) -> None:
    top = tmp_path / "images"
    top.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (top / name).write_bytes(name.encode() * 10)
    age(top)
    _modified_now(top / "b.jpg")
    store.put_file("imgs", top)
    fingerprint = store.info("imgs").source_fingerprint
    assert store.info("imgs").kind == "blobs" and fingerprint is not None and fingerprint["racy"] == 1
    assert not is_up_to_date(store, "imgs", top)
    age(top)
    store.put_file("imgs", top, overwrite=True)
    assert "racy" not in (store.info("imgs").source_fingerprint or {})
    assert is_up_to_date(store, "imgs", top)


def test_cache_versioned_by_a_file_modified_just_before_the_load_loads_again_once_it_is_old(
    store: Store, tmp_path: Path
) -> None:
    """``cache(version=path)``: a load made while the file was racily clean is taken by the
    calls of the next 2 s (one load across processes, as ever), and loaded again by the
    first call after it: the same file, now old, is another version. (This test waits
    those ~2 s; it bounds no duration.)"""
    source = tmp_path / "vocab.txt"
    source.write_text("a b")
    soon = time.time_ns() + 1_000_000_000  # racy for the next 3 s, however slow the machine is
    os.utime(source, ns=(soon, soon))
    calls: list[int] = []

    def load() -> np.ndarray:
        calls.append(1)
        return np.array(source.read_text().split())

    assert store.cache("words", load, version=source).tolist() == ["a", "b"]
    assert store.cache("words", load, version=source).tolist() == ["a", "b"]
    assert len(calls) == 1
    while time.time_ns() <= soon + RACY_NS:
        time.sleep(0.1)
    assert store.cache("words", load, version=source).tolist() == ["a", "b"]
    assert len(calls) == 2  # loaded again: it may have read the file mid-write
    assert store.cache("words", load, version=source).tolist() == ["a", "b"]
    assert len(calls) == 2  # then current, as any old file
