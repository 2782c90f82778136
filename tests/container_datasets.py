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


class BlobsDataset(Dataset[Any]):
    """Holds a SharedBlobs opened in the parent; each item is its bytes and who read them."""

    def __init__(self, root: str) -> None:
        self.blobs = shmcache.open_blobs("imgs", root=root)

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "pid": os.getpid(), "bytes": self.blobs[i].tobytes()}


def as_tensor_sum(key: str, root: str) -> tuple[float, int]:
    """Used in a spawned process: tensor over the cache, mutated privately; its sum, and
    how many mappings of the entry's file the process holds (one: the private one)."""
    tensor = shmcache.torch.as_tensor(key, root=root)
    tensor.view(-1)[0] = -1.0
    array_file = f"/objects/{shmcache.Store(root).info(key).version}/{ARRAY_FILE}"
    with open("/proc/self/maps") as maps:
        mappings = sum(1 for line in maps if line.rstrip("\n").endswith(array_file))
    return float(tensor.sum()), mappings


__all__ = ["BlobsDataset", "SharedContainersDataset", "as_tensor_sum", "torch"]
