"""Errors of the daemon and how every error maps to an HTTP status (read from the one
error table, :mod:`shmcache._error_table`, which the client and the CLI read too).

Response bodies are ``{"error": <type>, "detail": <message>}`` where ``type`` is the
exception's class name (``KeyNotFoundError``...), so a client can re-raise the same
``shmcache`` exception. Bad input is never a 500, and no message or log line carries
a client's input whole: :func:`short` cuts it.
"""

from __future__ import annotations

from shmcache._error_table import http_status
from shmcache.errors import (
    DaemonRunningError,
    JobCancelledError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    SourceNotAllowedError,
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


def status_of(exc: BaseException) -> int:
    """The HTTP status for an exception raised while serving a request (the one error
    table, :mod:`shmcache._error_table`, decides)."""
    return http_status(exc)


def short(text: str, limit: int = _SHORT) -> str:
    """``text`` if it is at most ``limit`` characters, else its start and end around the
    number of characters left out: a 300 MB path must not be echoed back or logged whole."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 2)
    head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
    return f"{head}...[{len(text) - len(head) - len(tail)} characters]...{tail}"
