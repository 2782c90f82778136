"""Warm opens and per-key generations: a publish or evict of one key, by another process,
sends back to the disk only that key's warm opens (and any key sharing its slot); every
changed key is seen at its next open."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache._disk.layout import GENERATION_SLOTS, generation_slot


def _in_another_process(root: Path, code: str) -> None:
    """Run ``code`` with ``store`` on ``root`` in a fresh interpreter (a real other writer)."""
    script = f"import numpy as np, shmcache\nstore = shmcache.Store({str(root)!r})\n{code}"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.fixture
def disk_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many times this process has read an entry link (the start of every slow open)."""
    calls = [0]
    readlink = os.readlink

    def counting(path: str | os.PathLike[str], *args: object, **kwargs: object) -> str:
        calls[0] += 1
        return readlink(path, *args, **kwargs)  # type: ignore[arg-type,return-value]

    monkeypatch.setattr(os, "readlink", counting)
    return lambda: calls[0]


def _keys_with_distinct_slots(n: int) -> list[str]:
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < n:
        keys.setdefault(generation_slot(f"key{i}"), f"key{i}")
        i += 1
    return list(keys.values())


def test_publishing_another_key_keeps_warm_opens_warm(
    store: shmcache.Store, disk_reads: Callable[[], int]
) -> None:
    a, b = _keys_with_distinct_slots(2)
    store.put_array(a, np.arange(5))
    first = store.open_array(a)
    _in_another_process(store.root, f"store.put_array({b!r}, np.ones(3))")
    _in_another_process(store.root, f"store.put_array({b!r}, np.zeros(3), overwrite=True)")
    _in_another_process(store.root, f"store.evict({b!r})")
    before = disk_reads()
    assert store.open_array(a) is first
    assert disk_reads() == before  # answered from the warm table: no readlink


def test_a_key_changed_by_another_process_is_seen_at_its_next_open(store: shmcache.Store) -> None:
    a, b = _keys_with_distinct_slots(2)
    store.put_array(a, np.arange(5))
    store.put_array(b, np.arange(3))
    assert store.open_array(a).tolist() == [0, 1, 2, 3, 4]
    warm_b = store.open_array(b)
    _in_another_process(store.root, f"store.put_array({a!r}, np.full(2, 7), overwrite=True)")
    assert store.open_array(a).tolist() == [7, 7]
    assert store.open_array(b) is warm_b
    _in_another_process(store.root, f"store.evict({a!r})")
    with pytest.raises(shmcache.KeyNotFoundError):
        store.open_array(a)


def test_keys_sharing_a_slot_stay_correct(store: shmcache.Store) -> None:
    slots: dict[int, str] = {}
    i = 0
    while True:  # two keys whose slots collide (1,023 slots: a few dozen tries)
        key = f"k{i}"
        slot = generation_slot(key)
        if slot in slots:
            a, b = slots[slot], key
            break
        slots[slot] = key
        i += 1
    assert 1 <= generation_slot(a) < GENERATION_SLOTS
    store.put_array(a, np.arange(4))
    store.put_array(b, np.arange(6))
    warm_a = store.open_array(a)
    _in_another_process(store.root, f"store.put_array({b!r}, np.full(3, 9), overwrite=True)")
    assert store.open_array(b).tolist() == [9, 9, 9]
    again = store.open_array(a)  # its slot changed: resolved again, still the same version
    assert again is warm_a and again.tolist() == [0, 1, 2, 3]


def test_a_root_with_an_old_eight_byte_generation_file_is_grown(root: Path) -> None:
    """Roots written by shmcache before per-key generations keep working."""
    shmcache.Store(root).put_array("a", np.arange(3))
    (root / "generation").write_bytes(b"\0" * 8)
    store = shmcache.Store(root)
    store.put_array("b", np.arange(2))
    assert (root / "generation").stat().st_size == 8 * GENERATION_SLOTS
    assert store.open_array("a").tolist() == [0, 1, 2]
    _in_another_process(root, "store.put_array('a', np.arange(1), overwrite=True)")
    assert store.open_array("a").tolist() == [0]
