"""PyTorch helpers: tensors over cached arrays, and a Dataset with batched gathers.

Needs torch (``import shmcache`` never imports this module). Tensors made here share
the cache's memory without a copy and without torch's "non-writable NumPy array"
warning: they sit on a private copy-on-write mapping of the entry of their own, so a
training loop that writes into one changes only that tensor's copy of the touched pages,
never the cache, another process, or the arrays ``open_array`` returns.

Where the kernel refuses such a mapping (strict overcommit, ``vm.overcommit_memory=2``,
for an entry bigger than the room left under the commit limit), ``as_tensor`` raises
:class:`~shmcache.errors.MappingRefusedError` and ``CachedDataset`` reads the shared
read-only mapping and hands out copies of its rows.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # say what to install, not just "No module named 'torch'"
    raise ModuleNotFoundError(
        "shmcache.torch needs PyTorch, which is not installed: pip install torch "
        "(a CPU-only build: pip install torch --index-url https://download.pytorch.org/whl/cpu); "
        "the rest of shmcache works without it",
        name="torch",
    ) from exc
from torch.utils.data import Dataset, default_collate

from ._api import get_store
from ._disk.attach import private_view
from .errors import MappingRefusedError

__all__ = ["CachedDataset", "GatheredBatch", "as_tensor", "collate"]

Root = str | os.PathLike[str] | None


def as_tensor(array_or_key: np.ndarray | str, *, root: Root = None) -> torch.Tensor:
    """A CPU tensor over a cached array: no copy, writable, private on write.

    The way to make tensors of entries: ``torch.from_numpy(shmcache.open_array(key))``
    works too (with torch's "not writable" warning), but its writes land in the
    mapping that ``open_array`` shares within this process, so that array (and the
    next ``open_array(key)`` here) shows them. This tensor's writes stay in it.
    Raises :class:`MappingRefusedError` where the kernel refuses its private mapping.

    Do not keep such tensors in a Dataset that is pickled to spawn/forkserver workers
    (torch would copy them into its own shared memory); keep keys or shmcache arrays
    and convert in the worker, as :class:`CachedDataset` does.
    """
    if isinstance(array_or_key, str):  # one copy-on-write mapping, not a shared one and then a second
        return torch.from_numpy(get_store(root).open_private_array(array_or_key))
    return torch.from_numpy(private_view(array_or_key))


class GatheredBatch(Sequence[Any]):
    """What ``CachedDataset.__getitems__`` returns: ``columns``, the whole batch already
    gathered (one fancy index per array), and the same batch as a sequence of samples
    (for torch's ``default_collate``; ``CachedDataset`` makes them only on demand)."""

    def __init__(self, samples: Sequence[Any], columns: Any) -> None:
        self._samples = samples
        self.columns = columns

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: Any) -> Any:
        return self._samples[index]


class _RowsOf(Sequence[Any]):
    """Sample ``i`` of gathered columns, made when asked for."""

    def __init__(self, dataset: CachedDataset, gathered: list[torch.Tensor]) -> None:
        self._dataset = dataset
        self._gathered = gathered

    def __len__(self) -> int:
        return len(self._gathered[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._dataset._pack([column[index] for column in self._gathered])


def collate(batch: Any) -> Any:
    """``collate_fn`` that returns a ``GatheredBatch``'s columns as they are (no
    re-stacking); anything else goes to torch's ``default_collate``."""
    if isinstance(batch, GatheredBatch):
        return batch.columns
    return default_collate(batch)


class CachedDataset(Dataset[Any]):
    """Rows of cached arrays of equal length, as tensors.

    ``CachedDataset("feats", "labels")`` yields ``(feats[i], labels[i])``;
    ``CachedDataset({"x": "feats", "y": "labels"})`` yields ``{"x": ..., "y": ...}``.
    It pickles as its keys (under 1 KiB) and maps the entries lazily in each worker.
    Batches are gathered with one fancy index per array (``__getitems__``); pass
    ``collate_fn=shmcache.torch.collate`` to use them without a second copy.
    """

    def __init__(self, *keys: str | Mapping[str, str], root: Root = None) -> None:
        if len(keys) == 1 and isinstance(keys[0], Mapping):
            self._names: list[str] | None = list(keys[0])
            self._keys = list(keys[0].values())
        elif all(isinstance(k, str) for k in keys) and keys:
            self._names = None
            self._keys = [str(k) for k in keys]
        else:
            raise TypeError("CachedDataset takes keys as strings, or one mapping of name -> key")
        self._root = None if root is None else os.fspath(root)
        self._pid = -1
        self._tensors: list[torch.Tensor] = []
        self._copy_rows = False
        lengths = {len(get_store(self._root).open_array(k)) for k in self._keys}
        if len(lengths) != 1:
            raise ValueError(f"cached arrays {self._keys} have different lengths {sorted(lengths)}")
        self._length = lengths.pop()

    def _columns(self) -> list[torch.Tensor]:
        if self._pid != os.getpid():  # first use in this process (or a fresh worker)
            store = get_store(self._root)
            self._copy_rows = False
            self._tensors = [self._column(store, k) for k in self._keys]
            self._pid = os.getpid()
        return self._tensors

    def _column(self, store: Any, key: str) -> torch.Tensor:
        try:
            return torch.from_numpy(store.open_private_array(key))
        except MappingRefusedError:  # strict overcommit: read the shared pages, copy rows out
            self._copy_rows = True
            with warnings.catch_warnings():  # "non-writable": no write reaches it (rows are copies)
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(store.open_array(key))

    def _pack(self, values: Sequence[torch.Tensor]) -> Any:
        if self._names is not None:
            return dict(zip(self._names, values, strict=True))
        return values[0] if len(values) == 1 else tuple(values)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        columns = self._columns()
        if self._copy_rows:
            return self._pack([column[index].clone() for column in columns])
        return self._pack([column[index] for column in columns])

    def __getitems__(self, indices: Sequence[int]) -> GatheredBatch:
        positions = torch.as_tensor(indices, dtype=torch.long)
        gathered = [column.index_select(0, positions) for column in self._columns()]
        return GatheredBatch(_RowsOf(self, gathered), self._pack(gathered))

    def __getstate__(self) -> dict[str, Any]:
        return {"_names": self._names, "_keys": self._keys, "_root": self._root, "_length": self._length}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1
        self._tensors = []
        self._copy_rows = False
