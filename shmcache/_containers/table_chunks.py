"""A chunked Arrow column's files straight from its chunks' buffers, without joining them.

A ``save_to_disk`` folder holds Arrow IPC streams of 1,000-row record batches (a column
of a 256 MiB dataset comes in ~940 chunks), Parquet row groups come as chunks too.
``combine_chunks`` copied every column into new memory before the writer copied it again
into the cache; here each chunk's values buffer becomes a part of an
:class:`~shmcache._disk.array_parts.ArrayParts` (a view: of the mapped stream file, or of
the decoded table) and only the offsets (8 bytes a row) are computed. The per-chunk work
is a few numpy views (no pyarrow compute call per chunk): hundreds of chunks cost
milliseconds. A column of one chunk takes it too (no cast of its strings to large strings:
a copy of them). Numbers, strings and lists of numbers without nulls take this path; any
other column (nulls, bools, timestamps, dictionaries) returns None and is combined as
before, by the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._disk.array_parts import ArrayParts, FileArray
from ..errors import CorruptSourceError
from .table_encode import arrow_name, check_offsets, check_utf8, list_description

__all__ = ["ColumnStream", "chunk_files", "column_stream", "number_values", "rebased_offsets"]


def chunk_files(column: Any) -> tuple[dict[str, FileArray], dict[str, Any]] | None:
    """The files and description of a ChunkedArray of non-empty chunks (one or more: a
    string column's cast to large strings copied even one) without nulls, as
    :func:`~shmcache._containers.table_arrow.arrow_column` stores the column combined; None
    for a column this does not take (the caller combines the chunks instead)."""
    import pyarrow.types as pt

    chunks = [chunk for chunk in column.chunks if len(chunk)]
    if not chunks or column.null_count:
        return None
    kind = column.type
    if _is_number(pt, kind):
        dtype = np.dtype(kind.to_pandas_dtype())
        desc = {"kind": "number", "dtype": dtype.str, "arrow": arrow_name(dtype)}
        return {"values": ArrayParts.of([_values(c, dtype) for c in chunks])}, desc
    if pt.is_string(kind) or pt.is_large_string(kind):
        wide = np.int64 if pt.is_large_string(kind) else np.int32
        offsets, data = _offsets_and_ranges(chunks, wide, np.dtype(np.uint8), False)
        desc = {"kind": "string", "dtype": "str", "arrow": "large_string"}
        return {"bytes": data, "offsets": offsets}, desc
    if (pt.is_list(kind) or pt.is_large_list(kind)) and _is_number(pt, kind.value_type):
        if any(c.values.null_count for c in chunks):
            return None
        dtype = np.dtype(kind.value_type.to_pandas_dtype())
        wide = np.int64 if pt.is_large_list(kind) else np.int32
        offsets, values = _offsets_and_ranges(chunks, wide, dtype, True)
        return {"values": values, "offsets": offsets}, list_description(dtype, None)
    if pt.is_fixed_size_list(kind) and _is_number(pt, kind.value_type):
        size = kind.list_size
        dtype = np.dtype(kind.value_type.to_pandas_dtype())
        parts = []
        for chunk in chunks:
            child = chunk.values
            if child.null_count:
                return None
            flat = _values(child, dtype)[chunk.offset * size : (chunk.offset + len(chunk)) * size]
            parts.append(flat.reshape(len(chunk), size))
        return {"values": ArrayParts.of(parts)}, list_description(dtype, size)
    return None


class ColumnStream:
    """A column :func:`chunk_files` takes, encoded a group of its chunks at a time (a
    pipelined write: one group's parts are written while the next is encoded). The whole
    files' dtypes and shapes are known first (for their headers, and to reserve their
    bytes before anything is written); :meth:`encode` gives each group's parts in order,
    :meth:`close` the offsets' end."""

    def __init__(
        self,
        desc: dict[str, Any],
        files: dict[str, tuple[np.dtype[Any], tuple[int, ...]]],
        dtype: np.dtype[Any],
        wide: type[np.signedinteger[Any]] | None,
        size: int | None,
    ) -> None:
        self.desc, self.files = desc, files
        self._dtype, self._wide, self._size = dtype, wide, size
        self._base = 0  # strings, lists: the items of earlier groups

    @property
    def nbytes(self) -> int:
        return sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in self.files.values())

    def encode(self, chunks: list[Any]) -> dict[str, list[np.ndarray]]:
        """The parts (views of the chunks' buffers; rebased offsets) of non-empty
        ``chunks``, which follow those of every earlier call."""
        dtype, size = self._dtype, self._size
        if self._wide is None:
            if size is None:
                return {"values": [_values(c, dtype) for c in chunks]}
            flat = [_values(c.values, dtype)[c.offset * size : (c.offset + len(c)) * size] for c in chunks]
            return {"values": flat}
        offsets, parts, self._base = rebased_offsets(
            chunks, self._wide, dtype, "values" in self.files, self._base, close=False
        )
        return {"values" if "values" in self.files else "bytes": parts, "offsets": [offsets]}

    def close(self) -> dict[str, list[np.ndarray]]:
        """The last offset (the items of every group), checked against the planned size."""
        if self._wide is None:
            return {}
        data = self.files["values" if "values" in self.files else "bytes"]
        if self._base != data[1][0]:
            raise CorruptSourceError(
                f"a string or list column's offsets cover {self._base} items, not {data[1][0]}"
            )
        return {"offsets": [np.array([self._base], np.int64)]}


def column_stream(column: Any) -> ColumnStream | None:
    """A :class:`ColumnStream` of a ChunkedArray :func:`chunk_files` takes; None for any
    other column (the caller encodes it whole). A string or list column's items are summed
    from each chunk's end offsets here (two numpy scalars a chunk; not pyarrow's
    ``binary_length``, which reads an IPC file's offsets buffer past its end, unchecked,
    when a batch claims more rows than it holds: a segfault); such a buffer, or ends out of
    their data, raise :class:`CorruptSourceError` as the whole encode does."""
    import pyarrow.types as pt

    chunks = [chunk for chunk in column.chunks if len(chunk)]
    if not chunks or column.null_count:
        return None
    rows, kind = len(column), column.type
    if _is_number(pt, kind):
        dtype = np.dtype(kind.to_pandas_dtype())
        desc = {"kind": "number", "dtype": dtype.str, "arrow": arrow_name(dtype)}
        return ColumnStream(desc, {"values": (dtype, (rows,))}, dtype, None, None)
    if pt.is_fixed_size_list(kind) and _is_number(pt, kind.value_type):
        if any(c.values.null_count for c in chunks):
            return None
        size, dtype = kind.list_size, np.dtype(kind.value_type.to_pandas_dtype())
        desc = list_description(dtype, size)
        return ColumnStream(desc, {"values": (dtype, (rows, size))}, dtype, None, size)
    if pt.is_string(kind) or pt.is_large_string(kind):
        wide, nested, dtype = np.int64 if pt.is_large_string(kind) else np.int32, False, np.dtype(np.uint8)
        desc, part = {"kind": "string", "dtype": "str", "arrow": "large_string"}, "bytes"
    elif (pt.is_list(kind) or pt.is_large_list(kind)) and _is_number(pt, kind.value_type):
        if any(c.values.null_count for c in chunks):
            return None
        wide, nested = np.int64 if pt.is_large_list(kind) else np.int32, True
        dtype = np.dtype(kind.value_type.to_pandas_dtype())
        desc, part = list_description(dtype, None), "values"
    else:
        return None
    items = 0
    for chunk in chunks:
        _, _, start, stop = _chunk_offsets(chunk, np.dtype(wide), nested)
        items += stop - start
    files: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
        part: (dtype, (items,)),
        "offsets": (np.dtype(np.int64), (rows + 1,)),
    }
    return ColumnStream(desc, files, dtype, wide, None)


def _is_number(pt: Any, kind: Any) -> bool:
    return bool(pt.is_integer(kind) or pt.is_floating(kind))


def number_values(array: Any) -> np.ndarray:
    """An Arrow array of fixed-width numbers (no nulls) as a numpy view of its buffer."""
    return _values(array, np.dtype(array.type.to_pandas_dtype()))


def _values(array: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A fixed-width array's values (its offset and length applied), a view of its buffer."""
    return _view(array.buffers()[1], dtype, array.offset, len(array))


def _view(buffer: Any, dtype: np.dtype[Any], start: int, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` from item ``start`` of an Arrow buffer (no copy); a
    buffer too short for them (an IPC batch claiming more rows than it holds: pyarrow's
    reader lets it through) is CorruptSourceError."""
    try:
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=start * dtype.itemsize)
    except ValueError:
        size = 0 if buffer is None else buffer.size
        raise CorruptSourceError(
            f"a buffer of {size} bytes holds fewer than the {count} items from item {start} its batch claims"
        ) from None


def _chunk_offsets(chunk: Any, kind: np.dtype[Any], nested: bool) -> tuple[np.ndarray, Any, int, int]:
    """A string or list chunk's offsets (a view), its data buffer (strings' bytes, or a
    list's child values), and its first and last offset, checked to lie within that data
    and in order (:func:`check_offsets`, the whole pass only where its ends are wrong:
    the order inside is checked once rebased); one ``buffers()`` call."""
    count, buffers = len(chunk), chunk.buffers()
    offsets = _view(buffers[1], kind, chunk.offset, count + 1)
    data = buffers[3 if nested else 2]
    start, stop = int(offsets[0]), int(offsets[count])
    limit = len(chunk.values) if nested else data.size if data is not None else 0
    if start < 0 or stop > limit or stop < start:
        check_offsets(offsets, limit)
    return offsets, data, start, stop


def _offsets_and_ranges(
    chunks: list[Any], wide: type[np.signedinteger[Any]], dtype: np.dtype[Any], nested: bool
) -> tuple[np.ndarray, ArrayParts]:
    """The int64 offsets of the chunks' items laid end to end, and the parts of their data
    each chunk's offsets cover: strings' bytes (``buffers()[2]``), or a list's child values
    (``buffers()[3]``, from the child's own offset: ``chunk.values`` is the whole child)."""
    out, parts, _ = rebased_offsets(chunks, wide, dtype, nested, 0, close=True)
    return out, ArrayParts.of(parts) if parts else ArrayParts((), dtype, (0,))


def rebased_offsets(
    chunks: list[Any],
    wide: type[np.signedinteger[Any]],
    dtype: np.dtype[Any],
    nested: bool,
    base: int,
    *,
    close: bool,
) -> tuple[np.ndarray, list[np.ndarray], int]:
    """:func:`_offsets_and_ranges` of chunks whose items follow ``base`` items of earlier
    ones: their offsets shifted by ``base`` (and the end offset after them if ``close``),
    their data's parts, and the items before the next chunk. One ``buffers()`` call and
    two numpy views a chunk (~8 us); the offsets are checked as ``check_offsets`` does,
    each chunk's ends here and their order in one pass over the rebased offsets (a chunk's
    last offset is the next one's first)."""
    rows = sum(len(c) for c in chunks)
    out = np.empty(rows + close, dtype=np.int64)
    kind = np.dtype(wide)
    parts, row = [], 0
    strings: list[tuple[np.ndarray, Any]] = []  # UTF-8 checked once the offsets are known good
    for chunk in chunks:
        count = len(chunk)
        offsets, data, start, stop = _chunk_offsets(chunk, kind, nested)
        if not nested:
            strings.append((offsets, data))
        # in int64: past 2 GiB of earlier chunks the shift no longer fits an int32 chunk's offsets
        np.subtract(offsets[:count], np.int64(start - base), out=out[row : row + count], casting="unsafe")
        if stop > start:
            first = start + (chunk.values.offset if nested else 0)
            parts.append(_view(data, dtype, first, stop - start))
        row += count
        base += stop - start
    if close:
        out[rows] = base
    if rows and (int(out[rows - 1]) > base or not bool((out[1:] >= out[:-1]).all())):
        raise CorruptSourceError("a string or list column's offsets go back (a corrupt Arrow file or buffer)")
    for offsets, data in strings:
        check_utf8(offsets, data)
    return out, parts, base
