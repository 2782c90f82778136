"""``open_group``: every entry under a key prefix as one lazy read-only Mapping.

This is what ``put_file`` of a directory produces (``feats/<relative path>``); the
group lists names on demand and opens each entry only when it is looked up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .._disk.layout import Layout
from ..errors import InvalidKeyError, KeyNotFoundError

__all__ = ["EntryOpener", "SharedGroup"]


class EntryOpener(Protocol):
    """What a group needs from the store it reads (a ``Store``; it pickles by root)."""

    @property
    def layout(self) -> Layout: ...

    def open(self, key: str) -> Any: ...

    def exists(self, key: str) -> bool: ...


class SharedGroup(Mapping[str, Any]):
    """Entries under ``prefix``, by name relative to it (``"x"`` for ``"prefix/x"``).

    Values are arrays (or the container of their kind). Pickles as its store (a root)
    and the prefix.
    """

    __slots__ = ("_prefix", "_store")

    def __init__(self, store: EntryOpener, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def _names(self) -> list[str]:
        return self._store.layout.names_under(self._prefix)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, name: str) -> Any:
        try:
            return self._store.open(f"{self._prefix}/{name}")
        except (KeyNotFoundError, InvalidKeyError):
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            return self._store.exists(f"{self._prefix}/{name}")
        except InvalidKeyError:
            return False

    def __reduce__(self) -> tuple[Any, ...]:
        return SharedGroup, (self._store, self._prefix)

    def __repr__(self) -> str:
        return f"<SharedGroup {self._prefix!r} in {self._store.layout.root}>"
