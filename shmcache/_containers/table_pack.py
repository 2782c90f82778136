"""Exact-type packing of a list of Python numbers (or of equal-length lists of numbers)
into an ndarray in one C pass, through ``marshal``.

``marshal.dumps(values, 2)`` checks every value's *exact* type in C (no subclass, bool
apart from int) and writes it behind a one-byte tag: ``g`` + 8 bytes little-endian for a
float, ``i`` + 4 bytes for an int that fits 32 bits, ``T``/``F`` for a bool, ``[`` + an
int32 count for a list; version 2 writes no back-references. When the bytes have the
regular layout of one tag throughout, the tags prove the types and the payload *is* the
array. Anything else (None, other types, subclasses, bigger ints, lists of other lengths
or mixed contents) returns None and the caller takes its general path, which decides.
On 2M annotation dicts this replaces a type check plus ``np.fromiter`` over 8M bbox
floats (~2.5x faster).
"""

from __future__ import annotations

import marshal
from typing import Any

import numpy as np

__all__ = ["pack_lists", "pack_numbers"]

_HEADER = 5  # a list: b"[" + int32 count
_FLOAT, _INT, _TRUE, _FALSE, _LIST = b"g"[0], b"i"[0], b"T"[0], b"F"[0], b"["[0]
_PAYLOAD = {_FLOAT: ("<f8", 8, np.float64), _INT: ("<i4", 4, np.int64)}


def _dumped(values: Any, first: tuple[type, ...]) -> np.ndarray | None:
    """The marshalled bytes of a non-empty list after its header, or None; None at once
    when the first value's exact type is not in ``first`` (a list of 1M dicts is not
    marshalled just to learn that it is no column of numbers)."""
    if type(values) is not list or not values or type(values[0]) not in first:
        return None
    try:
        data = marshal.dumps(values, 2)
    except (ValueError, RecursionError):  # an unmarshallable value: not a plain column
        return None
    return np.frombuffer(data, dtype=np.uint8, offset=_HEADER)


def _strided(
    body: np.ndarray, dtype: str, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> np.ndarray:
    """A view of ``body`` (unaligned where it must be): the values behind the tags in place,
    no gather (``take`` copied each byte through an index, ~2x the time)."""
    return np.ndarray(shape, dtype=dtype, buffer=body, offset=offset, strides=strides)


def pack_numbers(values: Any) -> np.ndarray | None:
    """A list of exact floats -> float64, of exact ints in int32 range -> int64, of bools
    -> bool; None if the list is anything else."""
    body = _dumped(values, (float, int, bool))
    if body is None:
        return None
    count, tag = len(values), int(body[0])
    if tag in (_TRUE, _FALSE):
        if body.size != count:
            return None
        true = body == _TRUE
        return true if np.count_nonzero(true | (body == _FALSE)) == count else None
    if tag not in _PAYLOAD:
        return None
    dtype, width, out = _PAYLOAD[tag]
    if body.size != count * (1 + width):
        return None
    if np.count_nonzero(_strided(body, "u1", 0, (count,), (1 + width,)) != tag):
        return None
    return _strided(body, dtype, 1, (count,), (1 + width,)).astype(out)


def pack_lists(values: Any) -> np.ndarray | None:
    """A list of exact lists, all of one non-zero length, of exact floats (float64) or
    of exact ints in int32 range (int64) -> a 2-D array; None if anything else."""
    body = _dumped(values, (list,))
    if body is None or body.size < _HEADER + 2 or body[0] != _LIST:
        return None
    count, size, tag = len(values), int(body[1:_HEADER].view("<i4")[0]), int(body[_HEADER])
    if size <= 0 or tag not in _PAYLOAD:
        return None
    dtype, width, out = _PAYLOAD[tag]
    stride = _HEADER + size * (1 + width)
    if body.size != count * stride:
        return None
    rows = (count,), (stride,)
    cells = (count, size), (stride, 1 + width)
    if (
        np.count_nonzero(_strided(body, "u1", 0, *rows) != _LIST)
        or np.count_nonzero(_strided(body, "<i4", 1, *rows) != size)
        or np.count_nonzero(_strided(body, "u1", _HEADER, *cells) != tag)
    ):
        return None
    return _strided(body, dtype, _HEADER + 1, *cells).astype(out)
