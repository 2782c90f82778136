"""``open_group``: every entry under a key prefix as one lazy read-only Mapping.

This is what ``put_file`` of a directory produces (``feats/<relative path>``); the
group lists names on demand and opens each entry only when it is looked up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._keys import decode_key, encode_key
from .errors import InvalidKeyError, KeyNotFoundError

if TYPE_CHECKING:
    from ._store import Store

__all__ = ["SharedGroup"]


def _reopen_group(root: str, prefix: str) -> SharedGroup:
    from ._api import get_store

    return get_store(root).open_group(prefix)


class SharedGroup(Mapping[str, Any]):
    """Entries under ``prefix``, by name relative to it (``"x"`` for ``"prefix/x"``).

    Values are arrays (or the container of their kind). Pickles as ``(root, prefix)``.
    """

    __slots__ = ("_prefix", "_store")

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def _names(self) -> list[str]:
        start = encode_key(self._prefix) + "~"
        try:
            listed = os.listdir(self._store.layout.entries)
        except FileNotFoundError:
            return []
        return sorted(decode_key(name[len(start) :]) for name in listed if name.startswith(start))

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
        return _reopen_group, (str(self._store.root), self._prefix)

    def __repr__(self) -> str:
        return f"<SharedGroup {self._prefix!r} in {self._store.root}>"
