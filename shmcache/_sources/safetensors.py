"""The ``.safetensors`` format, parsed without the ``safetensors`` package: an 8-byte
little-endian header length, a JSON header, then raw little-endian tensors. Only the
header is read; each tensor's bytes are later copied by the kernel from its range.

Every check a hostile file could defeat is made here, before anything is copied: the
header is bounded, valid JSON and walked as a flat table one tensor at a time (so its
memory is a small multiple of its size: ``_entries``), no name twice, every tensor has a
dtype numpy has, a shape, and a byte range that lies inside the file and holds exactly
``prod(shape) * itemsize`` bytes, and all the ranges together are the data, back to back
(no overlap, gap or trailing byte). ``__metadata__`` (a table of strings) is ignored.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from .._disk.dtypes import marker
from .._disk.npy import pread_from
from .._disk.shapes import MAX_TENSORS, checked_shape
from ..errors import CorruptSourceError, UnsupportedDataError

__all__ = ["MAX_HEADER_BYTES", "SafetensorsTensor", "read_safetensors_index"]

MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit
_ENTRY_CHARS = 64 << 10  # one tensor's description: ~100 characters; 64 dims of 20 digits: ~1.4 K
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
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptSourceError(f"{path}: the .safetensors header is not valid JSON ({exc})") from None
    del raw
    base = 8 + length
    tensors = [_tensor(name, spec, base, size, path) for name, spec in _entries(text, path)]
    if not tensors:  # as every other container: an empty put is a mistake, said where it is made
        raise CorruptSourceError(f"{path}: the .safetensors file holds no tensor (its header: {text[:80]!r})")
    tensors.sort(key=lambda t: (t.offset, t.nbytes))
    _check_back_to_back(tensors, base, size, path)
    return tensors


def _check_back_to_back(tensors: list[SafetensorsTensor], base: int, size: int, path: str) -> None:
    """The data is the tensors back to back, from the header's end to the file's, as the
    reference loader requires ("invalid offset for tensor"): no byte shared by two tensors
    (aliased weights), none in a gap or after the last tensor (a damaged header)."""
    end, last = base, None
    for t in tensors:
        if t.offset < end:
            raise CorruptSourceError(
                f"{path}: tensors {last!r} and {t.name!r} overlap (bytes {t.offset - base} to {end - base} "
                "of the data): crafted or corrupt"
            )
        if t.offset > end:
            after = f"after tensor {last!r}" if last is not None else "at the start of the data"
            raise CorruptSourceError(
                f"{path}: {t.offset - end} bytes {after} belong to no tensor (the next is {t.name!r}; "
                "the data must be the tensors back to back): crafted or corrupt"
            )
        end, last = t.offset + t.nbytes, t.name
    if end != size:
        raise CorruptSourceError(
            f"{path}: {size - end} bytes after the last tensor ({last!r}) belong to no tensor "
            "(the data must be the tensors back to back, to the end of the file): truncated header or corrupt"
        )


def _entries(text: str, path: str) -> Iterator[tuple[str, Any]]:
    """Each tensor's name and description (a small dict), parsed one at a time.

    The header is walked as the flat table it must be (``{name: {...}, ...}``, with
    ``__metadata__`` a table of strings) rather than parsed whole: json.loads builds any
    structure first (20 MiB of ``[{}, {}, ...]``: +485 MiB of RSS; at the 100 MB limit
    2.8 GB) and only then could it be refused. Each description is parsed from a window
    of at most ``_ENTRY_CHARS`` and checked before the next, so memory stays a small
    multiple of the header's size, whatever it holds. As in the reference parser (serde
    into a map of tensor infos), a wrong shape is refused where it is met."""
    seen: set[str] = set()
    try:
        at = _skip(text, 0)
        if _peek(text, at) != "{":
            raise CorruptSourceError(f"{path}: the .safetensors header is not a JSON object")
        at = _skip(text, at + 1)
        if _peek(text, at) == "}":
            at += 1
        else:
            while True:
                at = _expect(text, at, '"', path)
                name, at = json.decoder.scanstring(text, at)  # type: ignore[attr-defined]
                if name in seen:
                    raise CorruptSourceError(
                        f"{path}: in the .safetensors header, a name appears twice: {name!r:.200}"
                    )
                seen.add(name)
                at = _skip(text, _expect(text, _skip(text, at), ":", path))
                if name == "__metadata__":
                    at = _metadata(text, at, path)
                else:
                    if len(seen) > MAX_TENSORS:
                        raise UnsupportedDataError(f"{path}: over {MAX_TENSORS} tensors in one file")
                    spec, at = _description(text, at, f"{path}: tensor {name!r}")
                    yield name, spec
                at = _skip(text, at)
                if _peek(text, at) != ",":
                    at = _expect(text, at, "}", path)
                    break
                at = _skip(text, at + 1)
    except json.JSONDecodeError as exc:
        raise CorruptSourceError(f"{path}: the .safetensors header is not valid JSON ({exc})") from None
    if _skip(text, at) != len(text):
        raise CorruptSourceError(f"{path}: the .safetensors header has more after its closing brace")


def _description(text: str, at: int, where: str) -> tuple[Any, int]:
    """A tensor's description at ``at``, parsed from a window of ``text`` (doubled up to
    ``_ENTRY_CHARS``): nothing past it is parsed, however long the value really is."""
    window = 512
    while True:
        try:
            spec, length = _DECODER.raw_decode(text[at : at + window])
            return spec, at + length
        except json.JSONDecodeError:
            if window >= _ENTRY_CHARS or at + window >= len(text):
                break
            window *= 2
        except ValueError as exc:  # _no_duplicates
            raise CorruptSourceError(f"{where}: {exc}") from None
        except RecursionError:  # json's parser recurses per level, up to the interpreter's limit
            raise CorruptSourceError(
                f"{where}: its description nests objects or lists over {sys.getrecursionlimit()} deep "
                "(a safetensors header is a flat table of tensors, 3 deep): crafted or corrupt"
            ) from None
    if at + window < len(text):
        raise CorruptSourceError(
            f"{where}: its description is over {_ENTRY_CHARS} characters of JSON (a tensor's takes ~100: "
            "dtype, shape, data_offsets), or not JSON: crafted or corrupt"
        )
    _DECODER.raw_decode(text[at:])  # the real error, for the message
    raise AssertionError("unreachable")


def _metadata(text: str, at: int, path: str) -> int:
    """Past ``__metadata__``'s value: null or an object of strings, as the reference requires."""
    if text.startswith("null", at):
        return at + 4
    at = _skip(text, _expect(text, at, "{", path))
    if _peek(text, at) == "}":
        return at + 1
    while True:
        for end in (":", None):
            at = _expect(text, at, '"', path)
            _, at = json.decoder.scanstring(text, at)  # type: ignore[attr-defined]
            at = _skip(text, at)
            if end:
                at = _skip(text, _expect(text, at, end, path))
        if _peek(text, at) != ",":
            return _expect(text, at, "}", path)
        at = _skip(text, at + 1)


def _skip(text: str, at: int) -> int:
    return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]


def _peek(text: str, at: int) -> str:
    return text[at : at + 1]


def _expect(text: str, at: int, char: str, path: str) -> int:
    if _peek(text, at) != char:
        found = repr(_peek(text, at)) if at < len(text) else "its end"
        raise CorruptSourceError(
            f"{path}: the .safetensors header is not valid JSON for a table of tensors (expected {char!r} "
            f"at character {at}, found {found}; the format: {{name: {{dtype, shape, data_offsets}}, ...}}, "
            "__metadata__ a table of strings)"
        )
    return at + 1


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a name appears twice")
    return found


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates)
_WHITESPACE = re.compile(r"[ \t\n\r]*")


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
