"""Samples of a blobs entry: its blobs grouped by basename, as WebDataset groups tar members.

``000017.jpg``, ``000017.cls`` and ``000017.seg.png`` (consecutive names) are one sample,
``{"__key__": "000017", "jpg": ..., "cls": ..., "seg.png": ...}``: the key is the name up
to the first dot of its last path component (the directories kept), the rest is the
field. A key that comes back after another one starts a new sample, as in WebDataset.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, overload

import numpy as np

__all__ = ["SharedSamples", "sample_key"]


def sample_key(name: str) -> tuple[str, str]:
    """``(key, field)`` of a blob name: ``("a/000017", "seg.png")`` for ``a/000017.seg.png``."""
    folder, slash, base = name.rpartition("/")
    stem, _, field = base.partition(".")
    return folder + slash + stem, field


class _Blobs(Protocol):
    """What samples need of ``SharedBlobs`` (not imported: it imports this module)."""

    @property
    def names(self) -> Sequence[str]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class SharedSamples(Sequence[dict[str, Any]]):
    """``blobs.samples()``: sample ``i`` as a fresh dict of zero-copy ``uint8`` views.

    The sample boundaries are one int64 array (no Python object per sample, so DataLoader
    workers do not copy it page by page); pickling sends the blobs' reference and workers
    find the boundaries again.
    """

    __slots__ = ("_blobs", "_starts")

    def __init__(self, blobs: _Blobs) -> None:
        self._blobs = blobs
        starts, previous = [], None
        for i, name in enumerate(blobs.names):
            key = sample_key(name)[0]
            if key != previous:
                starts.append(i)
                previous = key
        starts.append(len(blobs))
        self._starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sample {index} out of range ({count} samples)")
        index %= count
        first, end = int(self._starts[index]), int(self._starts[index + 1])
        names, blobs = self._blobs.names, self._blobs
        sample: dict[str, Any] = {}
        for j in range(first, end):
            key, field = sample_key(names[j])
            sample["__key__"] = key
            sample[field] = blobs[j]
        return sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedSamples, (self._blobs,))

    @property
    def keys(self) -> Sequence[str]:
        """The samples' keys, in order."""
        names = self._blobs.names
        return [sample_key(names[int(i)])[0] for i in self._starts[:-1]]
