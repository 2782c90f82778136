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
from .table_encode import arrow_name, check_offsets, check_utf8, list_description

__all__ = ["chunk_files", "number_values"]


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


def _is_number(pt: Any, kind: Any) -> bool:
    return bool(pt.is_integer(kind) or pt.is_floating(kind))


def number_values(array: Any) -> np.ndarray:
    """An Arrow array of fixed-width numbers (no nulls) as a numpy view of its buffer."""
    return _values(array, np.dtype(array.type.to_pandas_dtype()))


def _values(array: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A fixed-width array's values (its offset and length applied), a view of its buffer."""
    return _view(array.buffers()[1], dtype, array.offset, len(array))


def _view(buffer: Any, dtype: np.dtype[Any], start: int, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` from item ``start`` of an Arrow buffer (no copy)."""
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=start * dtype.itemsize)


def _offsets_and_ranges(
    chunks: list[Any], wide: type[np.signedinteger[Any]], dtype: np.dtype[Any], nested: bool
) -> tuple[np.ndarray, ArrayParts]:
    """The int64 offsets of the chunks' items laid end to end, and the parts of their data
    each chunk's offsets cover: strings' bytes (``buffers()[2]``), or a list's child values
    (``buffers()[3]``, from the child's own offset: ``chunk.values`` is the whole child).
    One ``buffers()`` call and two numpy views a chunk (~10 us)."""
    rows = sum(len(c) for c in chunks)
    out = np.empty(rows + 1, dtype=np.int64)
    kind, data_index = np.dtype(wide), 3 if nested else 2
    parts, row, base = [], 0, 0
    for chunk in chunks:
        count = len(chunk)
        buffers = chunk.buffers()
        offsets = np.frombuffer(buffers[1], dtype=kind, count=count + 1, offset=chunk.offset * kind.itemsize)
        data = buffers[data_index]
        check_offsets(offsets, len(chunk.values) if nested else data.size if data is not None else 0)
        if not nested:
            check_utf8(offsets, data)
        start, stop = int(offsets[0]), int(offsets[count])
        # in int64: past 2 GiB of earlier chunks the shift no longer fits an int32 chunk's offsets
        np.subtract(offsets[:count], np.int64(start - base), out=out[row : row + count], casting="unsafe")
        if stop > start:
            first = start + (chunk.values.offset if nested else 0)
            parts.append(_view(buffers[data_index], dtype, first, stop - start))
        row += count
        base += stop - start
    out[rows] = base
    return out, ArrayParts.of(parts) if parts else ArrayParts((), dtype, (0,))
