"""What the store reports: immutable records of entries, space and planned loads.

They are plain dataclasses so that the HTTP client can return the very same types
(``shmcache.client`` builds them from the daemon's JSON).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._disk.meta import EntryMeta
from .._sources.planned import PlannedEntry
from .._units import human_bytes

__all__ = ["EntryInfo", "PlannedEntry", "StoreStats", "entry_info"]


@dataclass(frozen=True)
class EntryInfo:
    """What ``Store.list`` reports about one entry."""

    key: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    """Bytes of data (what ``array.nbytes`` says)."""
    size: int
    """Bytes the entry occupies in the cache (data plus headers and metadata)."""
    created: float
    pinned: bool
    source: str | None
    version: str
    last_used: float
    source_fingerprint: dict[str, int] | None = None
    checksum: str | None = None
    owner_uid: int | None = None
    """The uid of the user who loaded it (None: loaded before owners were recorded)."""


@dataclass(frozen=True)
class StoreStats:
    """Space and entry counts of a cache root."""

    root: str
    capacity: int
    """Size of the file system holding the root (the tmpfs)."""
    used: int
    """Bytes held by published entries, and by directory puts' manifests beyond them
    (``packed_held``)."""
    free: int
    """Bytes still free on that file system."""
    budget: int | None
    """The budget in force: the root's (``shmcache budget``), or the store's lower
    ``max_bytes``; None for no budget."""
    entries: int
    packed_held: int = 0
    """Of ``used``: bytes the manifests of directory puts hold beyond their linked packed
    entries, mostly evicted packed entries (evicting one frees nothing; its batch's pages
    return when the rest of that directory put is evicted, or it is put again)."""
    partial_bytes: int = 0
    """Bytes in the root's ``tmp/``, not in ``used``: writes in progress, and partial writes
    of writers that died (``cleanup`` frees those; a put short of room removes them first)."""

    @property
    def over_budget(self) -> bool:
        """Whether the entries use more than the budget (it was lowered below them, or set
        while they were there): the next put evicts to fit, ``shmcache doctor`` fails."""
        return self.budget is not None and self.used > self.budget

    @property
    def budget_warning(self) -> str | None:
        """Why the budget cannot work as set, or None: a budget above the file system's
        size never evicts anything, because the tmpfs fills (and puts fail) first."""
        if self.budget is None or self.capacity <= 0 or self.budget <= self.capacity:
            return None
        return (
            f"the budget ({human_bytes(self.budget)}) is larger than the file system holding "
            f"{self.root} ({human_bytes(self.capacity)}): it fills up and puts fail with CacheFullError "
            "before the budget evicts anything; lower it below the size (shmcache budget set SIZE, or "
            "--max-bytes), or enlarge the tmpfs "
            "(mount -o remount,size=...; Docker: --shm-size)"
        )


def entry_info(meta: EntryMeta, last_used: float) -> EntryInfo:
    """The record of a version from its ``meta.json`` (which must record its key and version)."""
    if meta.key is None or meta.version is None:
        raise KeyError("key" if meta.key is None else "version")
    return EntryInfo(
        key=meta.key,
        kind=meta.kind,
        dtype=meta.dtype,
        shape=meta.shape,
        nbytes=meta.nbytes,
        size=meta.size,
        created=float(meta.created),
        pinned=meta.pinned,
        source=meta.source,
        version=meta.version,
        last_used=last_used,
        source_fingerprint=meta.source_fingerprint,
        checksum=meta.checksum,
        owner_uid=meta.owner_uid,
    )

