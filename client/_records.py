"""Typed, immutable records of what the daemon answers (built from its JSON bodies).

Entries and stats reuse the core's records (:class:`shmcache.EntryInfo`,
:class:`shmcache.StoreStats`), so code written against a local ``Store`` accepts the
client's answers too; jobs are the records the daemon itself renders
(:class:`shmcache._control.Job`, re-exported here). Unknown fields a newer daemon may
send are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmcache import EntryInfo, StoreStats
from shmcache._control import ACTIVE_STATES, Job, JobError, known_fields

__all__ = [
    "ACTIVE_STATES",
    "BudgetState",
    "EntryDetail",
    "Health",
    "Job",
    "JobError",
    "ServiceStats",
    "entry_from_json",
]


def entry_from_json(data: dict[str, Any]) -> EntryInfo:
    """An :class:`~shmcache.EntryInfo` from one element of ``GET /v1/entries``."""
    values = known_fields(EntryInfo, data)
    if values.get("shape") is not None:
        values["shape"] = tuple(values["shape"])
    return EntryInfo(**values)


@dataclass(frozen=True)
class EntryDetail(EntryInfo):
    """One entry (``GET /v1/entries/{key}``) plus the PIDs of live processes mapping it."""

    mapped_by: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryDetail:
        values = known_fields(cls, data)
        if values.get("shape") is not None:
            values["shape"] = tuple(values["shape"])
        values["mapped_by"] = tuple(values.get("mapped_by") or ())
        return cls(**values)


@dataclass(frozen=True)
class ServiceStats(StoreStats):
    """``GET /v1/stats``: the store's space and counts plus the daemon's own figures."""

    held_by_readers_bytes: int = 0
    """Bytes of evicted or replaced entries that live processes still map."""
    held_by_readers_unseen: int = 0
    """In a team's root: members' processes the daemon may not scan (not in the bytes)."""
    jobs_queued: int = 0
    jobs_running: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServiceStats:
        return cls(**known_fields(cls, data))


@dataclass(frozen=True)
class BudgetState:
    """``GET``/``PUT /v1/budget``: the root's budget (None: none), who set it and when, and
    what the root's entries use against it."""

    max_bytes: int | None
    set_by: str | None
    set_at: float | None
    used: int
    over_budget: bool

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BudgetState:
        return cls(**known_fields(cls, data))


@dataclass(frozen=True)
class Health:
    """``GET /v1/health``: the daemon answers; which version, pid and root."""

    status: str
    version: str
    pid: int
    root: str
    uptime_s: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Health:
        return cls(**known_fields(cls, data))
