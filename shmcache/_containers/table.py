"""``SharedTable``: the open side of a table entry (``put_table``, and ``share`` of a list
of dicts with one schema).

Columns are read straight from the mapped arrays; ``table[i]`` builds a fresh dict of
Python values each time (so a training loop that mutates it changes nothing shared), with
one precomputed getter per column so a row costs a few C calls per column.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from ..errors import KeyNotFoundError
from .shared import READERS, EntryRef, SharedRagged, SharedStrings, _byte_source, _position, _Shared

__all__ = ["SharedTable"]

_Getter = Callable[[int], Any]


def _flat_view(array: np.ndarray) -> memoryview:
    """A 1-D memoryview whose indexing and ``tolist`` give Python values."""
    return array.reshape(-1).data if array.size else memoryview(array.reshape(-1).tobytes()).cast("B")


def _scalar_getter(values: np.ndarray, desc: Mapping[str, Any]) -> _Getter:
    if desc["kind"] == "datetime":
        unit, tz = desc["unit"], desc.get("tz")
        zone = _zone(tz) if tz else None
        micros = values.astype("datetime64[us]") if unit != "us" else values

        def stamp(i: int) -> Any:
            value = micros[i].item()  # a datetime.datetime (ns are truncated to us)
            return value.replace(tzinfo=datetime.timezone.utc).astimezone(zone) if zone else value

        return stamp
    return _flat_view(values).__getitem__


def _zone(name: str) -> datetime.tzinfo:
    if name.upper() in ("UTC", "Z", "+00:00"):
        return datetime.timezone.utc
    import zoneinfo

    return zoneinfo.ZoneInfo(name)


def _string_getter(data: np.ndarray, offsets: np.ndarray) -> _Getter:
    buffer, start = _byte_source(data)
    bounds = offsets.data

    def text(i: int) -> str:
        return buffer[start + bounds[i] : start + bounds[i + 1]].decode("utf-8", "surrogatepass")  # type: ignore[no-any-return]

    return text


def _list_getter(values: np.ndarray, offsets: np.ndarray | None) -> _Getter:
    flat = _flat_view(values)
    if offsets is None:
        size = values.shape[1] if values.ndim == 2 else 0

        def fixed(i: int) -> list[Any]:
            return flat[i * size : i * size + size].tolist()

        return fixed
    bounds = offsets.data

    def ragged(i: int) -> list[Any]:
        return flat[bounds[i] : bounds[i + 1]].tolist()

    return ragged


def _with_nulls(get: _Getter, bits: np.ndarray) -> _Getter:
    valid = bits.data

    def maybe(i: int) -> Any:
        return get(i) if valid[i >> 3] >> (i & 7) & 1 else None

    return maybe


class SharedTable(_Shared, Sequence[dict[str, Any]]):
    """A read-only table in shared memory: rows as fresh dicts, columns without a copy.

    ``column(name)`` gives a read-only ndarray over the mapping for numbers, bools and
    datetimes (a 2-D one for fixed-size lists), a :class:`SharedStrings` for strings and a
    :class:`SharedRagged` for lists of numbers; null slots there hold 0, ``""`` or an empty
    list, and ``valid(name)`` says which rows are null. ``table[i]`` gives None for nulls.
    ``to_arrow()`` wraps the same memory as a ``pyarrow.Table``.
    """

    __slots__ = ("_columns", "_files", "_getters", "_length", "_names")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        self._ref = ref
        self._files = dict(files)
        self._columns: list[dict[str, Any]] = list(meta["columns"])
        self._names = tuple(desc["name"] for desc in self._columns)
        self._length = int(meta["length"])
        self._getters = tuple(
            (desc["name"], self._getter(i, desc)) for i, desc in enumerate(self._columns)
        )

    def _getter(self, i: int, desc: Mapping[str, Any]) -> _Getter:
        files, prefix = self._files, f"c{i}."
        kind = desc["kind"]
        if kind == "string":
            get = _string_getter(files[prefix + "bytes"], files[prefix + "offsets"])
        elif kind == "list":
            get = _list_getter(files[prefix + "values"], files.get(prefix + "offsets"))
        else:
            get = _scalar_getter(files[prefix + "values"], desc)
        bits = files.get(prefix + "valid")
        return get if bits is None else _with_nulls(get, bits)

    def __len__(self) -> int:
        return self._length

    @property
    def columns(self) -> list[str]:
        """The column names, in order."""
        return list(self._names)

    @property
    def schema(self) -> dict[str, str]:
        """Each column's Arrow type, by name (e.g. ``{"label": "int64"}``)."""
        return {desc["name"]: desc["arrow"] for desc in self._columns}

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if index.__class__ is int and 0 <= index < self._length:  # the hot path
            return {name: get(index) for name, get in self._getters}  # type: ignore[arg-type]
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(self._length))]
        return self._row(_position(index, self._length))

    def _row(self, i: int) -> dict[str, Any]:
        return {name: get(i) for name, get in self._getters}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self._length):
            yield self._row(i)

    def _index(self, name: str) -> int:
        try:
            return self._names.index(name)
        except ValueError:
            raise KeyNotFoundError(
                f"table {self._ref.key!r} has no column {name!r}; its columns: {', '.join(map(repr, self._names))}"
            ) from None

    def column(self, name: str) -> Any:
        """One column over the shared memory, no copy (see the class docstring)."""
        i = self._index(name)
        desc, prefix = self._columns[i], f"c{i}."
        if desc["kind"] == "string":
            return SharedStrings(self._ref, self._files, prefix=prefix)
        if desc["kind"] == "list" and prefix + "offsets" in self._files:
            return SharedRagged(self._ref, self._files, prefix=prefix)
        values = self._files[prefix + "values"]
        if desc["kind"] == "datetime":
            return values.view(desc["dtype"])
        return values

    def valid(self, name: str) -> np.ndarray:
        """A fresh bool array: True where column ``name`` is not null."""
        bits = self._files.get(f"c{self._index(name)}.valid")
        if bits is None:
            return np.ones(self._length, dtype=bool)
        return np.unpackbits(bits, count=self._length, bitorder="little").astype(bool)

    def to_arrow(self) -> Any:
        """The table as a ``pyarrow.Table`` over the same shared memory (bool columns are
        packed into bits, a copy); needs pyarrow (``pip install 'shmcache[arrow]'``)."""
        from .table_arrow import to_arrow

        return to_arrow(self._columns, self._files, self._length)

    def __repr__(self) -> str:
        return f"<SharedTable {self._ref.key!r} ({self._length} rows: {', '.join(self._names)}) in {self._ref.root}>"


READERS["table"] = SharedTable
