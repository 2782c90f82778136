"""The store: a thin facade (``store``) over reading, writing, space and maintenance of
one cache root, writing what ``_sources`` plans. Imports ``_disk``, ``_containers`` and
``_sources``, never upwards.

Names are bound on first use (PEP 562): importing ``_store.reading`` (the open path of a
fresh process) must not load the write side that ``store`` imports."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .records import EntryInfo, PlannedEntry, StoreStats
    from .store import Store

__all__ = ["EntryInfo", "PlannedEntry", "Store", "StoreStats"]

_HOMES = {"EntryInfo": ".records", "PlannedEntry": ".records", "StoreStats": ".records", "Store": ".store"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(home, __name__), name)
    globals()[name] = value
    return value
