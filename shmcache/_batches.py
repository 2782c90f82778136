"""Batches gathered in one operation, and the ``collate_fn`` that keeps them as they are
(imported by ``shmcache.torch`` only; shared by ``CachedDataset`` and ``TokenWindows``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import default_collate

__all__ = ["GatheredBatch", "collate"]


class GatheredBatch(Sequence[Any]):
    """What ``CachedDataset.__getitems__`` (and ``TokenWindows``') returns: ``columns``, the
    whole batch already gathered (one fancy index per array), and the same batch as a
    sequence of samples (for torch's ``default_collate``; made only on demand)."""

    def __init__(self, samples: Sequence[Any], columns: Any) -> None:
        self._samples = samples
        self.columns = columns

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: Any) -> Any:
        return self._samples[index]


def collate(batch: Any) -> Any:
    """``collate_fn`` that returns a ``GatheredBatch``'s columns as they are (no
    re-stacking); anything else goes to torch's ``default_collate``."""
    if isinstance(batch, GatheredBatch):
        return batch.columns
    return default_collate(batch)
