"""Evicting from a process lets go at once of what that process kept attached: the memory
returns to the system then, not at some later open; arrays the program holds stay valid.
Read from the kernel's view (``/proc/<pid>/maps``), in this process and in another."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

import shmcache
from shmcache import Store

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0
MiB = 1 << 20


def _mapped(pid: int | str, root: Path) -> list[str]:
    """The lines of ``/proc/<pid>/maps`` that map files under ``root``."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in maps.splitlines() if f"{root}/objects/" in line]


def _put_and_open_all(store: Store) -> None:
    store.put_array("a", np.ones(16 * MiB, np.uint8))
    store.put_strings("s", [f"path/{i}.jpg" for i in range(1000)])
    store.put_mapping("m", {"x": np.arange(10), "y": np.arange(20)})
    assert shmcache.open_array("a", root=store.root)[-1] == 1  # the module's store...
    assert store.open_strings("s")[3] == "path/3.jpg"  # ...and this one: both keep attachments
    assert store.open_mapping("m")["y"][5] == 5
    assert store.open("a").sum() == 16 * MiB


def test_evict_lets_go_of_this_process_attachments_at_once(store: Store) -> None:
    _put_and_open_all(store)
    assert _mapped("self", store.root)  # kept attached (warm) though the program dropped them
    for key in ("a", "s", "m"):
        shmcache.evict(key, root=store.root)
    assert _mapped("self", store.root) == []


def test_arrays_the_program_holds_stay_valid(store: Store) -> None:
    store.put_array("a", np.arange(4 * MiB, dtype=np.int64))
    view = store.open_array("a")[10:20]
    store.evict("a")
    (line,) = _mapped("self", store.root)
    assert line.endswith("(deleted)")
    assert view.tolist() == list(range(10, 20))
    del view
    assert _mapped("self", store.root) == []


def _evict_in_child(root: str, evicted: Event, done: Event, results: Any) -> None:
    store = Store(root)
    _put_and_open_all(store)
    results.put(len(_mapped("self", store.root)))
    for key in ("a", "s", "m"):
        store.evict(key)
    evicted.set()
    done.wait(WAIT_S)  # stays alive while the parent looks at its mappings


def test_another_process_that_evicts_lets_go_too(root: Path) -> None:
    evicted, done, results = CTX.Event(), CTX.Event(), CTX.Queue()
    child = CTX.Process(target=_evict_in_child, args=(str(root), evicted, done, results), daemon=True)
    child.start()
    try:
        assert results.get(timeout=WAIT_S) > 0
        assert evicted.wait(WAIT_S)
        assert child.pid is not None and _mapped(child.pid, root) == []
        assert os.listdir(root / "objects") == []
    finally:
        done.set()
        child.join(WAIT_S)
    assert child.exitcode == 0
