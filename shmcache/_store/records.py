"""What the store reports: immutable records of entries, space and planned loads.

They are plain dataclasses so that the HTTP client can return the very same types
(``shmcache.client`` builds them from the daemon's JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """Bytes held by published entries."""
    free: int
    """Bytes still free on that file system."""
    budget: int | None
    """The budget in force: the root's (``shmcache budget``), or the store's lower
    ``max_bytes``; None for no budget."""
    entries: int

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


@dataclass(frozen=True)
class PlannedEntry:
    """One entry ``put_file`` would publish (see ``Store.plan_file``)."""

    key: str
    source: str
    """The file, or ``archive.npz[member.npy]``."""
    file: str
    """The file on disk the bytes come from."""
    size: int
    """Bytes the entry's data file will take."""


def entry_info(meta: dict[str, Any], last_used: float) -> EntryInfo:
    """The record of a version from its ``meta.json``."""
    shape = meta.get("shape")
    return EntryInfo(
        key=meta["key"],
        kind=meta.get("kind", "array"),
        dtype=meta.get("dtype"),
        shape=tuple(shape) if shape is not None else None,
        nbytes=int(meta.get("nbytes", 0)),
        size=int(meta.get("size", 0)),
        created=float(meta.get("created", 0.0)),
        pinned=bool(meta.get("pinned", False)),
        source=meta.get("source"),
        version=meta["version"],
        last_used=last_used,
        source_fingerprint=meta.get("source_fingerprint"),
        checksum=meta.get("checksum"),
        owner_uid=_uid(meta.get("owner_uid")),
    )


def _uid(value: Any) -> int | None:
    """A recorded owner's uid (None where none, or no number, is recorded)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
