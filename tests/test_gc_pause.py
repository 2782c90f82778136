"""A directory put pauses the cyclic garbage collector while it plans, copies and
publishes (a million cycle-free objects for 100,000 files), and gives it back as it found
it: after a put, after a failed put, and left off for a caller that turned it off."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmcache import Store
from shmcache.errors import CorruptSourceError


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def _folder(path: Path, count: int) -> Path:
    path.mkdir()
    for i in range(count):
        np.save(path / f"f{i:03d}.npy", np.full((4, 8), i, dtype=np.float32))
    return path


def test_the_collector_is_paused_during_a_directory_put_and_back_after(store: Store, tmp_path: Path) -> None:
    source = _folder(tmp_path / "src", 20)
    seen: list[bool] = []
    gc.enable()
    keys = store.put_file("d", source, progress=lambda done, total: seen.append(gc.isenabled()))
    assert len(keys) == 20
    assert seen and not any(seen)  # every progress call ran with the collector paused
    assert gc.isenabled()
    assert (store.open_array("d/f007") == 7).all()


def test_a_failed_directory_put_gives_the_collector_back(store: Store, tmp_path: Path) -> None:
    source = _folder(tmp_path / "src", 20)
    (source / "f010.npy").write_bytes(b"\x93NUMPY not a header")
    gc.enable()
    with pytest.raises(CorruptSourceError):
        store.put_file("d", source)
    assert gc.isenabled()
    assert store.list() == []


def test_a_collector_the_caller_turned_off_stays_off(store: Store, tmp_path: Path) -> None:
    source = _folder(tmp_path / "src", 5)
    gc.disable()
    store.put_file("d", source)
    assert not gc.isenabled()
