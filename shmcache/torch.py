"""PyTorch helpers: tensors over cached arrays, and a Dataset with batched gathers.

Needs torch (``import shmcache`` never imports this module). Tensors made here share
the cache's memory without a copy and without torch's "non-writable NumPy array"
warning: they sit on a private copy-on-write mapping of the entry of their own, so a
training loop that writes into one changes only that tensor's copy of the touched pages,
never the cache, another process, or the arrays ``open_array`` returns.

On a GPU machine, ``pin``/``cuda_view``/``to_cuda`` register an entry's pages with CUDA
read-only (no copy) and ``GPULoader`` gathers batches on the GPU (``_cuda`` has the
details); without CUDA they raise :class:`~shmcache.errors.GPUUnavailableError`.

Where the kernel refuses such a mapping (strict overcommit, ``vm.overcommit_memory=2``,
for an entry bigger than the room left under the commit limit), ``as_tensor`` raises
:class:`~shmcache.errors.MappingRefusedError` and ``CachedDataset`` reads the shared
read-only mapping and hands out copies of its rows.
"""

from __future__ import annotations

import array
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
from torch.utils.data import Dataset

from ._api import get_store
from ._batches import GatheredBatch, collate
from ._cuda import (
    Pinned,
    cuda_device,
    cuda_view,
    cuda_views,
    pin,
    read_only_registration_supported,
    recorded_event,
    to_cuda,
)
from ._disk.attach import private_view
from ._disk.dtypes import ml_name
from ._disk.mapped import version_of
from ._tensors import open_state_dict, tensor_of
from ._tokens import TokenWindows
from .errors import InvalidRequestError, KeyNotFoundError, MappingRefusedError, UnsupportedDataError

__all__ = [
    "CachedDataset",
    "GPULoader",
    "GatheredBatch",
    "Pinned",
    "TokenWindows",
    "as_tensor",
    "collate",
    "cuda_view",
    "open_state_dict",
    "pin",
    "read_only_registration_supported",
    "to_cuda",
]

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
        return tensor_of(get_store(root).open_private_array(array_or_key))
    return tensor_of(private_view(array_or_key))


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


def _positions(indices: Sequence[int]) -> torch.Tensor:
    """``indices`` as a long tensor. A DataLoader's list of ints goes through
    ``array("q")`` (C longs in one pass): ``torch.as_tensor`` parses a list element by
    element, ~45 of the ~140 us a batch of 256 rows of 1 KiB took here. Anything else, or
    a list ``array`` refuses (floats, huge ints), takes ``torch.as_tensor`` as before."""
    if type(indices) is list and indices:
        try:
            return torch.frombuffer(array.array("q", indices), dtype=torch.long)
        except (TypeError, OverflowError):
            pass
    return torch.as_tensor(indices, dtype=torch.long)


_forks = 0
"""How many forks led to this process: a dataset maps its columns again when it changes."""


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class CachedDataset(Dataset[Any]):
    """Rows of cached arrays of equal length, as tensors.

    ``CachedDataset("feats", "labels")`` yields ``(feats[i], labels[i])``;
    ``CachedDataset({"x": "feats", "y": "labels"})`` yields ``{"x": ..., "y": ...}``.
    It maps its columns when made, pickles as its keys and the versions it was sized from
    (under 1 KiB) and maps those versions in each spawned worker: a later put under a key
    never reaches it (fork workers share its mapping; a spawned one started after the put
    raises ``KeyNotFoundError``: make a new dataset for new data).
    Batches are gathered with one fancy index per array (``__getitems__``); pass
    ``collate_fn=shmcache.torch.collate`` to use them without a second copy.
    ``team="vision"`` reads that team's root (``docs/team.md``) instead of ``root``.

    ``huge_pages=True`` maps columns of 2 MiB or more on 2 MiB pages where the kernel
    allows it without root (Linux >= 6.1, ``docs/huge-pages.md``): random rows then miss
    the TLB as seldom as in an in-memory array. The first dataset over an entry pays a
    one-time copy of its pages (about 1-2 s per GiB, done here, in the constructor);
    later ones, and every DataLoader worker, map the pages already made. Where the
    kernel declines, columns are mapped as without it.
    """

    def __init__(
        self,
        *keys: str | Mapping[str, str],
        root: Root = None,
        team: str | None = None,
        huge_pages: bool = False,
    ) -> None:
        if len(keys) == 1 and isinstance(keys[0], Mapping):
            self._names: list[str] | None = list(keys[0])
            self._keys = list(keys[0].values())
        elif all(isinstance(k, str) for k in keys) and keys:
            self._names = None
            self._keys = [str(k) for k in keys]
        else:
            raise TypeError("CachedDataset takes keys as strings, or one mapping of name -> key")
        self._root = None if root is None else os.fspath(root)
        self._team = team
        self._fork = -1
        self._tensors: list[torch.Tensor] = []
        self._copy_rows = False
        self._huge_pages = bool(huge_pages)
        store = self._store()
        arrays = [store.open_array(k, raw=True) for k in self._keys]
        # The versions the length comes from: every process reads these, never a later
        # put under the same key (other rows, other length, another key's older rows).
        self._versions = [version_of(array) for array in arrays]
        lengths = {len(array) for array in arrays}
        if len(lengths) != 1:
            paired = zip(self._keys, arrays, strict=True)
            rows = ", ".join(f"{key!r}: {len(array):,}" for key, array in paired)
            raise InvalidRequestError(
                f"CachedDataset rows pair the i-th row of each array, but these arrays have different "
                f"lengths ({rows} rows); put arrays of one length, or slice them to one"
            )
        self._length = lengths.pop()
        for key, dtype in zip(self._keys, [a.dtype for a in arrays], strict=True):
            if dtype.fields is not None or dtype.kind in "OUSVMm":  # bfloat16's raw bits pass
                raise UnsupportedDataError(
                    f"CachedDataset column {key!r} has dtype {dtype} (records, strings, "
                    "objects, times), which torch tensors cannot hold: read it with "
                    "shmcache.open_array in a Dataset of your own and a DataLoader"
                )
        # Mapped now (a mapping per column, no page read; huge pages collapsed once): fork
        # workers then keep this version even after a put under the key replaced it.
        self._columns()

    def _store(self) -> Any:
        return get_store(self._root, team=self._team)

    def _columns(self) -> list[torch.Tensor]:
        # First use in this process (or a fresh worker): a fork count, not os.getpid(),
        # which is a system call on every row.
        if self._fork != _forks:
            store = self._store()
            inherited, copied = self._tensors, self._copy_rows
            self._copy_rows = False
            try:
                pinned = zip(self._keys, self._versions, strict=True)
                self._tensors = [self._column(store, key, version) for key, version in pinned]
            except KeyNotFoundError as exc:
                if not inherited:
                    raise self._version_gone(exc) from None
                self._tensors, self._copy_rows = inherited, copied  # a fork still maps its parent's
            self._fork = _forks
        return self._tensors

    def _column(self, store: Any, key: str, version: str | None) -> torch.Tensor:
        huge = self._huge_pages
        try:
            if version is None:  # not a shmcache mapping (cannot happen for a put entry)
                return tensor_of(store.open_private_array(key, huge_pages=huge))
            return tensor_of(store.open_array_version(key, version, private=True, huge_pages=huge))
        except MappingRefusedError:  # strict overcommit: read the shared pages, copy rows out
            self._copy_rows = True
            shared = store.open_array_version(key, version or self._current(store, key))
            with warnings.catch_warnings():  # "non-writable": no write reaches it (rows are copies)
                warnings.simplefilter("ignore", UserWarning)
                return tensor_of(shared)

    def _shared_arrays(self) -> list[np.ndarray]:
        """The read-only arrays of the dataset's versions (bfloat16/float8 as their bits)."""
        store = self._store()
        try:  # a dataset pickled before versions were kept: the key's version now
            return [
                store.open_array_version(k, v if v is not None else self._current(store, k))
                for k, v in zip(self._keys, self._versions, strict=True)
            ]
        except KeyNotFoundError as exc:
            raise self._version_gone(exc) from None

    @staticmethod
    def _current(store: Any, key: str) -> str:
        """The key's version now (for a dataset pickled before versions were kept)."""
        version = store.layout.entry_version(key)
        if version is None:
            raise KeyNotFoundError(f"no entry {key!r} in cache {store.root}")
        return str(version)

    def _version_gone(self, exc: KeyNotFoundError) -> KeyNotFoundError:
        return KeyNotFoundError(
            f"CachedDataset over {self._keys}: {exc} since the dataset was made (its "
            f"{self._length} rows came from that version, so it reads no other); make a new "
            "CachedDataset to read the current version, or keep the version the workers "
            "mapped with DataLoader(..., persistent_workers=True)"
        )

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
        positions = _positions(indices)
        gathered = [column.index_select(0, positions) for column in self._columns()]
        return GatheredBatch(_RowsOf(self, gathered), self._pack(gathered))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "_names": self._names,
            "_keys": self._keys,
            "_root": self._root,
            "_team": self._team,
            "_length": self._length,
            "_versions": self._versions,
            "_huge_pages": self._huge_pages,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._team = None  # pickled before teams existed
        self._huge_pages = False  # or before huge pages
        self._versions = [None] * len(state["_keys"])  # or before versions were kept
        self.__dict__.update(state)
        self._fork = -1
        self._tensors = []
        self._copy_rows = False


class GPULoader:
    """Batches of a :class:`CachedDataset`'s columns gathered on ``device``: one
    ``index_select`` per column per batch, no worker process, no pickling.

    On CUDA the columns are :func:`cuda_view` s of the cache's registered pages, so a
    batch crosses PCIe once, already gathered; where read-only registration is not
    supported, or fails for a column (e.g. under a locked-memory limit), each batch is
    gathered on the CPU into a pinned staging buffer and copied asynchronously (logged once).
    ``device="cpu"`` runs the same code on the CPU.
    Sampling follows ``DataLoader``: ``shuffle`` draws a fresh permutation each epoch
    (``torch.randperm`` with ``generator``, else torch's global RNG); ``sampler`` (e.g. a
    ``DistributedSampler``: call ``loader.set_epoch(e)``) replaces it. Batches have the
    dataset's shape: a tensor, a tuple, or a dict of tensors. Only numeric array columns
    can be gathered this way (every ``CachedDataset`` column is an array; a structured
    or string dtype is refused): use a ``DataLoader`` for anything else. Batches are
    fresh tensors (writable); the loader holds its pins until ``close()`` or collection.
    """

    def __init__(
        self,
        dataset: CachedDataset,
        batch_size: int,
        shuffle: bool = False,
        drop_last: bool = False,
        sampler: Any = None,
        generator: torch.Generator | None = None,
        device: Any = None,
    ) -> None:
        if not isinstance(dataset, CachedDataset):
            raise TypeError(
                f"GPULoader gathers the array columns of a shmcache.torch.CachedDataset, not a "
                f"{type(dataset).__name__}; use torch's DataLoader for other datasets"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True are exclusive (as in DataLoader): a sampler shuffles")
        resolved = torch.device("cuda" if device is None else device)
        if resolved.type == "cuda":
            resolved = cuda_device(resolved, "GPULoader")
        elif resolved.type != "cpu":
            raise ValueError(f"GPULoader runs on a CUDA device or on 'cpu', not {resolved}")
        self._bits_columns = False
        for key, shared in zip(dataset._keys, dataset._shared_arrays(), strict=True):
            dtype = shared.dtype
            if ml_name(dtype) is not None:  # bfloat16/float8: its raw bits on disk
                self._bits_columns = True
                continue
            if dtype.fields is not None or dtype.kind not in "biufc":
                raise UnsupportedDataError(
                    f"GPULoader gathers numeric array columns; column {key!r} has dtype {dtype} "
                    "(records, strings, objects): load that column with a DataLoader instead"
                )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.sampler = sampler
        self.generator = generator
        self.device = resolved
        self._columns: list[torch.Tensor] | None = None
        self._staged = False
        self._buffers: list[list[torch.Tensor]] = []
        self._turn = 0
        self._done: list[Any] = [None, None]

    def __len__(self) -> int:
        count = len(self.dataset) if self.sampler is None else len(self.sampler)
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler (``DistributedSampler`` reshuffles with it)."""
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def close(self) -> None:
        """Drop the columns (and with them the pins on the cache's pages)."""
        self._columns = None
        self._buffers = []

    def _device_columns(self) -> list[torch.Tensor]:
        if self._columns is None:
            if self.device.type == "cpu":
                self._columns = self.dataset._columns()
            else:  # registered views; where any column cannot be registered: staging
                views = None
                # cuda_view takes a root: a team= dataset's columns go through the staging path
                # bfloat16/float8 columns: gathered as tensors of their dtype, then staged
                registrable = self.dataset._team is None and not self._bits_columns
                if registrable and read_only_registration_supported(self.device):
                    views = cuda_views(self.dataset._shared_arrays(), self.device, root=self.dataset._root)
                self._staged = views is None
                self._columns = self.dataset._columns() if views is None else views
        return self._columns

    def _order(self) -> torch.Tensor:
        if self.sampler is not None:
            return _positions(list(iter(self.sampler)))
        if self.shuffle:  # a tensor, not RandomSampler's list of ints (~70 ms per million rows)
            return torch.randperm(len(self.dataset), generator=self.generator)
        return torch.arange(len(self.dataset))

    def __iter__(self) -> Any:
        columns = self._device_columns()
        order = self._order()
        if not self._staged:
            order = order.to(self.device)
        for start in range(0, len(order), self.batch_size):
            positions = order[start : start + self.batch_size]
            if len(positions) < self.batch_size and self.drop_last:
                return
            if self._staged:
                yield self.dataset._pack(self._gather_staged(columns, positions))
            else:
                yield self.dataset._pack([column.index_select(0, positions) for column in columns])

    def _gather_staged(self, cols: list[torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
        """Gather on the CPU into one of two pinned buffers per column, then copy it
        asynchronously; a buffer is reused only after its previous copy finished."""
        if not self._buffers:
            self._buffers = [
                [torch.empty((self.batch_size, *c.shape[1:]), dtype=c.dtype, pin_memory=True) for c in cols]
                for _ in range(2)
            ]
        slot = self._turn % 2
        self._turn += 1
        event = self._done[slot]
        if event is not None:
            event.synchronize()
        count = len(positions)
        out = []
        for column, buffer in zip(cols, self._buffers[slot], strict=True):
            torch.index_select(column, 0, positions, out=buffer[:count])
            out.append(buffer[:count].to(self.device, non_blocking=True))
        self._done[slot] = recorded_event()
        return out
