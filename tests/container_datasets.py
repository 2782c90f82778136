"""Datasets for the DataLoader tests (a module of its own so spawn workers can import it
without pytest)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

import shmcache
import shmcache.torch
from shmcache._disk.layout import ARRAY_FILE


class SharedContainersDataset(Dataset[Any]):
    """Holds a SharedStrings, SharedRecords and SharedMapping opened in the parent."""

    def __init__(self, root: str) -> None:
        self.paths = shmcache.open_strings("paths", root=root)
        self.anns = shmcache.open_records("anns", root=root)
        self.lengths = shmcache.open_mapping("lengths", root=root)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.paths[i]
        record = self.anns[i]
        record["mutated"] = True  # must never leak into the cache or the next access
        return {
            "index": i,
            "pid": os.getpid(),
            "path_ok": path == f"/data/{i:05d}.jpg",
            "record_ok": self.anns[i] == {"id": i, "label": f"c{i % 7}"},
            "lookup_ok": self.paths.index(path) == i and int(self.lengths[path]) == len(path),
            "kinds": "/".join(type(x).__name__ for x in (self.paths, self.anns, self.lengths)),
        }


def as_tensor_sum(key: str, root: str) -> float:
    """Used in a spawned process: tensor over the cache, mutated privately."""
    tensor = shmcache.torch.as_tensor(key, root=root)
    tensor.view(-1)[0] = -1.0
    return float(tensor.sum())


def mappings_after_as_tensor(key: str, root: str) -> int:
    """Used in a spawned process: how many mappings of the entry's file ``as_tensor`` made."""
    tensor = shmcache.torch.as_tensor(key, root=root)
    version = shmcache.Store(root).info(key).version
    array_file = f"/objects/{version}/{ARRAY_FILE}"
    with open("/proc/self/maps") as maps:
        count = sum(1 for line in maps if line.rstrip("\n").endswith(array_file))
    del tensor
    return count


__all__ = ["SharedContainersDataset", "as_tensor_sum", "mappings_after_as_tensor", "torch"]
