"""Token files of language-model training: raw 1-D memmaps and Megatron indexed datasets.

- A raw token file (nanoGPT's ``train.bin``: ``np.memmap(path, dtype=np.uint16)``) has no
  header: ``put_file(key, path, dtype="uint16")`` makes it one 1-D array, a built ``.npy``
  header in front of the file's bytes copied by the kernel.
- A Megatron ``.bin`` + ``.idx`` pair (``MMIDIDX`` index: magic, version 1, a dtype code,
  the sequence and document counts, int32 sequence lengths, int64 byte pointers, int64
  document boundaries, optionally int8 sequence modes) becomes one ragged entry whose
  items are the documents: ``open_ragged(key)[i]`` is document ``i``'s tokens, a view of
  the ``.bin`` bytes copied by the kernel; its offsets are computed from the index.

Everything a hostile index could defeat is checked before anything is copied: the index's
size is exactly what its counts say (so nothing is read or allocated beyond the file's own
size), sequences lie end to end from byte 0 and fill the ``.bin`` exactly, and the
document boundaries rise from 0 to the sequence count.
"""

from __future__ import annotations

import os
import posixpath
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .._containers.table_arrow import TABLE_SUFFIXES
from .._disk.npy import NpyHeader, build_header
from ..errors import CorruptSourceError, InvalidSourceError, UnsupportedDataError
from .planned import Container, Planned, container_header
from .source_files import SourceFile, open_checked
from .urls import redact_url

__all__ = [
    "MEGATRON_DTYPES",
    "MegatronIndex",
    "is_token_source",
    "megatron_documents",
    "plan_token_file",
    "read_megatron_index",
    "refuse_dtype_for",
    "token_dtype",
]

_MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
MEGATRON_DTYPES: dict[int, np.dtype] = {
    code: np.dtype(name)
    for code, name in {
        1: "u1",
        2: "i1",
        3: "<i2",
        4: "<i4",
        5: "<i8",
        6: "<f8",
        7: "<f4",
        8: "<u2",
    }.items()
}
"""Megatron's ``DType`` codes -> the token dtype of the ``.bin``."""
_SAYS_ITS_DTYPES = (".npy", ".npz", ".pt", ".pth", ".safetensors", ".h5", ".hdf5")


def token_dtype(dtype: object) -> np.dtype:
    """``dtype`` (a name or numpy dtype) as the dtype of a raw token file: a plain number."""
    try:
        resolved: np.dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise UnsupportedDataError(
            f"dtype {dtype!r} is not a numpy dtype; pass a name such as 'uint16' (GPT-2 tokens), "
            "'uint32' or 'int32'"
        ) from None
    if resolved.kind not in "iu" or resolved.names is not None:
        plain = resolved.kind in "bfc" and resolved.names is None
        what = "an integer type" if plain else "a plain number type"
        raise UnsupportedDataError(
            f"dtype {dtype!r} is not {what}; a token file holds integer token ids: pass one of "
            "uint8, uint16 (GPT-2), uint32, uint64, int8, int16, int32, int64"
        )
    return resolved


def refuse_dtype_for(path: str | os.PathLike[str], dtype: object | None) -> None:
    """Refuse ``dtype`` for what cannot be a raw token file: a directory (tar shards are
    refused by ``dispatch``; a URL is checked once listed: one object, not a prefix)."""
    if dtype is None:
        return
    token_dtype(dtype)
    text = os.fspath(path)
    if "://" in text:  # a URL: one object, its size checked when it is listed (``remote_files``)
        name = urlsplit(text).path
        suffix = posixpath.splitext(name)[1].lower()
        if suffix in _SAYS_ITS_DTYPES or suffix in TABLE_SUFFIXES:
            raise InvalidSourceError(
                f"dtype= is for a raw token file (e.g. nanoGPT's train.bin); {redact_url(text)} is a "
                f"{suffix} object, which says its own dtypes: put it without dtype"
            )
        return
    if os.path.isdir(text):
        raise InvalidSourceError(
            f"dtype= takes one raw token file (e.g. nanoGPT's train.bin); {text} is a directory: "
            "put each token file with its own key"
        )


def is_token_source(path: Path) -> bool:
    """Whether ``put_file`` of this one file (no ``dtype``) is a Megatron pair: a ``.idx``,
    or a ``.bin`` with a ``.idx`` beside it."""
    suffix = path.suffix.lower()
    return suffix == ".idx" or (suffix == ".bin" and path.with_suffix(".idx").is_file())


def plan_token_file(key: str, path: Path, dtype: object | None, tops: tuple[str, ...]) -> list[Planned]:
    """The entry ``put_file(key, path, dtype=dtype)`` makes of a token file (``key`` is valid)."""
    if is_token_source(path):
        return [_plan_megatron(key, path.with_suffix(".bin"), path.with_suffix(".idx"), dtype, tops)]
    assert dtype is not None, "sources plans a file without dtype by its suffix"
    return [_plan_raw(key, path, token_dtype(dtype), tops)]


def _plan_raw(key: str, path: Path, dtype: np.dtype, tops: tuple[str, ...]) -> Planned:
    fd, file = open_checked(str(path), tops)
    os.close(fd)
    if file.size % dtype.itemsize:
        raise CorruptSourceError(
            f"{path} holds {file.size} bytes, not a whole number of {dtype} tokens "
            f"({dtype.itemsize} bytes each): wrong dtype, or a truncated file"
        )
    return _raw(key, path, file, dtype, (file.size // dtype.itemsize,))


def _raw(key: str, path: Path, file: SourceFile, dtype: np.dtype, shape: tuple[int, ...]) -> Planned:
    prefix = build_header(dtype, shape, False)
    return Planned(
        key=key,
        header=NpyHeader(dtype, shape, False, len(prefix)),
        source=str(path),
        file=file,
        copy_offset=0,
        prefix=prefix,
    )


def _plan_megatron(
    key: str, bin_path: Path, idx_path: Path, dtype: object | None, tops: tuple[str, ...]
) -> Planned:
    fd, index = open_checked(str(idx_path), tops)
    try:
        parsed = read_megatron_index(lambda n, offset: os.pread(fd, n, offset), index.size, str(idx_path))
    finally:
        os.close(fd)
    fd, file = open_checked(str(bin_path), tops)
    os.close(fd)
    tokens, offsets, extra = megatron_documents(parsed, dtype, file.size, str(bin_path), str(idx_path))
    token = parsed[3]
    container = Container(
        kind="ragged",
        files={"offsets": offsets},
        extra=extra,
        copied={"values": _raw(key, bin_path, file, token, (tokens,))},
    )
    return Planned(key, container_header(container), str(bin_path), file, None, container=container)


MegatronIndex = tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype]
"""Sequence lengths, byte pointers, document boundaries and the token dtype of an index."""


def megatron_documents(
    index: MegatronIndex, dtype: object | None, bin_size: int, bin_where: str, idx_where: str
) -> tuple[int, np.ndarray, dict[str, Any]]:
    """The ragged entry a checked index makes of its ``.bin`` of ``bin_size`` bytes: the token
    count, the documents' token offsets and the entry's meta; a ``dtype`` other than the
    index's, sequences not end to end from byte 0 or a ``.bin`` of another size is refused.
    Shared by local pairs and pairs of objects (``remote_entries``)."""
    lengths, pointers, documents, token = index
    if dtype is not None and token_dtype(dtype) != token:
        raise InvalidSourceError(
            f"{idx_where} says its tokens are {token}, not {token_dtype(dtype)}; pass no dtype "
            "(the index gives it) or the index's"
        )
    ends = np.cumsum(lengths, dtype=np.int64)  # token offset after each sequence
    tokens = int(ends[-1]) if len(ends) else 0
    starts = np.concatenate([np.zeros(1, np.int64), ends])
    if not np.array_equal(pointers, starts[:-1] * token.itemsize):
        first = int(np.argmax(pointers != starts[:-1] * token.itemsize))
        raise CorruptSourceError(
            f"{idx_where}: sequence {first} starts at byte {int(pointers[first])}, not "
            f"{int(starts[first]) * token.itemsize} (its sequences must lie end to end from byte 0, as "
            "Megatron's builder writes them): crafted or corrupt"
        )
    if tokens * token.itemsize != bin_size:
        raise CorruptSourceError(
            f"{bin_where} holds {bin_size} bytes, but its index {posixpath.basename(idx_where)} counts "
            f"{tokens} {token} tokens ({tokens * token.itemsize} bytes): truncated, or not this index's data"
        )
    offsets = starts[documents]  # the token offset of each document boundary
    extra = {"length": len(offsets) - 1, "dtype": str(token), "item_shape": [], "sequences": len(lengths)}
    return tokens, offsets, extra


def read_megatron_index(read: Callable[[int, int], bytes], size: int, path: str) -> MegatronIndex:
    """Sequence lengths, byte pointers and document boundaries of an ``MMIDIDX`` index of
    ``size`` bytes read by ``read(nbytes, offset)`` (a local ``pread``, or ranged reads of
    an object), and its token dtype; every count is checked against ``size`` before more
    than the header is read, so a hostile count never makes a large read or allocation."""
    head = read(_HEAD.size, 0)
    if len(head) < _HEAD.size or head[: len(_MAGIC)] != _MAGIC:
        raise CorruptSourceError(f"{path}: not a Megatron index (no MMIDIDX header)")
    _, version, code, sequences, documents = _HEAD.unpack(head)
    if version != 1:
        raise UnsupportedDataError(f"{path}: Megatron index version {version}; shmcache reads version 1")
    token = MEGATRON_DTYPES.get(code)
    if token is None:
        raise CorruptSourceError(f"{path}: unknown Megatron dtype code {code} (known: 1 to 8)")
    body = size - _HEAD.size
    expected = 12 * sequences + 8 * documents  # lengths (int32), pointers and boundaries (int64)
    if expected not in (body, body - sequences):  # optional int8 sequence modes after them
        raise CorruptSourceError(
            f"{path}: its header counts {sequences} sequences and {documents} document boundaries "
            f"({expected} bytes of index), but {body} bytes follow it: truncated or corrupt"
        )
    raw = read(expected, _HEAD.size)
    if len(raw) != expected:
        raise CorruptSourceError(f"{path}: the index ended early (changed while being read)")
    lengths = np.frombuffer(raw, "<i4", sequences, 0).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", sequences, 4 * sequences)
    bounds = np.frombuffer(raw, "<i8", documents, 12 * sequences)
    if sequences and int(lengths.min()) < 0:
        raise CorruptSourceError(f"{path}: a negative sequence length")
    if documents == 0 or bounds[0] != 0 or bounds[-1] != sequences or np.any(np.diff(bounds) < 0):
        raise CorruptSourceError(
            f"{path}: its document boundaries must rise from 0 to the sequence count ({sequences}): "
            "crafted or corrupt"
        )
    return lengths, pointers, bounds, token
