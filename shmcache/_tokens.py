"""``TokenWindows``: random (x, y) windows of a cached token array, nanoGPT's ``get_batch``
as a Dataset (imported by ``shmcache.torch`` only).

A batch is gathered in one indexing operation over the cache's pages (``__getitems__``:
``np.take`` of the windows' positions as one ``(batch, block_size + 1)`` index; torch's
advanced indexing of a large 1-D tensor took 35x as long here), then split into ``x`` and
``y = x`` shifted by one. Window ``i`` starts at a position drawn from ``(seed, epoch,
i)`` by a hash, so the windows do not depend on which process (main or DataLoader
worker) gathers them. The Dataset holds the version of the entry it was made from (its
windows are sized from it): it pickles as a reference to that version (workers map it
lazily), never as the key, whose next version may hold other tokens, or fewer.
"""

from __future__ import annotations

import operator
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ._api import get_store
from ._batches import GatheredBatch
from ._containers.shared import SharedRagged
from ._disk.mapped import version_of
from .errors import InvalidRequestError, KeyNotFoundError, UnsupportedDataError

__all__ = ["TokenWindows"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SEEDS = (-(2**63), 2**64 - 1)  # a seed or epoch is drawn from as 64 bits (a negative one wraps)


def _integer(value: Any, what: str, low: int, high: int) -> int:
    """``value`` as an int within ``low .. high``: an int or numpy integer (not a bool, not
    a float, which would be truncated into some other window)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise InvalidRequestError(f"{what} must be an integer, not {value!r}") from None
    if not low <= number <= high:
        raise InvalidRequestError(f"{what} must be an integer from {low} to {high}, not {value!r}")
    return number


def _splitmix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 ``values`` (wrapping arithmetic)."""
    z = values.copy()
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


class _Windows(Sequence[Any]):
    """Window ``i`` of a gathered batch as ``(x, y)``, made when asked for."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._x, self._y = x, y

    def __len__(self) -> int:
        return len(self._x)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._x[index], self._y[index]


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(x, y)`` windows of ``block_size`` tokens of the 1-D array under ``key`` (a token
    file put with ``dtype=``, or a Megatron ragged entry: its documents laid end to end),
    ``y`` being ``x`` shifted by one token, both of ``dtype`` (int64: what an embedding takes).

    ``len()`` is ``length`` (default: ``(tokens - 1) // block_size``, one epoch of disjoint
    windows' worth). ``shuffle=True`` (default) starts window ``i`` at a random position drawn
    from ``(seed, epoch, i)`` (``set_epoch`` draws others; with persistent DataLoader workers,
    call it before the workers start); ``shuffle=False`` starts it at ``i * block_size`` (an
    evaluation pass over the disjoint windows). Pass ``collate_fn=shmcache.torch.collate``
    to get each batch as the ``(x, y)`` pair gathered, without torch's re-stacking: then
    ``x`` and ``y`` are two views of one fresh ``(batch, block_size + 1)`` tensor (an
    in-place write to one shows in the other; the cache is never written). Arguments that
    are not integers in range (``block_size``, ``length``, a 64-bit ``seed``, an index) are
    refused with :class:`~shmcache.errors.InvalidRequestError`.
    """

    def __init__(
        self,
        key: str,
        block_size: int,
        *,
        length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        dtype: torch.dtype = torch.int64,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        block_size = _integer(block_size, "block_size", 1, sys.maxsize)
        if length is not None:
            length = _integer(length, "length (a number of windows)", 1, sys.maxsize)
        seed = _integer(seed, "seed", *_SEEDS)
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequestError(f"dtype must be a torch.dtype such as torch.int64, not {dtype!r}")
        self._key = key
        self._root = None if root is None else os.fspath(root)
        tokens = _token_array(get_store(self._root), key)
        if len(tokens) < block_size + 1:
            raise InvalidRequestError(
                f"entry {key!r} holds {len(tokens)} tokens, too few for one window of "
                f"{block_size} + 1 (x and its shifted y); use a smaller block_size"
            )
        self.block_size = block_size
        self.shuffle = shuffle
        self.seed = seed
        self.dtype = dtype
        self.epoch = 0
        self._starts = len(tokens) - block_size  # window starts 0 .. tokens - block_size - 1
        self._length = (len(tokens) - 1) // block_size if length is None else length
        self._array: np.ndarray | None = tokens  # this version, whatever is put under the key later
        self._version = version_of(tokens) or "?"
        self._ref = pickle.dumps(tokens)  # a reference to this version (root, version, range)
        self._span = np.arange(block_size + 1, dtype=np.int64)
        try:  # the widening done by numpy where it has the type (a third faster than torch's)
            self._widen: np.dtype | None = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            self._widen = None

    def set_epoch(self, epoch: int) -> None:
        """Draw other windows (each epoch its own), as ``DistributedSampler.set_epoch`` does."""
        self.epoch = _integer(epoch, "epoch", *_SEEDS)

    def __len__(self) -> int:
        return self._length

    def _tokens(self) -> np.ndarray:
        if self._array is None:  # first use in a process this Dataset was pickled to
            try:
                self._array = pickle.loads(self._ref)
            except KeyNotFoundError:
                raise KeyNotFoundError(
                    f"TokenWindows over {self._key!r}: the version it was made from "
                    f"({self._version}) was replaced or evicted since (its windows were sized "
                    "from it); make a new TokenWindows to read the entry's current version"
                ) from None
        assert self._array is not None
        return self._array

    def starts(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Where windows ``indices`` start (a 1-D int64 tensor)."""
        return torch.from_numpy(self._starts_of(indices))

    def _starts_of(self, indices: Sequence[int] | torch.Tensor) -> np.ndarray:
        positions = _positions(indices)
        if positions.size and (int(positions.min()) < -self._length or int(positions.max()) >= self._length):
            raise IndexError(f"window index out of range for {self._length} windows")
        positions = positions % self._length
        if not self.shuffle:
            return positions % self._starts * self.block_size % self._starts  # no int64 overflow
        salt = _splitmix(np.array([self.seed % 2**64, self.epoch % 2**64], dtype=np.uint64))
        salt = salt[:1] * _GOLDEN + salt[1:]  # arrays: numpy wraps them silently, not scalars
        mixed = _splitmix(positions.astype(np.uint64) * _GOLDEN + salt)
        return (mixed % np.uint64(self._starts)).astype(np.int64)

    def __getitems__(self, indices: Sequence[int]) -> GatheredBatch:
        gathered = np.take(self._tokens(), self._starts_of(indices)[:, None] + self._span)  # one gather
        if self._widen is not None:
            windows = torch.from_numpy(gathered.astype(self._widen, copy=False))
        else:
            windows = torch.from_numpy(gathered).to(self.dtype)
        x, y = windows[:, :-1], windows[:, 1:]
        return GatheredBatch(_Windows(x, y), (x, y))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _integer(index, "a window index", -sys.maxsize - 1, sys.maxsize)
        return self.__getitems__([index])[0]  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_array"] = None  # a fork keeps its parent's mapping; a pickle sends ``_ref``
        return state


def _positions(indices: Sequence[int] | torch.Tensor) -> np.ndarray:
    """Window indices as a 1-D int64 array; floats and bools refused (numpy would truncate
    a float into another window), an index past int64 is out of range."""
    try:
        positions = np.asarray(indices).reshape(-1)
    except OverflowError:
        raise IndexError("window index out of range (past 64 bits)") from None
    if positions.dtype.kind == "O" and all(type(i) is int for i in positions.tolist()):
        raise IndexError("window index out of range (past 64 bits)")  # (not numbers: below)
    if positions.size and positions.dtype.kind not in "iu":
        raise InvalidRequestError(f"window indices must be integers, not {positions.dtype} values")
    if positions.dtype == np.uint64 and positions.size and int(positions.max()) > sys.maxsize:
        raise IndexError("window index out of range (past 64 bits)")
    return positions.astype(np.int64, copy=False)


def _token_array(store: Any, key: str) -> np.ndarray:
    """The 1-D token array of ``key``: an array entry, or a ragged entry's values."""
    opened = store.open(key)
    array = opened.values if isinstance(opened, SharedRagged) else opened
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
        what = type(opened).__name__
        if isinstance(array, np.ndarray):
            what = f"{array.ndim}-d {array.dtype} array"
        raise UnsupportedDataError(
            f"TokenWindows reads a 1-D array of integer tokens; entry {key!r} is a {what} (put a "
            "token file with put_file(key, path, dtype='uint16'), or a Megatron .bin/.idx pair)"
        )
    return array
