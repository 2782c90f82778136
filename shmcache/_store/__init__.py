"""The store: a thin facade (``store``) over reading, writing, sources, space and
maintenance of one cache root. Imports ``_disk`` and ``_containers``, never upwards."""

from .records import EntryInfo, PlannedEntry, StoreStats
from .store import Store

__all__ = ["EntryInfo", "PlannedEntry", "Store", "StoreStats"]
