"""The store: a thin facade (``store``) over reading, writing, space and maintenance of
one cache root, writing what ``_sources`` plans. Imports ``_disk``, ``_containers`` and
``_sources``, never upwards."""

from .records import EntryInfo, PlannedEntry, StoreStats
from .store import Store

__all__ = ["EntryInfo", "PlannedEntry", "Store", "StoreStats"]
