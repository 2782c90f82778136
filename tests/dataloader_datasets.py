"""Datasets for tests/test_dataloader.py, in their own light module.

``spawn`` and ``forkserver`` workers unpickle the Dataset by importing the module that
defines its class; keeping it out of the test module spares each worker importing
pytest. Classes here must stay at module level.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import shmcache
from shmcache._disk.mapped import MappedFile

__all__ = ["PackedKeysDataset", "SharedRowsDataset", "WorkerView", "describe_array"]

WorkerView = tuple[int, bool, bool, bool, str]
"""``(pid, base chain ends in a MappedFile, data file in /proc/self/maps, writeable,
base types)`` as one worker sees the Dataset's array."""


def describe_array(array: np.ndarray) -> WorkerView:
    """How this process holds ``array``: a shared mapping of the entry, or a private copy."""
    chain: list[Any] = []
    base: Any = array.base
    while base is not None:
        chain.append(base)
        base = getattr(base, "base", None)
    shared = bool(chain) and isinstance(chain[-1], MappedFile)
    mapped = False
    if shared:
        root, version, filename, _key = chain[-1].origin
        with open("/proc/self/maps") as maps:
            mapped = f"{root}/objects/{version}/{filename}" in maps.read()
    types = ">".join(type(b).__qualname__ for b in chain) or "none"
    return os.getpid(), shared, mapped, bool(array.flags.writeable), types


class SharedRowsDataset(Dataset[dict[str, Any]]):
    """Rows of one shared entry, opened once in ``__init__`` (the pattern users write).

    Each item carries the row three ways (a private tensor, the read-only numpy row
    itself for ``default_collate`` to convert, its index) plus how the worker that
    produced it holds the array.
    """

    def __init__(self, key: str) -> None:
        self.rows = shmcache.open_array(key)
        self._view: WorkerView | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._view is None or self._view[0] != os.getpid():
            self._view = describe_array(self.rows)
        pid, shared, mapped, writeable, types = self._view
        row = self.rows[index]
        return {
            "tensor": torch.from_numpy(row.copy()),
            "row": row,
            "index": index,
            "pid": pid,
            "shared": shared,
            "mapped": mapped,
            "writeable": writeable,
            "base_types": types,
        }


class PackedKeysDataset(Dataset[tuple[int, int, int]]):
    """Item ``i``: entry ``<prefix>/f<i>`` opened by key in the worker (what a Dataset of a
    folder's small files does), as ``(first value, mappings of manifests in this process,
    this process's pid)``."""

    def __init__(self, root: str, prefix: str, count: int) -> None:
        self.root, self.prefix, self.count = root, prefix, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        array = shmcache.open_array(f"{self.prefix}/f{index}", root=self.root)
        with open("/proc/self/maps") as maps:
            manifests = sum(
                1
                for line in maps
                if f"{self.root}/objects/" in line
                and line.rstrip().endswith(("/manifest", "/manifest (deleted)"))
            )
        return int(array[0]), manifests, os.getpid()
