"""Encoding Python containers into object-free arrays (the put side of each kind).

A Dataset's memory grows in DataLoader workers because reading a Python object writes
its reference count. Each kind here stores the same information as plain numbers and
bytes, which have no reference counts:

- strings: one UTF-8 buffer + int64 offsets, plus (crc32, position) pairs sorted by
  hash so ``index``/``in`` need no dict in the reader;
- ragged: one values array + int64 offsets along the first dimension;
- records: one buffer of JSON documents + int64 offsets (decoded fresh on each access);
- tables (``table_encode``): columns; ``share`` stores a list of dicts with one schema so;
- mapping: keys as strings + values as rows, strings, ragged or records.
"""

from __future__ import annotations

import json
import math
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._disk.npy import check_storable_dtype
from ..errors import UnsupportedDataError
from .shared import fast_json, utf8  # the read side's, which must not import this module
from .table_encode import NotTabular, encode_table_records
from .table_pack import pack_numbers

__all__ = [
    "Encoded",
    "content_digest",
    "encode_any",
    "encode_mapping",
    "encode_ragged",
    "encode_records",
    "encode_strings",
    "fast_json",
    "same_content",
    "utf8",
]

Encoded = tuple[str, dict[str, np.ndarray], dict[str, Any]]
"""``(kind, files, meta)``: the arrays to store (file name without ``.npy``) and the
extra metadata of an entry."""


def _offsets(lengths: Iterable[int], count: int) -> np.ndarray:
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.fromiter(lengths, dtype=np.int64, count=count), out=offsets[1:])
    return offsets


def _bytes_with_offsets(blobs: list[bytes], prefix: str) -> dict[str, np.ndarray]:
    return {
        f"{prefix}bytes": np.frombuffer(b"".join(blobs), dtype=np.uint8),
        f"{prefix}offsets": _offsets(map(len, blobs), len(blobs)),
    }


def encode_strings(strings: Iterable[Any], what: str, prefix: str = "") -> dict[str, np.ndarray]:
    """Streams ``strings`` (an iterator of them is never held: HDF5's are read in slabs) into
    the UTF-8 buffer, lengths and hashes, ~12 bytes a string beyond its own."""
    data, lengths, hashes = bytearray(), array("q"), array("I")
    for i, text in enumerate(strings):
        if not isinstance(text, str):
            raise UnsupportedDataError(f"{what}[{i}] is {type(text).__name__}, not str")
        blob = utf8(text)
        data += blob
        lengths.append(len(blob))
        hashes.append(zlib.crc32(blob))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    del lengths
    crcs = np.frombuffer(hashes, dtype=np.uint32)
    order = np.argsort(crcs, kind="stable")  # equal hashes keep positions ascending
    return {
        f"{prefix}bytes": np.frombuffer(data, dtype=np.uint8),
        f"{prefix}offsets": offsets,
        f"{prefix}hashes": crcs[order],
        f"{prefix}order": order.astype(np.int64, copy=False),
    }


def encode_ragged(
    arrays: Iterable[Any], what: str, prefix: str = ""
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    parts = [np.asarray(a) for a in arrays]
    for i, part in enumerate(parts):
        check_storable_dtype(part.dtype, f"{what}[{i}]")
        if part.ndim == 0:
            raise UnsupportedDataError(f"{what}[{i}] is a 0-d array; ragged items need a first dimension")
    if parts:
        first = parts[0]
        for i, part in enumerate(parts):
            if part.dtype != first.dtype or part.shape[1:] != first.shape[1:]:
                raise UnsupportedDataError(
                    f"{what}[{i}] has dtype {part.dtype} and item shape {part.shape[1:]}, but "
                    f"{what}[0] has {first.dtype} and {first.shape[1:]}; ragged arrays must agree "
                    "on everything but the first dimension"
                )
        values = np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(first)
    else:
        values = np.empty(0, dtype=np.float64)
    offsets = _offsets((len(p) for p in parts), len(parts))
    meta = {"dtype": str(values.dtype), "item_shape": list(values.shape[1:])}
    return {f"{prefix}values": values, f"{prefix}offsets": offsets}, meta


def _jsonable(value: Any, path: str, allow_nan: bool) -> Any:
    """``value`` as plain JSON types, or UnsupportedDataError naming where it is not."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not allow_nan and not math.isfinite(value):
            raise UnsupportedDataError(
                f"{path} is {value!r}, which JSON cannot represent; replace it (e.g. with None) "
                "or pass allow_nan=True"
            )
        return value
    if isinstance(value, np.generic) and not isinstance(value, (np.void, np.object_)):
        return _jsonable(value.item(), path, allow_nan)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise UnsupportedDataError(
                    f"{path} has key {key!r} of type {type(key).__name__}; JSON object keys must "
                    "be str (convert them, or store a list of pairs)"
                )
            out[key] = _jsonable(item, f"{path}[{key!r}]", allow_nan)
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, f"{path}[{i}]", allow_nan) for i, item in enumerate(value)]
    hint = " (use .tolist(), or put it with put_ragged/put_array)" if isinstance(value, np.ndarray) else ""
    raise UnsupportedDataError(f"{path} is a {type(value).__name__}, which is not JSON-compatible{hint}")


JSON_ONLY = b"\xef\xbb\xbf"
"""Prefix (a UTF-8 byte order mark) of a document only ``json`` reads exactly: orjson
refuses it and ``json.loads`` skips it. Marks records with integers beyond 64 bits, which
orjson would read back as floats."""


def _checked_json(record: Any, path: str, allow_nan: bool) -> bytes:
    """The slow, exact encoding: ``_jsonable``'s checks and typed errors, then ``json``."""
    value = _jsonable(record, path, allow_nan)
    blob = utf8(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    return JSON_ONLY + blob if _has_huge_int(value) else blob


def _has_huge_int(value: Any) -> bool:
    if isinstance(value, int):
        return not -(2**63) <= value < 2**64
    if isinstance(value, dict):
        return any(map(_has_huge_int, value.values()))
    if isinstance(value, list):
        return any(map(_has_huge_int, value))
    return False


def encode_records(
    records: Iterable[Any], what: str, prefix: str = "", allow_nan: bool = False
) -> dict[str, np.ndarray]:
    """Records as JSON documents: orjson encodes, and only what it refuses (numpy scalars,
    sets, NaN, non-str keys, lone surrogates, huge ints...) or what may hide a NaN (it
    writes NaN as ``null``) goes through ``_jsonable``, which normalises or names the culprit."""
    orjson = fast_json()
    if orjson is None:
        blobs = [_checked_json(r, f"{what}[{i}]", allow_nan) for i, r in enumerate(records)]
        return _bytes_with_offsets(blobs, prefix)
    dumps, refused = orjson.dumps, orjson.JSONEncodeError
    options = (  # what _jsonable refuses or normalises goes there too
        orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
    )
    blobs = []
    for i, record in enumerate(records):
        try:
            blob = dumps(record, option=options)
        except refused:
            blob = b"null"
        if b"null" in blob:  # maybe a NaN or an infinity, which orjson writes as null
            blob = _checked_json(record, f"{what}[{i}]", allow_nan)
        blobs.append(blob)
    return _bytes_with_offsets(blobs, prefix)


def _value_form(values: Sequence[Any]) -> str:
    """Which kind stores these mapping values: rows, strings, ragged or records."""
    if all(isinstance(v, str) for v in values):
        return "strings"
    if all(isinstance(v, (Mapping, list, tuple)) and not isinstance(v, np.ndarray) for v in values):
        return "records"
    if all(isinstance(v, (np.ndarray, np.generic, int, float, bool, complex)) for v in values):
        shapes = {np.shape(v) for v in values}
        return "rows" if len(shapes) <= 1 else "ragged"
    if all(isinstance(v, _JSON_VALUES) for v in values):  # numbers, str and lists mixed: JSON each
        return "records"
    kinds = sorted({type(v).__name__ for v in values})
    raise UnsupportedDataError(
        "mapping values must be arrays/numbers, str, dicts/lists or None (JSON values may be "
        f"mixed; arrays may not be mixed with the others); got {', '.join(kinds)}"
    )


_JSON_VALUES = (str, int, float, bool, type(None), Mapping, list, tuple)
_NUMBERS = (int, float, np.integer, np.floating, np.bool_)
_EXACT_FLOAT_INT = 2**53  # a larger int mixed with floats would be rounded in float64


def _number_list(values: Sequence[Any], what: str) -> np.ndarray | None:
    """A list of numbers (labels, scores) as one array, or None if ``values`` is not one:
    exact ints -> int64, floats (or ints mixed with floats) -> float64, bools -> bool.
    Refused rather than changed: bools mixed with numbers, ints beyond int64, and ints that
    float64 would round."""
    packed = pack_numbers(values)  # the exact-type C pass: most label lists end here
    if packed is not None:
        return packed
    if not values or not all(isinstance(v, _NUMBERS) for v in values):
        return None
    bools = sum(isinstance(v, (bool, np.bool_)) for v in values)
    if bools not in (0, len(values)):
        raise UnsupportedDataError(
            f"{what} mixes bools with numbers: convert it first (np.asarray(values, dtype=...))"
        )
    try:
        array = np.asarray(values)
    except OverflowError:
        array = np.empty(0, dtype=object)
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise UnsupportedDataError(
            f"{what} holds ints beyond int64: convert it first (e.g. to str, or np.asarray with a dtype)"
        )
    if array.dtype.kind == "f" and any(
        type(v) is int and abs(v) > _EXACT_FLOAT_INT for v in values
    ):
        raise UnsupportedDataError(
            f"{what} mixes floats with ints beyond 2**53, which float64 would round: convert it first"
        )
    return array


def encode_mapping(mapping: Mapping[Any, Any], what: str, allow_nan: bool = False) -> Encoded:
    keys = list(mapping.keys())
    for key in keys:
        if not isinstance(key, str):
            raise UnsupportedDataError(
                f"{what} has key {key!r} of type {type(key).__name__}; keys must be str"
            )
    values = [mapping[k] for k in keys]
    form = _value_form(values)
    files = encode_strings(keys, f"{what} keys", prefix="keys.")
    meta: dict[str, Any] = {"values": form, "length": len(keys), "dtype": f"str -> {form}"}
    labels = [f"{what}[{k!r}]" for k in keys]
    if form == "strings":
        files |= encode_strings(values, what, prefix="values.")
    elif form == "records":
        files |= encode_records(values, what, prefix="values.", allow_nan=allow_nan)
    elif form == "ragged":
        ragged, extra = encode_ragged(values, what, prefix="values.")
        files |= ragged
        meta |= extra | {"dtype": f"str -> {extra['dtype']}"}
    else:
        rows = np.asarray(values) if values else np.empty(0, dtype=np.float64)
        check_storable_dtype(rows.dtype, labels[0] if labels else what)
        files["values.rows"] = rows
        meta |= {"dtype": f"str -> {rows.dtype}", "item_shape": list(rows.shape[1:])}
    return "mapping", files, meta


def encode_any(obj: Any, what: str) -> Encoded:
    """Pick the kind for a usual Dataset container (see ``shmcache.share``)."""
    if isinstance(obj, np.ndarray):
        check_storable_dtype(obj.dtype, what)
        return "array", {"data": obj}, {}
    if isinstance(obj, Mapping):
        return encode_mapping(obj, what)
    if isinstance(obj, (list, tuple)):
        if all(isinstance(x, str) for x in obj):
            return "strings", encode_strings(obj, what), {"length": len(obj)}
        numbers = _number_list(obj, what)
        if numbers is not None:
            return "array", {"data": numbers}, {}
        if obj and all(isinstance(x, np.ndarray) for x in obj):
            files, meta = encode_ragged(obj, what)
            return "ragged", files, meta | {"length": len(obj)}
        if obj and type(obj[0]) is dict:
            try:  # dicts with one schema of plain values: a table (columns, not JSON)
                files, meta = encode_table_records(obj, what, strict=True)
                return "table", files, meta
            except NotTabular:
                pass
        if all(isinstance(x, (Mapping, list, tuple)) for x in obj):
            return "records", encode_records(obj, what), {"length": len(obj)}
        kinds = sorted({type(x).__name__ for x in obj})
        raise UnsupportedDataError(
            f"{what} is a list of {', '.join(kinds)}: shmcache.share takes a list of numbers, of "
            "str, of equal-dtype arrays, or of dicts/lists (or convert it with np.asarray)"
        )
    raise UnsupportedDataError(
        f"{what} is a {type(obj).__name__}; shmcache.share takes an ndarray, a list of str, "
        "of arrays or of dicts, or a dict of arrays, str or dicts"
    )


def content_digest(kind: str, files: Mapping[str, np.ndarray], algorithm: str | None = None) -> str:
    """A hash of an entry's content, so ``share`` can reuse an identical entry.

    XXH3-128 (xxhash): ~20 GB/s, against SHA-256's 0.2 GB/s on a CPU without SHA
    extensions, where it was a quarter of ``share()``'s time for 1M annotation dicts. A
    non-cryptographic hash is enough here: it tells one's own re-share from other
    content, and whoever can write into the root can replace entries anyway. Without
    xxhash, SHA-256. The prefix names the algorithm; ``algorithm`` asks for one
    (``"xxh3_128"``, ``"sha256"``, or ``""``: the unprefixed SHA-256 that entries shared
    before digests named their algorithm recorded), to compare with such an entry
    (:func:`same_content`). ``ImportError`` if it asks for XXH3 without xxhash.
    """
    digest: Any
    if algorithm is None:
        try:
            from xxhash import xxh3_128  # deferred: only share() needs it (import time)
        except ImportError:
            algorithm = "sha256"
        else:
            algorithm = "xxh3_128"
    if algorithm == "xxh3_128":
        from xxhash import xxh3_128

        digest = xxh3_128()
    else:
        import hashlib

        digest = hashlib.sha256()
    digest.update(kind.encode())
    for name in sorted(files):
        array = np.ascontiguousarray(files[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        if array.size and array.dtype.itemsize:
            digest.update(array.reshape(-1).view(np.uint8).data)
    return (f"{algorithm}:" if algorithm else "") + str(digest.hexdigest())[:32]


_DIGESTS = ("xxh3_128", "sha256", "")


def same_content(recorded: str | None, kind: str, files: Mapping[str, np.ndarray], digest: str) -> bool:
    """Whether an entry whose metadata records ``recorded`` holds this content (``digest``
    is :func:`content_digest`'s). An entry hashed another way (before an upgrade, or by a
    process without xxhash) is compared by hashing this content that way, once: a re-share
    after an upgrade is reused, not refused."""
    if recorded is None or recorded == digest:
        return recorded is not None
    algorithm, colon, _ = recorded.partition(":")
    algorithm = algorithm if colon else ""
    if algorithm not in _DIGESTS or algorithm == digest.partition(":")[0]:
        return False
    try:
        return content_digest(kind, files, algorithm) == recorded
    except ImportError:  # recorded with XXH3, and this process has no xxhash
        return False
