"""An array given as consecutive pieces (the chunks of an Arrow column), written as one
``.npy`` file without joining the pieces in memory first.

A table read from Arrow IPC streams or Parquet row groups arrives in chunks; joining
them (``combine_chunks``) copied the whole table once more in anonymous memory before the
write copied it again into the cache (16% of a ``save_to_disk`` put, and the table's size
in peak RSS). :class:`ArrayParts` keeps the chunks' own buffers (views of the mapped
source, or of the decoded table) and the writer streams them in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ArrayParts", "FileArray", "joined", "joined_files"]


@dataclass(frozen=True)
class ArrayParts:
    """The array ``np.concatenate(parts)``: C-contiguous ``parts`` of one dtype whose shapes
    differ only in their first dimension (checked here)."""

    parts: tuple[np.ndarray, ...]
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, parts: Sequence[np.ndarray]) -> ArrayParts:
        if not parts:
            raise ValueError("ArrayParts needs at least one part")
        first = parts[0]
        for part in parts:
            if part.dtype != first.dtype or part.shape[1:] != first.shape[1:] or part.ndim == 0:
                raise ValueError(f"parts differ: {part.dtype}{part.shape} after {first.dtype}{first.shape}")
        kept = tuple(np.ascontiguousarray(p) for p in parts if p.size)
        rows = sum(int(p.shape[0]) for p in parts)
        return cls(kept, first.dtype, (rows, *first.shape[1:]))

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def join(self) -> np.ndarray:
        """The pieces as one array, for callers that need an ndarray: a copy, except that a
        single piece is returned as it is (a view of whatever it views)."""
        if len(self.parts) == 1:
            return self.parts[0]
        if not self.parts:
            return np.empty(self.shape, self.dtype)
        return np.concatenate(self.parts)


FileArray = np.ndarray | ArrayParts
"""What an entry file is written from: an array, or an array in parts."""


def joined(array: FileArray) -> np.ndarray:
    """``array`` as one ndarray (parts joined: a copy)."""
    return array.join() if isinstance(array, ArrayParts) else array


def joined_files(files: Mapping[str, FileArray]) -> dict[str, np.ndarray]:
    """An entry's files with every :class:`ArrayParts` joined (for writers that take arrays)."""
    return {name: joined(array) for name, array in files.items()}
