"""A Dataset over a SharedTable (a module of its own so spawn workers can import it)."""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import Dataset

import shmcache


class TableDataset(Dataset[Any]):
    """Holds a SharedTable opened in the parent; each item is its row plus the worker's pid."""

    def __init__(self, table: shmcache.SharedTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.table[i]
        row["bbox"].append(-1.0)  # mutating what we got must change nothing shared
        return {"index": i, "pid": os.getpid(), "again": self.table[i], "kind": type(self.table).__name__}
