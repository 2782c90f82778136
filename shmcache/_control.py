"""The control protocol: what both a local :class:`~shmcache.Store` and the daemon's
:class:`shmcache.client.Client` do, so the CLI (and any tool) picks a backend once.

Also the job records the daemon and the client share: the daemon renders them as JSON,
the client parses them back into the same classes.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from ._store.records import EntryInfo, StoreStats

__all__ = ["ACTIVE_STATES", "JOB_STATES", "CacheControl", "Job", "JobError", "JobState", "known_fields"]

JobState = Literal["queued", "running", "done", "failed", "cancelled"]
JOB_STATES: tuple[JobState, ...] = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATES: tuple[JobState, ...] = ("queued", "running")
"""Job states that are not final."""


@runtime_checkable
class CacheControl(Protocol):
    """Operations on a cache root, wherever they run (this process or the daemon)."""

    @property
    def root(self) -> Path: ...

    def list(self, prefix: str | None = None) -> builtins.list[EntryInfo]:
        """Entries that are ``prefix`` or lie under it, sorted by key."""
        ...

    def info(self, key: str) -> EntryInfo:
        """One entry (raises KeyNotFoundError)."""
        ...

    def evict(self, key: str) -> int:
        """Remove an entry; returns the bytes released."""
        ...

    def cleanup(self) -> int:
        """Remove what dead writers left behind; returns the bytes freed."""
        ...

    def stats(self) -> StoreStats:
        """Capacity, use, budget and entry count."""
        ...

    def mapped_by(self, key: str) -> builtins.list[int]:
        """PIDs of live processes that map the current version of ``key``."""
        ...

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
        as_: str = "auto",
        dtype: str | None = None,
    ) -> builtins.list[str]:
        """Publish a ``.npy``, ``.npz``, ``.safetensors``, ``.pt``/``.pth``, ``.h5``/``.hdf5`` or a
        directory of them (``as_="blobs"``: every file of a directory as one blobs entry);
        ``dtype``: a raw token file as one 1-D array. Returns the keys published."""
        ...


def known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The items of ``data`` that are fields of dataclass ``cls`` (a newer peer may send more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


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
    state: JobState
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
        values = known_fields(cls, data)
        values["keys"] = tuple(values.get("keys") or ())
        error = values.get("error")
        values["error"] = JobError(**known_fields(JobError, error)) if error else None
        return cls(**values)
