"""``SharedTable``: the open side of a table entry (``put_table``, and ``share`` of a list
of dicts with one schema).

Columns are read straight from the mapped arrays; ``table[i]`` builds a fresh dict of
Python values each time (so a training loop that mutates it changes nothing shared), with
one precomputed getter per column so a row costs a few C calls per column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from ..errors import KeyNotFoundError
from .shared import (
    READERS,
    EntryRef,
    SharedRagged,
    SharedStrings,
    _byte_source,
    _position,
    _Shared,
    open_version,
)

__all__ = ["SharedTable", "open_table_version"]

_Getter = Callable[[int], Any]


def _flat_view(array: np.ndarray) -> memoryview | _HalfFloats:
    """A 1-D memoryview whose indexing and ``tolist`` give Python values (float16, which
    memoryview cannot index, through :class:`_HalfFloats`)."""
    if array.dtype == np.float16:
        return _HalfFloats(array.reshape(-1))
    return array.reshape(-1).data if array.size else memoryview(array.reshape(-1).tobytes()).cast("B")


class _HalfFloats:
    """float16 values indexed as a memoryview of another type is: an item is a Python
    float, a slice has ``tolist``."""

    __slots__ = ("_values",)

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def __getitem__(self, index: int | slice) -> Any:
        found = self._values[index]
        return found if isinstance(index, slice) else float(found)


def _datetime_getter(values: np.ndarray, desc: Mapping[str, Any]) -> _Getter:
    import datetime  # here: `import shmcache` stays light (a DataLoader worker pays for it)

    unit, tz = desc["unit"], desc.get("tz")
    zone = _zone(tz) if tz else None
    micros = values.astype("datetime64[us]") if unit != "us" else values

    def stamp(i: int) -> Any:
        value = micros[i].item()  # a datetime.datetime (ns are truncated to us)
        return value.replace(tzinfo=datetime.timezone.utc).astimezone(zone) if zone else value

    return stamp


def _zone(name: str) -> Any:
    import datetime

    if name.upper() in ("UTC", "Z", "+00:00"):
        return datetime.timezone.utc
    import zoneinfo

    return zoneinfo.ZoneInfo(name)


def _row_source(
    columns: Sequence[Mapping[str, Any]], files: Mapping[str, np.ndarray]
) -> tuple[str, dict[str, Any]]:
    """The dict display that builds row ``i`` (one expression per column, no per-column
    call) and the buffers it reads, bound as default arguments (local variables are the
    fastest lookups). Column names go in as ``repr`` literals, so the dict is built with
    constant keys; buffers are passed, never written into the source."""
    scope: dict[str, Any] = {}
    items = []
    for c, desc in enumerate(columns):
        prefix, kind = f"c{c}.", desc["kind"]
        if kind == "string":
            scope[f"B{c}"], scope[f"S{c}"] = _byte_source(files[prefix + "bytes"])
            scope[f"O{c}"] = files[prefix + "offsets"].data
            # strict UTF-8 (stored by share/put_table from Python strings): the codec's
            # fast path, ~30% cheaper than naming the surrogatepass handler.
            how = "" if desc.get("strict_utf8") else '"utf-8", "surrogatepass"'
            expr = f"B{c}[S{c} + O{c}[i] : S{c} + O{c}[i + 1]].decode({how})"
        elif kind == "list":
            values = files[prefix + "values"]
            scope[f"F{c}"] = _flat_view(values)
            if prefix + "offsets" in files:
                scope[f"O{c}"] = files[prefix + "offsets"].data
                expr = f"F{c}[O{c}[i] : O{c}[i + 1]].tolist()"
            else:
                size = values.shape[1]
                expr = f"F{c}[i * {size} : i * {size} + {size}].tolist()"
        elif kind == "datetime":
            scope[f"G{c}"] = _datetime_getter(files[prefix + "values"], desc)
            expr = f"G{c}(i)"
        else:
            scope[f"F{c}"] = _flat_view(files[prefix + "values"])
            expr = f"F{c}[i]"
        if prefix + "valid" in files:
            scope[f"V{c}"] = files[prefix + "valid"].data
            expr = f"({expr} if V{c}[i >> 3] >> (i & 7) & 1 else None)"
        name = str(desc["name"])
        items.append(f"{name!r}: {expr}")
    return "{" + ", ".join(items) + "}", scope


def _row_functions(
    columns: Sequence[Mapping[str, Any]], files: Mapping[str, np.ndarray], length: int
) -> tuple[_Getter, Callable[[Any, Any], Any]]:
    """``(row, getitem)`` compiled for this table: ``row(i)`` -> a fresh dict (about 2x a
    loop of getters), and a ``__getitem__`` that builds it inline for an int in range
    (one Python frame per ``table[i]``, not two) and hands anything else to
    :meth:`SharedTable._getitem`."""
    display, scope = _row_source(columns, files)
    bound = "".join(f", {name}={name}" for name in scope)
    source = (
        f"def row(i{bound}):\n    return {display}\n"
        f"def getitem(self, i, _length={length}{bound}):\n"
        f"    if i.__class__ is int and 0 <= i < _length:\n        return {display}\n"
        "    return self._getitem(i)\n"
    )
    exec(compile(source, "<shmcache table row>", "exec"), scope)
    return scope["row"], scope["getitem"]


class SharedTable(_Shared, Sequence[dict[str, Any]]):
    """A read-only table in shared memory: rows as fresh dicts, columns without a copy.

    ``column(name)`` gives a read-only ndarray over the mapping for numbers, bools and
    datetimes (a 2-D one for fixed-size lists), a :class:`SharedStrings` for strings and a
    :class:`SharedRagged` for lists of numbers; null slots there hold 0, ``""`` or an empty
    list, and ``valid(name)`` says which rows are null. ``table[i]`` gives None for nulls.
    ``to_arrow()`` wraps the same memory as a ``pyarrow.Table``.
    """

    __slots__ = ("_columns", "_files", "_length", "_names", "_row")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        self._ref = ref
        self._files = dict(files)
        self._columns: list[dict[str, Any]] = list(meta["columns"])
        self._names = tuple(desc["name"] for desc in self._columns)
        self._length = int(meta["length"])
        self._row, getitem = _row_functions(self._columns, self._files, self._length)
        if type(self) is SharedTable:  # table[i] calls the compiled getitem: a stateless subclass
            self.__class__ = type("SharedTable", (SharedTable,), {
                "__slots__": (), "__getitem__": getitem, "__module__": __name__,
                "__qualname__": "SharedTable", "__doc__": SharedTable.__doc__,
            })  # fmt: skip

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
        if index.__class__ is int and 0 <= index < self._length:  # replaced per table (__init__)
            return self._row(index)  # type: ignore[no-any-return]
        return self._getitem(index)

    def _getitem(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(self._length))]
        return self._row(_position(index, self._length))  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self._length):
            yield self._row(i)

    def _index(self, name: str) -> int:
        try:
            return self._names.index(name)
        except ValueError:
            raise KeyNotFoundError(
                f"table {self._ref.key!r} has no column {name!r}; "
                f"its columns: {', '.join(map(repr, self._names))}"
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
        return values.view(desc["dtype"]) if desc["kind"] == "datetime" else values.view()  # a fresh view

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

    def __reduce__(self) -> tuple[Any, ...]:
        return open_table_version, tuple(self._ref)

    def __repr__(self) -> str:
        names = ", ".join(self._names)
        return f"<SharedTable {self._ref.key!r} ({self._length} rows: {names}) in {self._ref.root}>"


def open_table_version(root: str, key: str, version: str, kind: str) -> Any:
    """What a pickled :class:`SharedTable` calls: importing this module registers the kind
    (a lazily imported ``shmcache`` may not have loaded it in a fresh worker)."""
    return open_version(root, key, version, kind)


READERS["table"] = SharedTable
