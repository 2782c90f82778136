"""Tables to and from Apache Arrow (pyarrow, the optional ``[arrow]`` extra).

pyarrow and pandas are imported inside the functions that need them, so ``import
shmcache`` stays light and a table entry opens without them. Column files keep Arrow's
own buffers (int64 offsets, LSB-first validity), so :func:`to_arrow` wraps the mapped
arrays with ``pa.py_buffer`` instead of copying them; only bool columns are packed into
bits on the way (they are stored one byte per value so ``column()`` is a numpy bool array).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

import numpy as np

from .._disk.array_parts import FileArray, joined_files
from ..errors import CorruptSourceError, UnsupportedDataError
from .table_chunks import chunk_files, number_values
from .table_encode import (
    NotTabular,
    check_offsets,
    check_utf8,
    encode_column_values,
    encode_table_records,
    list_description,
    table_meta,
    validity,
)

__all__ = [
    "ARROW_EXTRA",
    "TABLE_SUFFIXES",
    "arrow_column",
    "check_dictionaries",
    "column_errors",
    "encode_table",
    "encode_table_parts",
    "is_no_line_error",
    "is_straddling_error",
    "nullable_schema",
    "read_arrow_table",
    "read_table_file",
    "require_pyarrow",
    "to_arrow",
]

ARROW_EXTRA = "pip install 'shmcache[arrow]'"
TABLE_SUFFIXES = (".parquet", ".feather", ".arrow", ".csv", ".jsonl")
"""File suffixes ``put_file`` publishes as one table entry."""


def require_pyarrow(what: str) -> Any:
    """The pyarrow module, or :class:`UnsupportedDataError` saying what to install."""
    try:
        import pyarrow
    except ImportError:
        raise UnsupportedDataError(f"{what} needs pyarrow: {ARROW_EXTRA}") from None
    return pyarrow


# ---------------------------------------------------------------------- put side


def encode_table(data: Any, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Files and meta of a table from a pyarrow Table, a pandas DataFrame, a dict of columns
    or a list of dicts (not a path: see :func:`read_table_file`), each file one array."""
    files, meta = encode_table_parts(data, what)
    return joined_files(files), meta


def encode_table_parts(data: Any, what: str) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """:func:`encode_table`, a chunked pyarrow column's values left in their chunks' own
    buffers (:class:`ArrayParts`, for a writer that takes them): joining them was a whole
    copy of the table beside the caller's (209 MiB for a 209 MiB table of 25 chunks)."""
    if type(data).__module__.partition(".")[0] == "pyarrow":
        pa = require_pyarrow(what)
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if isinstance(data, pa.Table):
            return encode_arrow_parts(data, what)
    files, meta = _encode_other(data, what)
    return {name: array for name, array in files.items()}, meta


def _encode_other(data: Any, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A dict of columns, a list of dicts or a DataFrame."""
    if isinstance(data, Mapping):
        from .table_encode import encode_table_columns

        return encode_table_columns(data, what)
    if isinstance(data, list):
        if not data:
            return {}, table_meta([], [], 0)
        try:
            return encode_table_records(data, what)
        except NotTabular as exc:
            raise UnsupportedDataError(f"{exc}; put_table takes dicts with one set of str keys") from None
    if type(data).__module__.partition(".")[0] == "pandas":
        return _encode_dataframe(data, what)
    raise UnsupportedDataError(
        f"{what} is a {type(data).__name__}; put_table takes a pyarrow Table, a pandas DataFrame, "
        "a dict of columns, a list of dicts, or a .parquet/.feather/.arrow/.csv/.jsonl path"
    )


def _encode_dataframe(frame: Any, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    names = [str(n) for n in frame.columns]
    if len(set(names)) != len(names):
        raise UnsupportedDataError(f"{what}: the DataFrame has duplicate column names")
    try:
        pa = require_pyarrow(what)
    except UnsupportedDataError:  # no pyarrow: numpy columns, object columns as Python values
        from .table_encode import encode_table_columns

        return encode_table_columns({str(n): frame[n].to_numpy() for n in frame.columns}, what)
    arrays = []
    for name in frame.columns:
        try:
            arrays.append(pa.array(frame[name], from_pandas=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise UnsupportedDataError(
                f"{what}: column {str(name)!r} cannot be a table column ({exc}); an object column "
                "must hold one type (str, or numbers): convert it (e.g. .astype(str)) or drop it"
            ) from None
    return encode_arrow(pa.Table.from_arrays(arrays, names=names), what)


def encode_arrow(table: Any, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A pyarrow Table's columns as a table entry's files and meta (each file one array)."""
    files, meta = encode_arrow_parts(table, what)
    return joined_files(files), meta


def encode_arrow_parts(table: Any, what: str) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """A pyarrow Table's columns as a table entry's files and meta, a chunked column's
    values left in their chunks' own buffers (:class:`ArrayParts`, written in order): no
    ``combine_chunks`` copy of the table before the write copies it into the cache."""
    names = list(table.column_names)
    if len(set(names)) != len(names):
        raise UnsupportedDataError(f"{what}: the table has duplicate column names")
    check_dictionaries(table, what)  # before combine_chunks unifies them
    files: dict[str, FileArray] = {}
    descriptions = []
    for i, name in enumerate(names):
        with column_errors(what, name):
            parts, desc = _chunked_column(table.column(i))
        files |= {f"c{i}.{part}": array for part, array in parts.items()}
        descriptions.append(desc)
    return files, table_meta(names, descriptions, table.num_rows)


def _chunked_column(column: Any) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """One column's files: from its chunks' own buffers where ``table_chunks`` takes it,
    else from its chunks combined into one array."""
    found = chunk_files(column)
    if found is not None:
        return found
    one = column.chunk(0) if column.num_chunks == 1 else None  # combine_chunks copies even one
    combined, desc = _arrow_column(one if one is not None else column.combine_chunks())
    return {part: array for part, array in combined.items()}, desc


@contextmanager
def column_errors(what: str, name: str) -> Iterator[None]:
    """Errors encoding column ``name`` of ``what`` typed and named: a type a table cannot
    hold (:class:`NotTabular`) is UnsupportedDataError; data pyarrow's readers let through
    but that does not hold together (offsets past the data, a dictionary index out of
    range: ``ArrowIndexError`` from the decode) is CorruptSourceError."""
    import pyarrow as pa

    try:
        yield
    except NotTabular as exc:
        raise UnsupportedDataError(
            f"{what}: column {name!r} is {exc}, which a table cannot hold; a table column holds "
            "numbers, bools, timestamps, strings, or lists of numbers: cast it (e.g. "
            "table.cast(...) or pyarrow.compute) or drop it"
        ) from None
    except (pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise UnsupportedDataError(f"{what}: column {name!r}: {exc}") from None
    except (CorruptSourceError, pa.ArrowInvalid, pa.ArrowIndexError, pa.ArrowKeyError) as exc:
        raise CorruptSourceError(f"{what}: column {name!r}: {exc}") from None


def check_dictionaries(data: Any, what: str) -> Any:
    """``data`` (a pyarrow Table or RecordBatch) once each dictionary column's dictionaries
    are checked whole (their offsets, their UTF-8), before anything joins, casts or decodes
    them: pyarrow reads a damaged one's strings blindly (a segfault in the decode, or bytes
    from outside the file published). A dictionary is the column's distinct values: small,
    so the full check costs little. The one check of every put of Arrow data: a whole table
    (:func:`encode_arrow_parts`) and each batch streamed (``table_batches``); a damaged
    one is a CorruptSourceError naming ``what`` and the column."""
    import pyarrow.types as pt

    for name, column in zip(data.column_names, data.columns, strict=True):
        if pt.is_dictionary(column.type):
            with column_errors(what, name):
                for chunk in getattr(column, "chunks", (column,)):
                    chunk.dictionary.validate(full=True)
    return data


def nullable_schema(schema: Any) -> Any:
    """``schema`` with every field (and a list's item) nullable and no metadata: what two
    files' schemas must agree on to be one table. A table entry records no nullability
    (its validity bitmap is there where a null is), so files that differ only in a
    field's ``nullable`` flag (one writer declared it, another did not) are one table."""
    import pyarrow as pa

    def relaxed(kind: Any) -> Any:
        if pa.types.is_large_list(kind):
            return pa.large_list(relaxed(kind.value_type))
        if pa.types.is_fixed_size_list(kind):
            return pa.list_(relaxed(kind.value_type), kind.list_size)
        if pa.types.is_list(kind):
            return pa.list_(relaxed(kind.value_type))
        return kind

    return pa.schema([pa.field(f.name, relaxed(f.type)) for f in schema])


def is_straddling_error(exc: BaseException) -> bool:
    """Whether pyarrow's CSV/JSON reader refused a row or line longer than its block
    ("straddling object straddles two block boundaries"): the file is then read again in
    one block as large as itself, not refused."""
    return "straddl" in str(exc)


def is_no_line_error(exc: BaseException) -> bool:
    """Whether pyarrow's CSV/JSON reader found no line at all ("Empty CSV file or block",
    "Empty JSON file"): an empty file, or one line without its newline, which the whole
    read then decides on."""
    return "Empty CSV" in str(exc) or "Empty JSON" in str(exc)


def arrow_column(array: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One Arrow array (a whole column, or one chunk of it: ``table_stream``) as a table
    column's files and description; :class:`NotTabular` for a type a table cannot hold.
    A dictionary array's dictionary must have passed :func:`check_dictionaries`."""
    return _arrow_column(array)


def _arrow_column(array: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.types as pt

    kind = array.type
    if pt.is_dictionary(kind):  # categoricals: stored decoded (checked: check_dictionaries)
        array = array.dictionary_decode()
        kind = array.type
    if pt.is_null(kind):  # every value None: no type to store, and no validity buffer
        raise NotTabular(f"of Arrow type {kind} (every value is missing)")
    valid = _bits(array.buffers()[0], array.offset, len(array)) if array.null_count else None
    if pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind):
        files, desc = encode_column_values(_filled(_numpy(array), valid))
    elif pt.is_timestamp(kind):
        values = _filled(_numpy(array.cast(pa.int64())), valid).view(f"datetime64[{kind.unit}]")
        files, desc = encode_column_values(values)
        desc |= {"tz": kind.tz, "arrow": str(kind)}
    elif pt.is_string(kind) or pt.is_large_string(kind):
        files, desc = _arrow_strings(array.cast(pa.large_string()))
    elif pt.is_list(kind) or pt.is_large_list(kind) or pt.is_fixed_size_list(kind):
        files, desc = _arrow_lists(array)
    else:
        raise NotTabular(f"of Arrow type {kind}")
    if valid is not None:
        if "offsets" not in files and desc["kind"] == "list":  # a fixed-size list with nulls
            files, desc = _arrow_lists(array, fixed=False)
        files["valid"] = validity(valid)
    return files, desc


def _numpy(array: Any) -> np.ndarray:
    """An Arrow array of numbers (a view of its buffer: no copy) or bools as numpy, whatever
    its null slots hold (see :func:`_filled`). Not ``to_numpy`` (nor ``fill_null``): their
    first call imports pandas (1.1 s of a fresh process's put)."""
    if array.type.bit_width == 1:  # bools: one bit each in Arrow, one byte each here
        return _bits(array.buffers()[1], array.offset, len(array))
    return number_values(array)


def _filled(values: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """``values`` with 0 (False) where ``valid`` is False (a copy), or as they are."""
    return values if valid is None else np.where(valid, values, np.zeros(1, values.dtype))


def _bits(buffer: Any, offset: int, count: int) -> np.ndarray:
    """Bits ``offset`` to ``offset + count`` of an Arrow bitmap (LSB first) as bools."""
    bits = np.frombuffer(buffer, dtype=np.uint8)
    return np.unpackbits(bits, count=offset + count, bitorder="little")[offset:].view(np.bool_)


def _sliced_offsets(array: Any, limit: int) -> tuple[np.ndarray, int, int]:
    """The int64 offsets of a large string/list array, rebased to 0, and the range of its
    values they cover (checked within ``limit``, the bytes or child items there are)."""
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64)[array.offset : array.offset + len(array) + 1]
    check_offsets(offsets, limit)
    start, stop = int(offsets[0]), int(offsets[-1])
    return offsets - start, start, stop


def _arrow_strings(array: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    data = array.buffers()[2]
    offsets, start, stop = _sliced_offsets(array, data.size if data is not None else 0)
    values = np.frombuffer(data, dtype=np.uint8)[start:stop] if data is not None else np.empty(0, np.uint8)
    check_utf8(offsets, values)
    return {"bytes": values, "offsets": offsets}, {"kind": "string", "dtype": "str", "arrow": "large_string"}


def _arrow_lists(array: Any, fixed: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.types as pt

    child_type = array.type.value_type
    if not (pt.is_integer(child_type) or pt.is_floating(child_type) or pt.is_boolean(child_type)):
        raise NotTabular(f"a list of {child_type} (only lists of numbers or bools)")
    if pt.is_fixed_size_list(array.type) and fixed:
        size = array.type.list_size
        child = array.values.slice(array.offset * size, len(array) * size)
        if child.null_count:
            raise NotTabular("a list with null items")
        values = _numpy(child).reshape(len(array), size)
        return {"values": values}, list_description(values.dtype, size)
    large = array.cast(pa.large_list(child_type))
    offsets, start, stop = _sliced_offsets(large, len(large.values))
    child = large.values.slice(start, stop - start)
    if child.null_count:
        raise NotTabular("a list with null items")
    values = _numpy(child)
    return {"values": values, "offsets": offsets}, list_description(values.dtype, None)


def read_table_file(fp: IO[bytes], path: str, suffix: str) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """A table file (already opened and checked) as a table entry's files and meta (a
    chunked column's values in :class:`ArrayParts`: its row groups or batches, not joined).

    A corrupt or truncated file raises :class:`CorruptSourceError` naming it; Parquet,
    Feather/Arrow and CSV need pyarrow (JSON lines do not).
    """
    what = f"table file {path}"
    if suffix == ".jsonl":
        try:
            require_pyarrow(what)
        except UnsupportedDataError:
            files, meta = _read_jsonl_without_arrow(fp, path)
            return {name: array for name, array in files.items()}, meta
    return encode_arrow_parts(read_arrow_table(fp, path, suffix), str(path))


def read_arrow_table(fp: IO[bytes], path: str, suffix: str) -> Any:
    """A table file (already opened and checked) as a pyarrow Table; errors as for
    :func:`read_table_file`."""
    pa = require_pyarrow(f"table file {path}")
    try:
        return _read_with_arrow(pa, fp, suffix)
    except (
        pa.ArrowInvalid, pa.ArrowIndexError, pa.ArrowKeyError, pa.ArrowTypeError, pa.ArrowNotImplementedError,
        OSError, EOFError,
    ) as exc:  # fmt: skip
        if isinstance(exc, pa.ArrowTypeError | pa.ArrowNotImplementedError):
            raise UnsupportedDataError(f"{path}: {exc}") from None
        raise CorruptSourceError(f"{path} is not a readable {suffix[1:]} file: {exc}") from None


def _read_with_arrow(pa: Any, fp: IO[bytes], suffix: str) -> Any:
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        # ParquetFile, not read_table: read_table goes through pyarrow.dataset, whose import
        # pulls in pandas (1.1 s of a fresh process's put; the same columns either way). Row
        # group by row group: ParquetFile.read holds ~half the table again while decoding
        # (pyarrow's pool peaked at 412 MiB for a 256 MiB table; by row groups 271 MiB).
        parquet = pq.ParquetFile(fp)
        if not parquet.num_row_groups:
            return parquet.read()
        return pa.concat_tables([parquet.read_row_group(i) for i in range(parquet.num_row_groups)])
    if suffix in (".feather", ".arrow"):
        import pyarrow.feather as feather

        try:
            return feather.read_table(fp)
        except pa.ArrowInvalid:  # an Arrow IPC stream rather than a file
            fp.seek(0)
            return pa.ipc.open_stream(fp).read_all()
    if suffix == ".csv":
        import pyarrow.csv as reader
    else:
        import pyarrow.json as reader  # type: ignore[no-redef]
        if _file_size(fp) == 0:  # JSON lines of no record: no row, no column (as without pyarrow)
            return pa.table({})
    read = reader.read_csv if suffix == ".csv" else reader.read_json
    try:
        return _rowless_as_strings(pa, read(fp))
    except pa.ArrowInvalid as exc:  # a row or line longer than a block (1 MiB): one block
        if suffix == ".csv" and is_no_line_error(exc):
            return _rowless_as_strings(pa, read(_header_line(fp, exc)))
        if not is_straddling_error(exc):
            raise
    fp.seek(0)
    return _rowless_as_strings(pa, read(fp, read_options=reader.ReadOptions(block_size=_whole_block(fp))))


_ONE_LINE_MAX = 1 << 20
"""The largest header-only CSV without a newline read to add one (pyarrow's block)."""


def _header_line(fp: IO[bytes], exc: Exception) -> IO[bytes]:
    """A CSV file of one line with no newline (a header saved by hand, or by a tool that
    ends no line), which pyarrow finds empty, with its newline; else ``exc`` again."""
    if _file_size(fp) > _ONE_LINE_MAX:
        raise exc
    fp.seek(0)
    line = fp.read()
    if not line.strip() or b"\n" in line or b"\r" in line:
        raise exc
    return io.BytesIO(line + b"\n")


def _rowless_as_strings(pa: Any, table: Any) -> Any:
    """A CSV/JSON table of no row (a header-only CSV) with its columns that no value typed
    (Arrow type null, which a table cannot hold) as strings: an empty table of its
    columns, as a Parquet or Arrow file of no row is, not a refusal of "missing" values."""
    if table.num_rows or not any(pa.types.is_null(f.type) for f in table.schema):
        return table
    fields = [f.with_type(pa.large_string()) if pa.types.is_null(f.type) else f for f in table.schema]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def _file_size(fp: IO[bytes]) -> int:
    """The size of the file ``fp`` reads (its position kept)."""
    position = fp.tell()
    try:
        return fp.seek(0, os.SEEK_END)
    finally:
        fp.seek(position)


def _whole_block(fp: IO[bytes]) -> int:
    """A CSV/JSON block size that holds the whole file (pyarrow takes at most 2 GiB - 1)."""
    size = _file_size(fp)
    return max(1 << 20, min(size + 1, (1 << 31) - 1))


def _read_jsonl_without_arrow(fp: IO[bytes], path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    records = []
    for number, line in enumerate(fp, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise CorruptSourceError(f"{path}: line {number} is not JSON ({exc})") from None
    return encode_table(records, f"table file {path}")


# ---------------------------------------------------------------------- open side


def to_arrow(columns: list[dict[str, Any]], files: Mapping[str, np.ndarray], length: int) -> Any:
    """A pyarrow Table over a table entry's mapped files (no copy but bool columns)."""
    pa = require_pyarrow("SharedTable.to_arrow()")
    if not columns:  # from_arrays([]) has 0 rows: a table of rows but no column lost them
        return pa.Table.from_arrays([pa.nulls(length)], names=["rows"]).select([])
    arrays = [_to_arrow_column(pa, i, desc, files, length) for i, desc in enumerate(columns)]
    return pa.Table.from_arrays(arrays, names=[desc["name"] for desc in columns])


def _to_arrow_column(
    pa: Any, i: int, desc: dict[str, Any], files: Mapping[str, np.ndarray], length: int
) -> Any:
    prefix = f"c{i}."
    valid_bits = files.get(f"{prefix}valid")
    valid = pa.py_buffer(valid_bits) if valid_bits is not None else None
    kind = desc["kind"]
    if kind == "bool":
        values = files[f"{prefix}values"]
        mask = None
        if valid_bits is not None:
            mask = ~np.unpackbits(valid_bits, count=length, bitorder="little").astype(bool)
        return pa.array(values, mask=mask)
    if kind in ("number", "datetime"):
        values = files[f"{prefix}values"]
        if kind == "datetime":
            kind_type = pa.timestamp(desc["unit"], desc.get("tz"))
            values = values.view(np.int64)
        else:
            kind_type = pa.from_numpy_dtype(values.dtype)
        return pa.Array.from_buffers(kind_type, length, [valid, _buffer(pa, values)])
    if kind == "string":
        return pa.Array.from_buffers(
            pa.large_string(),
            length,
            [valid, _buffer(pa, files[f"{prefix}offsets"]), _buffer(pa, files[f"{prefix}bytes"])],
        )
    values = files[f"{prefix}values"]
    flat = values.reshape(-1)
    child = (
        pa.array(flat)
        if flat.dtype.kind == "b"
        else pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), len(flat), [None, _buffer(pa, flat)])
    )
    if desc.get("size") is not None and f"{prefix}offsets" not in files:
        return pa.Array.from_buffers(pa.list_(child.type, desc["size"]), length, [valid], children=[child])
    return pa.Array.from_buffers(
        pa.large_list(child.type), length, [valid, _buffer(pa, files[f"{prefix}offsets"])], children=[child]
    )


def _buffer(pa: Any, array: np.ndarray) -> Any:
    """An Arrow buffer over ``array``'s own memory (the shared mapping)."""
    return pa.py_buffer(array) if array.size else pa.py_buffer(b"")
