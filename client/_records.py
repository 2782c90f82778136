"""Typed, immutable records of what the daemon answers (built from its JSON bodies).

Entries and stats reuse the core's records (:class:`shmcache.EntryInfo`,
:class:`shmcache.StoreStats`), so code written against a local ``Store`` accepts the
client's answers too. Unknown fields a newer daemon may send are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shmcache import EntryInfo, StoreStats

__all__ = ["ACTIVE_STATES", "EntryDetail", "Health", "Job", "JobError", "ServiceStats"]

ACTIVE_STATES = ("queued", "running")
"""Job states that are not final."""


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def entry_from_json(data: dict[str, Any]) -> EntryInfo:
    """An :class:`~shmcache.EntryInfo` from one element of ``GET /v1/entries``."""
    values = _known(EntryInfo, data)
    if values.get("shape") is not None:
        values["shape"] = tuple(values["shape"])
    return EntryInfo(**values)


@dataclass(frozen=True)
class EntryDetail(EntryInfo):
    """One entry (``GET /v1/entries/{key}``) plus the PIDs of live processes mapping it."""

    mapped_by: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryDetail:
        values = _known(cls, data)
        if values.get("shape") is not None:
            values["shape"] = tuple(values["shape"])
        values["mapped_by"] = tuple(values.get("mapped_by") or ())
        return cls(**values)


@dataclass(frozen=True)
class ServiceStats(StoreStats):
    """``GET /v1/stats``: the store's space and counts plus the daemon's own figures."""

    held_by_readers_bytes: int = 0
    """Bytes of evicted or replaced entries that live processes still map."""
    jobs_queued: int = 0
    jobs_running: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServiceStats:
        return cls(**_known(cls, data))


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
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class JobError:
    """Why a job failed: the exception's class name and its message."""

    type: str
    detail: str


@dataclass(frozen=True)
class Job:
    """A background load (``PUT /v1/entries/{key}``, ``GET /v1/jobs/{id}``) at one moment."""

    id: str
    key: str
    source: str
    pin: bool
    overwrite: bool
    state: str
    """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
    bytes_done: int
    bytes_total: int | None
    """Known once the load has started."""
    keys: tuple[str, ...]
    """Keys published (when done)."""
    error: JobError | None
    cancel_requested: bool
    created: float
    started: float | None
    finished: float | None

    @property
    def active(self) -> bool:
        """Queued or running: the state will still change."""
        return self.state in ACTIVE_STATES

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        values = _known(cls, data)
        values["keys"] = tuple(values.get("keys") or ())
        error = values.get("error")
        values["error"] = JobError(**_known(JobError, error)) if error else None
        return cls(**values)
