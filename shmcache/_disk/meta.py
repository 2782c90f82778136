"""``meta.json``: the metadata file beside each version's ``.npy`` files; for an entry of a
directory put (version ``<batch>/<n>``), its object in the batch's ``manifest``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import CorruptEntryError
from .layout import MANIFEST_FILE, META_FILE, Layout
from .manifest import read_manifest_entry

__all__ = ["META_FORMAT", "EntryMeta", "damaged", "read_entry_meta", "read_meta"]

META_FORMAT = 1


@dataclass(frozen=True)
class EntryMeta:
    """One version's ``meta.json``, typed: every key the package reads, with the default an
    older entry that lacks it is read with. ``raw`` is the object as read, every key kept
    (a container's own keys, such as a table's ``columns``, and keys this version does not
    know: older and newer roots stay readable); :meth:`to_json` gives it back."""

    key: str | None = None
    """None in entries written before the key was recorded: taken as the link's key."""
    version: str | None = None
    kind: str = "array"
    files: tuple[str, ...] | None = None
    """The ``.npy`` files (names without suffix); None: an array's ``data`` alone."""
    nbytes: int = 0
    size: int = 0
    created: float = 0.0
    pinned: bool = False
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    fortran_order: bool | None = None
    length: int | None = None
    source: str | None = None
    source_fingerprint: dict[str, int] | None = None
    source_identity: str | None = None
    checksum: str | None = None
    cache_version: str | None = None
    content_hash: str | None = None
    owner_uid: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EntryMeta:
        """The record of a ``meta.json`` object; ``ValueError`` naming the first key whose
        value has the wrong type."""
        values: dict[str, Any] = {}
        for name, value in raw.items():  # the keys it has (a dozen), not every field
            if value is None:
                continue  # null: the field's default
            simple = _SIMPLE.get(name)
            if simple is not None:
                if type(value) is not simple and not (name == "created" and type(value) is int):
                    raise ValueError(f"records {name} = {value!r:.80}, not {_WANTED[name]}")
            elif name in _CHECKS:
                if not _CHECKS[name](value):
                    raise ValueError(f"records {name} = {value!r:.80}, not {_WANTED[name]}")
                if name in ("files", "shape"):
                    value = tuple(value)
            else:
                continue  # a key of another version: kept in raw only
            values[name] = value
        record = object.__new__(cls)  # what the frozen __init__ does, field by field, 4x slower
        record.__dict__.update(_DEFAULTS, **values, raw=raw)
        return record

    def to_json(self) -> dict[str, Any]:
        """The JSON object this record was read from, every key kept."""
        return dict(self.raw)

    def records(self, name: str) -> bool:
        """Whether ``meta.json`` records ``name`` at all (older entries lack some keys)."""
        return name in self.raw


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all(kind: Any, value: Any) -> bool:
    return isinstance(value, list) and all(kind(item) for item in value)


def _str(value: Any) -> bool:
    return isinstance(value, str)


_CHECKS: dict[str, Any] = {
    "key": _str,
    "version": _str,
    "kind": _str,
    "files": lambda v: _all(_str, v),
    "nbytes": _int,
    "size": _int,
    "created": lambda v: _int(v) or isinstance(v, float),
    "pinned": lambda v: isinstance(v, bool),
    "dtype": _str,
    "shape": lambda v: _all(_int, v),
    "fortran_order": lambda v: isinstance(v, bool),
    "length": _int,
    "source": _str,
    "source_fingerprint": lambda v: isinstance(v, dict) and all(_int(n) for n in v.values()),
    "source_identity": _str,
    "checksum": _str,
    "cache_version": _str,
    "content_hash": _str,
    "owner_uid": _int,
}
_SIMPLE: dict[str, type] = {
    name: kind
    for name, kind in {
        "key": str, "version": str, "kind": str, "nbytes": int, "size": int, "created": float,
        "pinned": bool, "dtype": str, "fortran_order": bool, "length": int, "source": str,
        "source_identity": str, "checksum": str, "cache_version": str, "content_hash": str,
        "owner_uid": int,
    }.items()
}
"""The fields whose JSON value has one exact type (``created``: a float, or an int), checked
with one ``type() is`` (json gives exactly these types; ``bool`` is never an ``int`` here)."""
_WANTED = {
    "files": "a list of names",
    "shape": "a list of integers",
    "source_fingerprint": "an object of integers",
    "created": "a number",
    "pinned": "true or false",
    "fortran_order": "true or false",
} | {name: "an integer" for name in ("nbytes", "size", "length", "owner_uid")}
_WANTED = {name: _WANTED.get(name, "text") for name in _CHECKS}
assert set(_CHECKS) == {f.name for f in fields(EntryMeta)} - {"raw"}
_DEFAULTS = {f.name: f.default for f in fields(EntryMeta) if f.name != "raw"}


def read_meta(layout: Layout, version: str) -> EntryMeta | None:
    """The metadata of a published version, or None if it is gone (or unreadable)."""
    try:
        if "/" in version:  # an entry of a directory put: its object in the batch's manifest
            meta = read_manifest_entry(str(layout.root), version)
            if meta is None or not _entry_present(layout, version):
                return None  # evicted (its directory goes, the manifest stays while others live)
        else:
            with open(layout.object_file(version, META_FILE), "rb") as fp:
                meta = json.load(fp)
        return EntryMeta.from_json(meta) if isinstance(meta, dict) else None
    except (FileNotFoundError, NotADirectoryError, ValueError):  # JSON and UTF-8 errors are ValueErrors
        return None


def _entry_present(layout: Layout, version: str) -> bool:
    """Whether an entry of a directory put, whose manifest object was read, is still there:
    its directory, or for a packed one (``<batch>/<n>.<offset>.<length>``) its live byte,
    which the manifest's reader checked already."""
    return "." in version.partition("/")[2] or os.path.isdir(layout.version_dir(version))


def damaged(key: str, what: str) -> CorruptEntryError:
    """The error every read and ``verify`` of a damaged entry raises: what is wrong, and the fix."""
    return CorruptEntryError(
        f"entry {key!r} is damaged: {what.rstrip('.')}. `shmcache verify` checks every entry; "
        f"`shmcache evict {key}` removes this one: put it again after"
    )


def read_entry_meta(layout: Layout, key: str, version: str) -> EntryMeta | None:
    """The metadata of ``version``, which ``key``'s entry link pointed at; None if the
    link moved meanwhile (replaced or evicted: resolve again). Raises :func:`damaged` if the
    link still points there and the version or its ``meta.json`` is missing, not a JSON object, or records
    another key (a link pointed at another entry's data). Metadata without a key (older
    entries) is taken as the key's."""
    if "/" in version:
        return _read_batch_entry_meta(layout, key, version)
    try:
        with open(layout.object_file(version, META_FILE), "rb") as fp:
            raw = fp.read()
    except (FileNotFoundError, NotADirectoryError):
        if layout.entry_version(key) != version:
            return None  # evicted or replaced: both move the link before removing files
        if not os.path.isdir(layout.version_dir(version)):
            raise damaged(
                key,
                f"its data {layout.version_dir(version)} vanished "
                "(`shmcache cleanup` removes entries whose data vanished)",
            ) from None
        raise damaged(key, f"its {META_FILE} is missing from {layout.version_dir(version)}") from None
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        if layout.entry_version(key) != version:
            return None
        raise damaged(key, f"its {META_FILE} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise damaged(key, f"its {META_FILE} holds a {type(meta).__name__}, not an object")
    return _key_record(key, meta, f"its {META_FILE}")


def _read_batch_entry_meta(layout: Layout, key: str, version: str) -> EntryMeta | None:
    """:func:`read_entry_meta` of an entry inside a directory put's version (``manifest``)."""
    batch = version.partition("/")[0]
    try:
        meta = read_manifest_entry(str(layout.root), version)
    except ValueError as exc:
        if layout.entry_version(key) != version:
            return None
        raise damaged(key, f"its {MANIFEST_FILE} in {layout.version_dir(batch)} is damaged ({exc})") from None
    if meta is None or not _entry_present(layout, version):
        if layout.entry_version(key) != version:
            return None  # evicted or replaced: both move the link before removing files
        if meta is None:
            raise damaged(
                key,
                f"the {MANIFEST_FILE} of its directory put is missing from {layout.version_dir(batch)} "
                "(`shmcache cleanup` removes entries whose data vanished)",
            )
        raise damaged(
            key,
            f"its data {layout.version_dir(version)} vanished "
            "(`shmcache cleanup` removes entries whose data vanished)",
        )
    return _key_record(key, meta, f"its object in the {MANIFEST_FILE}")


def _key_record(key: str, meta: dict[str, Any], where: str) -> EntryMeta:
    """``meta`` (from ``where``) as ``key``'s record: damaged if it is malformed or records
    another key (a link that points at another entry's data)."""
    try:
        entry = EntryMeta.from_json(meta)
    except ValueError as exc:
        raise damaged(key, f"{where} {exc}") from None
    if entry.key is not None and entry.key != key:
        raise damaged(key, f"its link points at the data of entry {entry.key!r}")
    return entry
