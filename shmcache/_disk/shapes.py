"""One check of an array's shape for every format a source can come in (``.npy``, ``.npz``,
``.safetensors``, torch, HDF5...): what it accepts, numpy can make an array of, so nothing
is published that a reader cannot open.

A shape is a sequence of at most :data:`MAX_DIMS` plain ints (not bools, which are ints to
Python but no size to a reader), each non-negative, whose size in bytes fits numpy's
``intp``; an empty shape (a zero among its dimensions) counts its other dimensions too,
since numpy refuses ``(0, 2**62, 2**62)`` even though it holds nothing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import CorruptSourceError

__all__ = ["MAX_DIMS", "MAX_INTP", "MAX_TENSORS", "checked_shape"]

MAX_DIMS = 64 if int(np.__version__.split(".", 1)[0]) >= 2 else 32
"""The most dimensions this numpy gives an array (``NPY_MAXDIMS``)."""
MAX_INTP = int(np.iinfo(np.intp).max)
MAX_TENSORS = 1 << 20
"""The most arrays one source file (a checkpoint, a safetensors file) may hold: each becomes
an entry, and the largest models hold a few thousand."""


def checked_shape(
    shape: Any, itemsize: int, what: str, error: type[Exception] = CorruptSourceError
) -> tuple[int, ...]:
    """``shape`` as a tuple, or ``error`` naming ``what`` and why numpy could not make an
    array of that shape with items of ``itemsize`` bytes."""
    if not isinstance(shape, tuple | list):
        raise error(f"{what}: its shape {shape!r:.80} is not a list of dimensions")
    if len(shape) > MAX_DIMS:
        raise error(
            f"{what}: its shape has {len(shape)} dimensions; numpy arrays have at most {MAX_DIMS}"
        )
    if not all(type(n) is int for n in shape):
        raise error(f"{what}: its shape {tuple(shape)!r:.200} holds something other than integers")
    if any(n < 0 for n in shape):
        raise error(f"{what}: its shape {tuple(shape)} has a negative dimension")
    if math.prod(n for n in shape if n) * max(itemsize, 1) > MAX_INTP:
        raise error(
            f"{what}: its shape {tuple(shape)!s:.200} of {itemsize}-byte items would span more than "
            f"{MAX_INTP} bytes, beyond what numpy can address"
        )
    return tuple(shape)
