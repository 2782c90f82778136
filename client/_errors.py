"""Turning the daemon's error bodies back into the exceptions the core raises.

The daemon answers every error with ``{"error": <exception class name>, "detail": msg}``.
Names of core errors (:mod:`shmcache.errors`) come back as those very classes; the
daemon's own errors (jobs, ``--allow-source``, malformed requests) as the classes below,
which derive from the same bases; anything else as :class:`~shmcache.ShmCacheError`.
"""

from __future__ import annotations

from shmcache import errors
from shmcache.errors import InvalidSourceError, ShmCacheError

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


class JobNotFoundError(ShmCacheError, LookupError):
    """No load job with that id (the daemon keeps the last 1000 finished jobs)."""


class JobConflictError(ShmCacheError):
    """Another load of the same key, from a different source, is queued or running."""


class JobFinishedError(ShmCacheError):
    """The job already finished; there is nothing to cancel."""


class JobCancelledError(ShmCacheError):
    """The load was cancelled (on request, or because the daemon stopped); nothing was published."""


class SourceNotAllowedError(InvalidSourceError, PermissionError):
    """The source is outside the directories the daemon was told to load from (``--allow-source``)."""


class InvalidRequestError(ShmCacheError, ValueError):
    """The daemon could not parse the request (a client bug, or a daemon of another version)."""


_LOCAL: tuple[type[ShmCacheError], ...] = (
    InvalidRequestError,
    JobCancelledError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    SourceNotAllowedError,
)

ERROR_TYPES: dict[str, type[ShmCacheError]] = {
    **{
        name: cls
        for name in errors.__all__
        if isinstance(cls := getattr(errors, name), type) and issubclass(cls, ShmCacheError)
    },
    **{cls.__name__: cls for cls in _LOCAL},
}
"""Exception class name (as the daemon sends it) -> the class the client raises."""


def error_from_body(error_type: str | None, detail: str, status: int | None = None) -> ShmCacheError:
    """The exception for an error body (or a failed job's ``error``)."""
    cls = ERROR_TYPES.get(error_type or "")
    if cls is not None:
        return cls(detail)
    where = f"HTTP {status}" if status is not None else "daemon"
    return ShmCacheError(f"{error_type or 'error'} ({where}): {detail}")
