"""The ``.safetensors`` format, parsed without the ``safetensors`` package: an 8-byte
little-endian header length, a JSON header, then raw little-endian tensors. Only the
header is read; each tensor's bytes are later copied by the kernel from its range.

Every check a hostile file could defeat is made here, before anything is copied: the
header is bounded and valid JSON (no duplicate names), every tensor has a dtype numpy
has, a shape, and a byte range that lies inside the file and holds exactly
``prod(shape) * itemsize`` bytes. ``__metadata__`` (free-form strings) is ignored.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from .._disk.dtypes import marker
from .._disk.npy import pread_from
from .._disk.shapes import MAX_TENSORS, checked_shape
from ..errors import CorruptSourceError, UnsupportedDataError

__all__ = ["MAX_HEADER_BYTES", "SafetensorsTensor", "read_safetensors_index"]

MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "?",
        "U8": "u1",
        "I8": "i1",
        "U16": "<u2",
        "I16": "<i2",
        "U32": "<u4",
        "I32": "<i4",
        "U64": "<u8",
        "I64": "<i8",
        "F16": "<f2",
        "F32": "<f4",
        "F64": "<f8",
        "C64": "<c8",
    }.items()
} | {"BF16": marker("bfloat16"), "F8_E4M3": marker("float8_e4m3fn"), "F8_E5M2": marker("float8_e5m2")}
"""safetensors dtype names -> stored dtypes (bfloat16 and float8 as their raw bits: ``dtypes``);
the other F8 kinds and F6/F4 are refused."""


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor: its name, what it is, and where its bytes lie in the file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute offset of the first byte in the file."""
    nbytes: int


def read_safetensors_index(fd: int | BinaryIO, size: int, path: str) -> list[SafetensorsTensor]:
    """Every tensor of the ``size``-byte safetensors file open as ``fd`` (a descriptor, or a
    remote object's seekable file-like), in file order;
    damage raises :class:`CorruptSourceError`, dtypes numpy lacks
    :class:`UnsupportedDataError`, each naming ``path`` (and the tensor)."""
    head = pread_from(fd, 8, 0)
    if len(head) < 8:
        raise CorruptSourceError(f"{path}: not a .safetensors file (shorter than its 8-byte header length)")
    length = int.from_bytes(head, "little")
    if length > MAX_HEADER_BYTES:
        raise CorruptSourceError(
            f"{path}: not a .safetensors file (its header claims {length} bytes, over {MAX_HEADER_BYTES})"
        )
    if 8 + length > size:
        raise CorruptSourceError(
            f"{path}: truncated .safetensors file (header of {length} bytes, file of {size})"
        )
    raw = pread_from(fd, length, 8)
    if len(raw) != length:
        raise CorruptSourceError(f"{path}: truncated .safetensors file while reading its header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptSourceError(f"{path}: the .safetensors header is not valid JSON ({exc})") from None
    except RecursionError:  # json's parser recurses per level, up to the interpreter's limit
        raise CorruptSourceError(
            f"{path}: the .safetensors header nests objects or lists over {sys.getrecursionlimit()} deep "
            "(a safetensors header is a flat table of tensors, 3 deep): crafted or corrupt"
        ) from None
    if not isinstance(header, dict):
        raise CorruptSourceError(f"{path}: the .safetensors header is not a JSON object")
    if len(header) > MAX_TENSORS:
        raise UnsupportedDataError(f"{path}: over {MAX_TENSORS} tensors in one file")
    base = 8 + length
    tensors = [
        _tensor(name, spec, base, size, path) for name, spec in header.items() if name != "__metadata__"
    ]
    return sorted(tensors, key=lambda t: t.offset)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a name appears twice")
    return found


def _tensor(name: str, spec: Any, base: int, size: int, path: str) -> SafetensorsTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict):
        raise CorruptSourceError(f"{where} is described by {type(spec).__name__}, not an object")
    kind, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(kind, str):
        raise CorruptSourceError(f"{where} has no dtype")
    dtype = DTYPES.get(kind)
    if dtype is None:
        raise UnsupportedDataError(
            f"{where} has dtype {kind}, which shmcache does not store (it stores numpy dtypes, "
            "bfloat16 and float8 e4m3fn/e5m2); convert it first, e.g. tensor.float() or "
            "tensor.bfloat16(), and save again"
        )
    if not isinstance(offsets, list) or not _ints(offsets) or len(offsets) != 2:
        raise CorruptSourceError(f"{where}: data_offsets must be a list of two non-negative integers")
    shape = checked_shape(shape, dtype.itemsize, where)
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end < begin or end - begin != nbytes:
        raise CorruptSourceError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape "
            f"{tuple(shape)} of {kind} needs {nbytes}"
        )
    if base + end > size:
        raise CorruptSourceError(
            f"{where} ends at byte {base + end}, past the end of the file ({size} bytes): "
            "truncated or corrupt"
        )
    return SafetensorsTensor(name, dtype, tuple(shape), base + begin, nbytes)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
