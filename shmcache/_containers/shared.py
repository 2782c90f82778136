"""Read-only shared containers: the open side of strings, ragged, records, mapping and blobs.

Each reads straight from the mapped arrays: no per-item Python object lives in the
reader, so nothing has a reference count for a forked DataLoader worker to copy. Each
pickles as a reference (root, key, version), like the arrays.
"""

from __future__ import annotations

import bisect
import json
import operator
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, overload

import numpy as np

from .._disk.attach import attach_array
from .._disk.layout import Layout
from .._disk.mapped import MappedFile, mapped_base
from .._disk.meta import EntryMeta, read_meta
from ..errors import KeyNotFoundError, UnsupportedDataError

if TYPE_CHECKING:
    from .samples import SharedSamples

__all__ = [
    "READERS",
    "EntryRef",
    "SharedBlobs",
    "SharedMapping",
    "SharedRagged",
    "SharedRecords",
    "SharedStrings",
    "container_for",
    "fast_json",
    "open_version",
    "utf8",
    "wrong_kind",
]


class EntryRef(NamedTuple):
    """Where a container's data lives; what it pickles as."""

    root: str
    key: str
    version: str
    kind: str


def open_version(root: str, key: str, version: str, kind: str, meta: EntryMeta | None = None) -> Any:
    """Attach one published version of a container entry (also what unpickling calls).

    ``meta`` is the version's ``meta.json`` when the caller has read it already.
    """
    layout = Layout(Path(root))
    if meta is None:
        meta = read_meta(layout, version)
    if meta is None:
        raise KeyNotFoundError(
            f"entry {key!r} (version {version}) in {root} was replaced or evicted; open the key again"
        )
    if meta.kind != kind:
        raise wrong_kind(key, meta.kind, kind)
    try:
        files = {name: attach_array(root, version, f"{name}.npy", key) for name in meta.files or ()}
    except FileNotFoundError:
        raise KeyNotFoundError(f"entry {key!r} (version {version}) was evicted while being opened") from None
    return container_for(EntryRef(root, key, version, kind), files, meta.raw)


def wrong_kind(key: str, kind: str, wanted: str) -> UnsupportedDataError:
    """The error for opening an entry as a kind it is not."""
    opener = "open_array" if kind == "array" else f"open_{kind}"
    return UnsupportedDataError(
        f"entry {key!r} holds {kind}, not {wanted}; open it with shmcache.{opener} (or shmcache.open)"
    )


def utf8(text: str) -> bytes:
    """UTF-8 that round-trips every Python ``str`` (lone surrogates included)."""
    return text.encode("utf-8", "surrogatepass")


def fast_json() -> Any | None:
    """orjson if installed (a base dependency; None falls back to ``json``)."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson


def _position(index: Any, length: int) -> int:
    i = operator.index(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"index {index} out of range for {length} items")
    return i


def _byte_source(array: np.ndarray) -> tuple[Any, int]:
    """``(buffer, start)`` such that ``buffer[start + a : start + b]`` are bytes a..b of
    ``array``: slicing the mapping itself is the fastest way to get ``bytes`` out."""
    base = mapped_base(array)
    if isinstance(base, MappedFile) and array.size:
        return base, int(array.ctypes.data) - base.start_address()
    return array.tobytes(), 0


class _Shared:
    """Base of the containers: a reference that pickles small."""

    __slots__ = ("_ref",)
    _ref: EntryRef

    @property
    def key(self) -> str:
        return self._ref.key

    def __reduce__(self) -> tuple[Any, ...]:
        return open_version, tuple(self._ref)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._ref.key!r} ({len(self)} items) in {self._ref.root}>"  # type: ignore[arg-type]


class SharedStrings(_Shared, Sequence[str]):
    """A read-only sequence of ``str`` in shared memory (``put_strings``).

    ``strings[i]`` decodes one string; ``s in strings`` and ``strings.index(s)`` use a
    prebuilt hash index (no dict is built in the reader); a table's string column has
    none (12 bytes a row saved) and scans.
    """

    __slots__ = ("_buffer", "_bytes", "_hashes", "_length", "_offsets", "_order", "_start")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], prefix: str = "") -> None:
        self._ref = ref
        self._bytes = files[f"{prefix}bytes"].data
        self._buffer, self._start = _byte_source(files[f"{prefix}bytes"])
        self._offsets = files[f"{prefix}offsets"].data  # Python ints on indexing
        self._length = len(self._offsets) - 1
        hashes = files.get(f"{prefix}hashes")  # a table's string column has no hash index
        self._hashes = hashes.data if hashes is not None else None
        self._order = files[f"{prefix}order"].data if hashes is not None else None

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if index.__class__ is int and 0 <= index < self._length:  # the hot path
            offsets, start = self._offsets, self._start
            return self._buffer[start + offsets[index] : start + offsets[index + 1]].decode(  # type: ignore[no-any-return]
                "utf-8", "surrogatepass"
            )
        if isinstance(index, slice):
            return [self._decode(i) for i in range(*index.indices(self._length))]
        return self._decode(_position(index, self._length))

    def _decode(self, i: int) -> str:
        offsets, start = self._offsets, self._start
        return self._buffer[start + offsets[i] : start + offsets[i + 1]].decode(  # type: ignore[no-any-return]
            "utf-8", "surrogatepass"
        )

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self._decode(i)

    def find(self, value: object) -> int:
        """Position of the first ``value``, or -1 (hash lookup: no scan)."""
        if not isinstance(value, str):
            return -1
        encoded = utf8(value)
        hashes, order, offsets = self._hashes, self._order, self._offsets
        if hashes is None or order is None:  # no index: a scan
            found = (i for i in range(self._length) if self._bytes[offsets[i] : offsets[i + 1]] == encoded)
            return next(found, -1)
        wanted = zlib.crc32(encoded)
        at = bisect.bisect_left(hashes, wanted)  # type: ignore[call-overload]
        while at < len(hashes) and hashes[at] == wanted:
            position = order[at]
            if self._bytes[offsets[position] : offsets[position + 1]] == encoded:
                return int(position)
            at += 1
        return -1

    def __contains__(self, value: object) -> bool:
        return self.find(value) >= 0

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        if start == 0 and stop is None:
            position = self.find(value)
            if position >= 0:
                return position
            raise ValueError(f"{value!r} is not in {self._ref.key!r}")
        return super().index(value, start, len(self) if stop is None else stop)


class SharedRagged(_Shared, Sequence[np.ndarray]):
    """A read-only sequence of arrays that differ in their first dimension (``put_ragged``).

    ``ragged[i]`` is a read-only view of the shared values: no copy.
    """

    __slots__ = ("_length", "_offsets", "_values")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], prefix: str = "") -> None:
        self._ref = ref
        self._values = files[f"{prefix}values"]
        self._offsets = files[f"{prefix}offsets"].data
        self._length = len(self._offsets) - 1

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...
    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(self._length))]
        return self._item(_position(index, self._length))

    def _item(self, i: int) -> np.ndarray:
        return self._values[self._offsets[i] : self._offsets[i + 1]]

    @property
    def values(self) -> np.ndarray:
        """All items concatenated (read-only, shared)."""
        return self._values

    @property
    def lengths(self) -> np.ndarray:
        """First-dimension length of every item."""
        return np.diff(np.asarray(self._offsets))


class SharedRecords(_Shared, Sequence[Any]):
    """A read-only sequence of JSON-compatible records (``put_records``).

    Each access decodes a fresh object: a training loop that mutates what it got can
    change neither the cache nor what the next access (or epoch) sees.
    """

    __slots__ = ("_buffer", "_length", "_loads", "_offsets", "_start")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], prefix: str = "") -> None:
        self._ref = ref
        self._buffer, self._start = _byte_source(files[f"{prefix}bytes"])
        self._offsets = files[f"{prefix}offsets"].data
        self._length = len(self._offsets) - 1
        orjson = fast_json()
        self._loads = json.loads if orjson is None else orjson.loads

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._decode(i) for i in range(*index.indices(self._length))]
        return self._decode(_position(index, self._length))

    def _decode(self, i: int) -> Any:
        offsets, start = self._offsets, self._start
        document = self._buffer[start + offsets[i] : start + offsets[i + 1]]
        try:
            return self._loads(document)
        except ValueError:  # NaN, lone surrogates, huge ints (marked): json.loads reads them exactly
            return json.loads(document)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self._decode(i)


class SharedMapping(_Shared, Mapping[str, Any]):
    """A read-only ``Mapping[str, X]`` in shared memory (``put_mapping``).

    Keys are found through a hash index in shared memory; values are array rows (or
    ragged items: read-only views), strings, or freshly decoded records.
    """

    __slots__ = ("_keys", "_values")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray], form: str) -> None:
        self._ref = ref
        self._keys = SharedStrings(ref, files, prefix="keys.")
        self._values: Sequence[Any] | np.ndarray
        if form == "strings":
            self._values = SharedStrings(ref, files, prefix="values.")
        elif form == "records":
            self._values = SharedRecords(ref, files, prefix="values.")
        elif form == "ragged":
            self._values = SharedRagged(ref, files, prefix="values.")
        else:
            self._values = files["values.rows"]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return self._keys.find(key) >= 0

    def __getitem__(self, key: str) -> Any:
        position = self._keys.find(key)
        if position < 0:
            raise KeyError(key)
        return self._values[position]


class SharedBlobs(_Shared, Sequence[np.ndarray]):
    """Files (or byte strings) packed into one entry (``put_blobs``), by position or name.

    ``blobs[i]`` and ``blobs["relative/name.jpg"]`` are read-only ``uint8`` views of the
    shared bytes (no copy: decode them with ``PIL.Image.open(io.BytesIO(b))`` or
    ``cv2.imdecode(b, ...)``). A Sequence: iterating yields the arrays in stored order (a
    directory's sorted names; tar shards' members as in the shards);
    ``name in blobs`` looks a name up (hash index); ``.names`` are the names in order.
    """

    __slots__ = ("_bytes", "_length", "_names", "_offsets")

    def __init__(self, ref: EntryRef, files: Mapping[str, np.ndarray]) -> None:
        self._ref = ref
        self._bytes = files["bytes"]
        self._offsets = files["offsets"].data  # Python ints on indexing
        self._length = len(self._offsets) - 1
        self._names = SharedStrings(ref, files, prefix="names.")

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int | str) -> np.ndarray: ...
    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...
    def __getitem__(self, index: int | str | slice) -> np.ndarray | list[np.ndarray]:
        if index.__class__ is int and 0 <= index < self._length:  # type: ignore[operator]  # the hot path
            offsets = self._offsets
            return self._bytes[offsets[index] : offsets[index + 1]]  # type: ignore[index]
        if isinstance(index, str):
            position = self._names.find(index)
            if position < 0:
                raise KeyError(index)
            return self._item(position)
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(self._length))]
        return self._item(_position(index, self._length))

    def _item(self, i: int) -> np.ndarray:
        return self._bytes[self._offsets[i] : self._offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self._length):
            yield self._item(i)

    def __contains__(self, name: object) -> bool:
        """Whether a blob has this name (names, not contents, are what ``in`` tests)."""
        return self._names.find(name) >= 0

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        """Position of the blob named ``value``."""
        position = self._names.find(value)
        if position < 0 or position < start or (stop is not None and position >= stop):
            raise ValueError(f"{value!r} is not a name in {self._ref.key!r}")
        return position

    @property
    def names(self) -> SharedStrings:
        """The blobs' names (relative POSIX paths), in order."""
        return self._names

    @property
    def nbytes(self) -> int:
        """Bytes of all blobs together."""
        return int(self._bytes.nbytes)

    @property
    def sizes(self) -> np.ndarray:
        """Size of every blob in bytes."""
        return np.diff(np.asarray(self._offsets))

    def samples(self) -> SharedSamples:
        """The blobs grouped by basename, as WebDataset groups a tar shard's members:
        ``samples()[i]`` is ``{"__key__": "000017", "jpg": <bytes view>, "cls": ...}``
        (see :mod:`shmcache._containers.samples`)."""
        from .samples import SharedSamples

        return SharedSamples(self)


READERS: dict[str, Callable[[EntryRef, Mapping[str, np.ndarray], Mapping[str, Any]], Any]] = {}
"""Reader classes of kinds defined in modules of their own (``table``), which register
here when imported (``_READER_HOMES`` names them; each pickles through a function of its own
module, so unpickling imports it), so this module needs no import of them."""

_READER_HOMES = {"table": "shmcache._containers.table"}
"""The module that registers each such kind: an open that meets one imports it then."""


def container_for(ref: EntryRef, files: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Any:
    """The reader object of a non-array entry kind."""
    reader = READERS.get(ref.kind)
    if reader is None and ref.kind in _READER_HOMES:
        import importlib

        importlib.import_module(_READER_HOMES[ref.kind])
        reader = READERS.get(ref.kind)
    if reader is not None:
        return reader(ref, files, meta)
    if ref.kind == "strings":
        return SharedStrings(ref, files)
    if ref.kind == "ragged":
        return SharedRagged(ref, files)
    if ref.kind == "records":
        return SharedRecords(ref, files)
    if ref.kind == "mapping":
        return SharedMapping(ref, files, meta["values"])
    if ref.kind == "blobs":
        return SharedBlobs(ref, files)
    raise ValueError(f"unknown entry kind {ref.kind!r}")
