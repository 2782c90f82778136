"""Turning the daemon's error bodies back into the exceptions the core raises.

The daemon answers every error with ``{"error": <exception class name>, "detail": msg}``.
Every name in :mod:`shmcache.errors` (core and control-plane errors alike: the daemon
raises those very classes) comes back as that class; anything else as
:class:`~shmcache.ShmCacheError`. The fix a message suggests comes back in Python words
(``overwrite=True``, not ``"overwrite": true``: :mod:`shmcache._error_table`). The job
and source errors are re-exported here.
"""

from __future__ import annotations

from shmcache import errors
from shmcache._error_table import PYTHON, reword
from shmcache.errors import (
    InvalidRequestError,
    JobCancelledError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    ShmCacheError,
    SourceNotAllowedError,
)

__all__ = [
    "ERROR_TYPES",
    "InvalidRequestError",
    "JobCancelledError",
    "JobConflictError",
    "JobFinishedError",
    "JobNotFoundError",
    "SourceNotAllowedError",
    "error_from_body",
]


ERROR_TYPES: dict[str, type[ShmCacheError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, ShmCacheError)
}
"""Exception class name (as the daemon sends it) -> the class the client raises."""


def error_from_body(error_type: str | None, detail: str, status: int | None = None) -> ShmCacheError:
    """The exception for an error body (or a failed job's ``error``)."""
    detail = reword(detail, PYTHON)  # the daemon names fixes in HTTP words: Python callers get theirs
    cls = ERROR_TYPES.get(error_type or "")
    if cls is not None:
        return cls(detail)
    where = f"HTTP {status}" if status is not None else "daemon"
    return ShmCacheError(f"{error_type or 'error'} ({where}): {detail}")
