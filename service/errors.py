"""Errors of the daemon and how every error maps to an HTTP status.

Response bodies are ``{"error": <type>, "detail": <message>}`` where ``type`` is the
exception's class name (``KeyNotFoundError``...), so a client can re-raise the same
``shmcache`` exception. Bad input is never a 500, and no message or log line carries
a client's input whole: :func:`short` cuts it.
"""

from __future__ import annotations

from shmcache.errors import (
    CacheFullError,
    CacheRootError,
    CorruptEntryError,
    DaemonRunningError,
    InvalidKeyError,
    InvalidSourceError,
    JobCancelledError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    SourceNotAllowedError,
    UnsupportedDataError,
)

__all__ = [
    "DaemonRunningError",
    "JobCancelledError",
    "JobConflictError",
    "JobFinishedError",
    "JobNotFoundError",
    "SourceNotAllowedError",
    "short",
    "status_of",
]

_SHORT = 240


# Most specific first: the first matching class decides the status.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidKeyError, 422),
    (KeyNotFoundError, 404),
    (JobNotFoundError, 404),
    (KeyExistsError, 409),
    (JobConflictError, 409),
    (JobFinishedError, 409),
    (CacheFullError, 507),
    (UnsupportedDataError, 415),
    (InvalidSourceError, 400),  # SourceNotFound, CorruptSource, SourceNotAllowed
    (LockTimeoutError, 503),
    (CorruptEntryError, 500),
    (CacheRootError, 500),
)


def status_of(exc: BaseException) -> int:
    """The HTTP status for an exception raised while serving a request."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def short(text: str, limit: int = _SHORT) -> str:
    """``text`` if it is at most ``limit`` characters, else its start and end around the
    number of characters left out: a 300 MB path must not be echoed back or logged whole."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 2)
    head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
    return f"{head}...[{len(text) - len(head) - len(tail)} characters]...{tail}"
