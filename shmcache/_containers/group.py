"""``open_group``: every entry under a key prefix as one lazy read-only Mapping.

This is what ``put_file`` of a directory produces (``feats/<relative path>``); the
group binds names to versions when it is opened and opens each entry only when it is
looked up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .._disk.attach import attach_array
from .._disk.dtypes import for_numpy
from .._disk.layout import ARRAY_FILE, Layout, read_version
from .._disk.meta import read_meta
from ..errors import KeyNotFoundError
from .shared import open_version

__all__ = ["EntryOpener", "SharedGroup", "read_group"]


class EntryOpener(Protocol):
    """What a group needs from the store it reads (a ``Store``; it pickles by root)."""

    @property
    def layout(self) -> Layout: ...


class SharedGroup(Mapping[str, Any]):
    """Entries under ``prefix``, by name relative to it (``"x"`` for ``"prefix/x"``).

    A snapshot: the names and the version each one pointed at are read when the group is
    opened (``Store.open_group`` reads them under the root's publish lock, so a directory
    being republished is seen all old or all new, never mixed), and every lookup opens
    that version, whatever was published since. A version removed since (republished,
    then no longer mapped by anyone) raises :class:`KeyNotFoundError`: open the group
    again. Values are arrays (or the container of their kind), opened on first lookup and
    kept. Pickles as its store (a root), the prefix and the snapshot.
    """

    __slots__ = ("_opened", "_prefix", "_store", "_versions")

    def __init__(self, store: EntryOpener, prefix: str, versions: Mapping[str, str] | None = None) -> None:
        self._store = store
        self._prefix = prefix
        self._versions = dict(versions) if versions is not None else read_group(store.layout, prefix)
        self._opened: dict[str, Any] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._versions)

    def __len__(self) -> int:
        return len(self._versions)

    def __getitem__(self, name: str) -> Any:
        value = self._opened.get(name) if isinstance(name, str) else None
        if value is None:
            try:
                version = self._versions[name]
            except (KeyError, TypeError):
                raise KeyError(name) from None
            value = self._opened[name] = self._open(f"{self._prefix}/{name}", version)
        return value

    def _open(self, key: str, version: str) -> Any:
        root = str(self._store.layout.root)
        meta = read_meta(self._store.layout, version)
        try:
            if meta is not None and meta.kind == "array":
                return for_numpy(attach_array(root, version, ARRAY_FILE, key), key)
            if meta is not None:
                return open_version(root, key, version, meta.kind, meta)
        except (FileNotFoundError, KeyNotFoundError):
            pass
        raise KeyNotFoundError(
            f"entry {key!r} of group {self._prefix!r} (version {version}) was replaced or evicted "
            "since the group was opened; open the group again"
        )

    def __contains__(self, name: object) -> bool:
        return name in self._versions

    def __reduce__(self) -> tuple[Any, ...]:
        return SharedGroup, (self._store, self._prefix, self._versions)

    def __repr__(self) -> str:
        return f"<SharedGroup {self._prefix!r} in {self._store.layout.root}>"


def read_group(layout: Layout, prefix: str) -> dict[str, str]:
    """Name -> version of every entry under ``prefix``, sorted by name (the caller holds
    the publish lock shared when the set must be consistent)."""
    versions = {}
    for name, link in layout.links_under(prefix).items():
        version = read_version(link)
        if version is not None:
            versions[name] = version
    return versions
