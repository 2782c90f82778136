"""Tables from Python values: a dict of columns or a list of dicts, without pyarrow.

A table entry stores column ``i`` as plain arrays named by index (never by the column
name, which may hold any character), laid out as Arrow's buffers so ``to_arrow`` maps
them without a copy:

- numbers, bools, datetimes: ``c<i>.values`` (bools one byte each, not bit-packed);
- strings: ``c<i>.bytes`` (UTF-8) + ``c<i>.offsets`` (int64: Arrow ``large_string``);
- lists of numbers: ``c<i>.values`` + ``c<i>.offsets`` (Arrow ``large_list``), or one 2-D
  ``c<i>.values`` when every list has the same length and none is null (fixed size);
- nulls: ``c<i>.valid``, a validity bitmap in Arrow's bit order, only when there are any.

Names, kinds and logical types go in ``meta.json`` under ``"columns"``.

This is also ``share()``'s fast path for a list of annotation dicts: one pass per key
with ``operator.itemgetter`` and numpy's C loops, no per-item Python frame.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CorruptSourceError, UnsupportedDataError
from .table_pack import pack_lists, pack_numbers

__all__ = [
    "Column",
    "check_offsets",
    "check_utf8",
    "column_files",
    "encode_column_values",
    "encode_table_columns",
    "encode_table_records",
    "list_description",
    "table_meta",
]

Column = tuple[dict[str, np.ndarray], dict[str, Any]]
"""``(files without the c<i>. prefix, the column's description in meta.json)``."""

_NUMBER_TYPES = {int: np.int64, float: np.float64, bool: np.bool_}
_ARROW_NAMES = {
    "b1": "bool", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "u1": "uint8",
    "u2": "uint16", "u4": "uint32", "u8": "uint64", "f2": "halffloat", "f4": "float", "f8": "double",
}  # fmt: skip


class NotTabular(UnsupportedDataError):
    """A column that a table cannot hold as it is (``share`` then keeps records)."""


def arrow_name(dtype: np.dtype[Any]) -> str:
    """Arrow's name of a numeric numpy dtype (what ``meta.json`` records)."""
    return _ARROW_NAMES[f"{dtype.kind}{dtype.itemsize}"]


def check_offsets(offsets: np.ndarray, limit: int) -> None:
    """Offsets of an Arrow string or list array (a chunk's, before rebasing) that a reader
    may follow: from 0, never decreasing, the last within the ``limit`` bytes (items) of
    its data. An IPC file's offsets are not checked by pyarrow's reader, nor by its cheap
    ``validate()``: one past its data, published, made every reader of the column read
    past the end of its file (SIGBUS) or the wrong strings. One pass over the offsets."""
    if not len(offsets):
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first < 0 or last > limit or (len(offsets) > 1 and not bool((offsets[1:] >= offsets[:-1]).all())):
        raise CorruptSourceError(
            f"a string or list column's offsets run from {first} to {last} over {limit} items of data, "
            "or go back (a corrupt Arrow file or buffer)"
        )


def check_utf8(offsets: np.ndarray, data: Any) -> None:
    """Each string of an Arrow string array (its ``offsets``, int32 or int64, through
    :func:`check_offsets` already, into ``data``: its bytes, an Arrow buffer or a numpy
    array) valid UTF-8. pyarrow's IPC and Parquet readers do not check it: a published
    column of invalid bytes made every read of its row raise UnicodeDecodeError. One pass
    over the bytes (Arrow's validator: GB/s), pyarrow imported only where data is Arrow's."""
    if data is None or len(offsets) < 2 or int(offsets[-1]) == int(offsets[0]):
        return
    import pyarrow as pa

    kind = pa.large_string() if offsets.dtype.itemsize == 8 else pa.string()
    buffer = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    strings = pa.Array.from_buffers(kind, len(offsets) - 1, [None, pa.py_buffer(offsets), buffer])
    try:
        strings.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise CorruptSourceError(
            f"a string column holds bytes that are not UTF-8 ({exc} of a batch); a column of "
            "raw bytes is binary, not string: cast it (or decode it) before the put"
        ) from None


def validity(valid: np.ndarray) -> np.ndarray:
    """Arrow's validity bitmap (bit ``i % 8`` of byte ``i // 8``) of a bool array."""
    return np.packbits(valid, bitorder="little")


def list_description(dtype: np.dtype[Any], size: int | None) -> dict[str, Any]:
    """The ``meta.json`` description of a list column (``size``: fixed size, or None)."""
    inner = arrow_name(dtype)
    arrow = f"large_list<{inner}>" if size is None else f"fixed_size_list<{inner}>[{size}]"
    return {"kind": "list", "dtype": dtype.str, "arrow": arrow, "size": size}


def _number_column(values: np.ndarray, valid: np.ndarray | None) -> Column:
    files = {"values": np.ascontiguousarray(values)}
    if valid is not None:
        files["valid"] = validity(valid)
    dtype = values.dtype
    if dtype.kind == "M":
        unit = np.datetime_data(dtype)[0]
        if unit not in ("s", "ms", "us", "ns"):
            raise NotTabular(f"datetime64[{unit}] values (use s, ms, us or ns)")
        return files, {"kind": "datetime", "dtype": dtype.str, "arrow": f"timestamp[{unit}]", "unit": unit,
                       "tz": None}  # fmt: skip
    if dtype.kind not in "biuf":
        raise NotTabular(f"values of dtype {dtype}")
    kind = "bool" if dtype.kind == "b" else "number"
    return files, {"kind": kind, "dtype": dtype.str, "arrow": arrow_name(dtype)}


def _string_column(texts: Sequence[Any], valid: np.ndarray | None) -> Column:
    if valid is not None:
        texts = ["" if t is None else t for t in texts]
    count = len(texts)
    # Joined by NULs, the separators give the byte offsets in C (no per-string len), unless
    # a string holds a NUL itself.
    joined_by_nul = "\0".join(texts)  # TypeError if not all str
    try:  # strict UTF-8 (no lone surrogate): rows then decode without an error handler
        separated, strict = joined_by_nul.encode("utf-8"), True
    except UnicodeEncodeError:
        separated, strict = joined_by_nul.encode("utf-8", "surrogatepass"), False
    nuls = np.flatnonzero(np.frombuffer(separated, dtype=np.uint8) == 0) if count else None
    if nuls is not None and len(nuls) == count - 1:
        data = separated.replace(b"\0", b"")
        offsets = np.empty(count + 1, dtype=np.int64)
        offsets[0] = 0
        offsets[1:count] = nuls
        offsets[1:count] -= np.arange(count - 1)
        offsets[count] = len(data)
    else:
        joined = "".join(texts)
        data = joined.encode("utf-8", "surrogatepass")
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=count)
        if len(data) != len(joined):  # not all ASCII: characters are not bytes
            lengths = np.fromiter(
                (len(t.encode("utf-8", "surrogatepass")) for t in texts), dtype=np.int64, count=count
            )
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
    files: dict[str, np.ndarray] = {"bytes": np.frombuffer(data, dtype=np.uint8), "offsets": offsets}
    if valid is not None:
        files["valid"] = validity(valid)
    desc: dict[str, Any] = {"kind": "string", "dtype": "str", "arrow": "large_string"}
    if strict:  # SharedTable rows decode it without the surrogatepass handler (faster)
        desc["strict_utf8"] = True
    return files, desc


def _list_column(lists: Sequence[Any], valid: np.ndarray | None, strict: bool) -> Column:
    if valid is not None:
        lists = [() if v is None else v for v in lists]
    count = len(lists)
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=count)
    total = int(lengths.sum())
    kinds: set[type] = {float}
    if total:  # one C pass when every item has the first item's type (the usual case)
        first = type(next(itertools.chain.from_iterable(lists)))
        if operator.countOf(map(type, itertools.chain.from_iterable(lists)), first) == total:
            kinds = {first}
        else:
            kinds = set(map(type, itertools.chain.from_iterable(lists)))
        if not kinds <= set(_NUMBER_TYPES):
            raise NotTabular("lists holding something other than int, float or bool")
    if len(kinds) > 1 and (strict or bool in kinds):
        raise NotTabular("lists mixing " + ", ".join(sorted(t.__name__ for t in kinds)))
    dtype = np.float64 if float in kinds else _NUMBER_TYPES[kinds.pop()]
    try:
        flat: np.ndarray = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)
    except OverflowError:
        raise NotTabular("integers beyond int64") from None
    if valid is None and count and total == count * int(lengths[0]) and (lengths == lengths[0]).all():
        size = int(lengths[0])
        return {"values": flat.reshape(count, size)}, list_description(flat.dtype, size)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    files = {"values": flat, "offsets": offsets}
    if valid is not None:
        files["valid"] = validity(valid)
    return files, list_description(flat.dtype, None)


def encode_column_values(values: Any, strict: bool = False) -> Column:
    """One column from a sequence of Python values or an ndarray.

    ``strict`` (``share``): every value keeps its Python type on the way back (no int
    becomes a float), else :class:`NotTabular`. Raises :class:`NotTabular` saying what the
    column holds; callers add the column's name.
    """
    if isinstance(values, np.ndarray):
        if not values.dtype.isnative:  # Arrow (and memoryview indexing) want native byte order
            values = values.astype(values.dtype.newbyteorder("="))
        if values.ndim == 1 and values.dtype.kind in "biufM":
            return _number_column(values, None)
        if values.ndim == 2 and values.dtype.kind in "biuf" and values.shape[1] > 0:
            return {"values": np.ascontiguousarray(values)}, list_description(values.dtype, values.shape[1])
        if values.ndim != 1 or values.dtype.kind not in "OUS":
            raise NotTabular(f"a {values.ndim}-d array of {values.dtype}")
        values = values.tolist()
    count = len(values)
    first = type(values[0]) if count else float
    if first in _NUMBER_TYPES:  # one C pass that checks exact types and packs (the usual case)
        packed = pack_numbers(values)
        if packed is not None:
            return _number_column(packed, None)
    elif first is list:
        packed = pack_lists(values)
        if packed is not None:
            return {"values": packed}, list_description(packed.dtype, packed.shape[1])
    # One C pass when every value has the first one's type (the usual case), else a set.
    types = {first} if operator.countOf(map(type, values), first) == count else set(map(type, values))
    valid = None
    if type(None) in types:
        types.discard(type(None))
        valid = np.fromiter((v is not None for v in values), dtype=np.bool_, count=count)
    if not types:
        if count and valid is not None:
            raise NotTabular("only None (give the column a type: a numpy array, or a pyarrow table)")
        types = {float}
    if types == {str}:
        return _string_column(values, valid)
    if types <= {list, tuple} and (not strict or types == {list}):
        return _list_column(values, valid, strict)
    if types <= {int, float, bool} and (len(types) == 1 or (not strict and bool not in types)):
        dtype = np.float64 if float in types else _NUMBER_TYPES[next(iter(types))]
        source = values if valid is None else [0 if v is None else v for v in values]
        try:
            array: np.ndarray = np.fromiter(source, dtype=dtype, count=count)
        except OverflowError:
            raise NotTabular("integers beyond int64") from None
        return _number_column(array, valid)
    shown = ", ".join(sorted(t.__name__ for t in types))
    raise NotTabular(f"values of types {shown}")


def column_files(index: int, files: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A column's files under their names in the entry (``c<index>.<part>``)."""
    return {f"c{index}.{part}": array for part, array in files.items()}


def table_meta(names: Sequence[str], descriptions: Sequence[dict[str, Any]], length: int) -> dict[str, Any]:
    """The extra ``meta.json`` of a table entry."""
    columns = [{"name": name} | desc for name, desc in zip(names, descriptions, strict=True)]
    return {"length": length, "columns": columns, "dtype": f"table of {len(columns)} columns"}


def _refusal(what: str, name: str, exc: UnsupportedDataError) -> UnsupportedDataError:
    return UnsupportedDataError(
        f"{what}: column {name!r} holds {exc}; a table column holds numbers, bools, datetimes, "
        "str, or lists of numbers (None as null): convert it, or store it with put_records"
    )


def encode_table_columns(
    columns: Mapping[Any, Any], what: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A dict of columns (name -> list or 1-D/2-D ndarray) as a table's files and meta."""
    names = list(columns)
    for name in names:
        if not isinstance(name, str):
            raise UnsupportedDataError(f"{what}: column name {name!r} is not a str")
    lengths = {name: len(columns[name]) for name in names}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{n!r}: {length}" for n, length in lengths.items())
        raise UnsupportedDataError(f"{what}: columns differ in length ({shown})")
    files: dict[str, np.ndarray] = {}
    descriptions = []
    for i, name in enumerate(names):
        try:
            parts, desc = encode_column_values(columns[name])
        except NotTabular as exc:
            raise _refusal(what, name, exc) from None
        files |= column_files(i, parts)
        descriptions.append(desc)
    return files, table_meta(names, descriptions, next(iter(lengths.values()), 0))


def encode_table_records(
    records: Sequence[Any], what: str, strict: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A list of dicts with one set of str keys as a table's files and meta.

    ``strict`` is ``share``'s test: any item that would not come back equal, with the same
    Python types, raises :class:`NotTabular` (the caller then stores records).
    """
    if not records or not isinstance(records[0], dict):
        raise NotTabular(f"{what} is not a non-empty list of dicts")
    names = list(records[0])
    if any(not isinstance(n, str) for n in names):
        raise NotTabular(f"{what}[0] has keys that are not str")
    if operator.countOf(map(type, records), dict) != len(records):
        raise NotTabular(f"{what} holds items that are not dicts")
    if operator.countOf(map(len, records), len(names)) != len(records):
        raise NotTabular(f"{what}: the dicts do not all have the same keys")
    files: dict[str, np.ndarray] = {}
    descriptions = []
    for i, name in enumerate(names):
        try:
            values = list(map(operator.itemgetter(name), records))
        except KeyError:
            raise NotTabular(f"{what}: the dicts do not all have the same keys") from None
        try:
            parts, desc = encode_column_values(values, strict=strict)
        except NotTabular as exc:
            if strict:
                raise
            raise _refusal(what, name, exc) from None
        files |= column_files(i, parts)
        descriptions.append(desc)
    return files, table_meta(names, descriptions, len(records))
