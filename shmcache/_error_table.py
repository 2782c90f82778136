"""One table for every error: its HTTP status, its CLI exit status, and the words each
caller uses for the fix a message suggests.

A message names the fix the way its reader would type it: ``overwrite=True`` to Python
callers (``Store``, ``Client``), ``--overwrite`` to the CLI, ``"overwrite": true`` to raw
HTTP callers. The daemon writes its messages with the HTTP words (:func:`fix`); the client
turns them into Python words and the CLI into flags (:func:`reword`), from the same
:data:`FIXES`, so a message is reworded exactly or not at all. Plain data: the service,
the client and the CLI read it; nothing here imports them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

from .errors import (
    CacheFullError,
    CacheRootError,
    CorruptEntryError,
    DaemonBusyError,
    InvalidKeyError,
    InvalidRequestError,
    InvalidSourceError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    NotPermittedError,
    QuotaExceededError,
    ShmCacheError,
    TeamConfigError,
    TooManyOpenFilesError,
    UnauthorizedError,
    UnknownTeamError,
    UnsupportedDataError,
)

__all__ = [
    "CLI",
    "ERRORS",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "FIXES",
    "HTTP",
    "PYTHON",
    "Caller",
    "ErrorRow",
    "exit_status",
    "fix",
    "http_status",
    "reword",
]

Caller = Literal["python", "cli", "http"]
PYTHON: Caller = "python"
CLI: Caller = "cli"
HTTP: Caller = "http"

EXIT_OK = 0
EXIT_FAILED = 1
"""The operation failed: one line on stderr says why (every error below)."""
EXIT_USAGE = 2
"""Bad flags or arguments (Typer's own), or settings ``serve`` refuses."""
EXIT_INTERRUPTED = 130
"""Ctrl+C, and the interrupted operation published nothing."""


@dataclass(frozen=True)
class ErrorRow:
    """How one error type reaches each caller."""

    error: type[ShmCacheError]
    http_status: int
    """The status of the daemon's ``{"error", "detail"}`` answer."""
    exit_status: int = EXIT_FAILED
    """The CLI's exit status."""


ERRORS: tuple[ErrorRow, ...] = (  # most specific first: the first matching row decides
    ErrorRow(InvalidKeyError, 422),
    ErrorRow(InvalidRequestError, 422),
    ErrorRow(KeyNotFoundError, 404),
    ErrorRow(JobNotFoundError, 404),
    ErrorRow(KeyExistsError, 409),
    ErrorRow(JobConflictError, 409),
    ErrorRow(JobFinishedError, 409),
    ErrorRow(CorruptEntryError, 409),  # the entry's state, not the daemon: evict it, load it again
    ErrorRow(UnauthorizedError, 401),
    ErrorRow(NotPermittedError, 403),
    ErrorRow(QuotaExceededError, 507),
    ErrorRow(CacheFullError, 507),
    ErrorRow(UnsupportedDataError, 415),
    ErrorRow(InvalidSourceError, 400),  # SourceNotFound, CorruptSource, SourceNotAllowed
    ErrorRow(LockTimeoutError, 503),
    ErrorRow(DaemonBusyError, 503),
    ErrorRow(TooManyOpenFilesError, 503),  # the daemon's descriptors, not the request's fault
    ErrorRow(CacheRootError, 500),
    ErrorRow(UnknownTeamError, 404),
    ErrorRow(TeamConfigError, 500),  # the administrator's file, not the request
)
_OTHER = ErrorRow(ShmCacheError, 500)


def _row(exc: BaseException) -> ErrorRow:
    return next((row for row in ERRORS if isinstance(exc, row.error)), _OTHER)


def http_status(exc: BaseException) -> int:
    """The HTTP status the daemon answers ``exc`` with (500 for what the table lacks)."""
    return _row(exc).http_status


def exit_status(exc: BaseException) -> int:
    """The CLI's exit status for ``exc``."""
    return _row(exc).exit_status


FIXES: dict[str, dict[Caller, str]] = {
    "overwrite": {
        PYTHON: "overwrite=True",
        CLI: "--overwrite",
        HTTP: '"overwrite": true',
    },
    "evict": {
        PYTHON: "client.evict('{key}')",
        CLI: "`shmcache evict {key}`",
        HTTP: "DELETE /v1/entries/{key}",
    },
    "cancel": {
        PYTHON: "client.cancel('{job}')",
        CLI: "Ctrl+C in the `shmcache put` that started it",
        HTTP: "DELETE /v1/jobs/{job}",
    },
}
"""Each fix a message may suggest, as each caller writes it (the Python words are for
``shmcache.client.Client``, the one Python caller of the daemon); ``{key}`` and ``{job}``
are filled in by :func:`fix` and carried over by :func:`reword`."""

_ALIASES: dict[str, tuple[str, ...]] = {
    "overwrite": ("overwrite=True (--overwrite)",),  # the core's wording for Python and CLI alike
}
"""Older wordings of a fix, reworded too (longest first)."""

_FIELDS = {"key": r"[A-Za-z0-9._/-]+", "job": r"[A-Za-z0-9_-]+"}


def fix(name: str, caller: Caller, **fields: str) -> str:
    """The fix ``name`` in ``caller``'s words (``fix("evict", HTTP, key="a")`` is
    ``DELETE /v1/entries/a``)."""
    return FIXES[name][caller].format(**fields)


def reword(text: str, caller: Caller) -> str:
    """``text`` with every fix written for another caller written for ``caller`` instead."""
    for name in FIXES:
        text = _pattern(name, caller).sub(functools.partial(_render, name, caller), text)
    return text


@functools.cache
def _pattern(name: str, caller: Caller) -> re.Pattern[str]:
    forms = [*_ALIASES.get(name, ()), *(w for c, w in FIXES[name].items() if c != caller)]
    ordered = sorted(forms, key=len, reverse=True)  # an alias that contains a form comes first
    return re.compile("|".join(_template_regex(form, alt) for alt, form in enumerate(ordered)))


def _template_regex(template: str, alt: int) -> str:
    """A regex for ``template`` whose fields are named groups ``<field>__<alt>_<n>`` (unique
    across the alternatives of one pattern)."""
    parts = re.split(r"\{(\w+)\}", template)
    return "".join(
        f"(?P<{part}__{alt}_{index}>{_FIELDS[part]})" if index % 2 else re.escape(part)
        for index, part in enumerate(parts)
    )


def _render(name: str, caller: Caller, match: re.Match[str]) -> str:
    fields = {group.split("__")[0]: value for group, value in match.groupdict().items() if value}
    try:
        return fix(name, caller, **fields)
    except KeyError:  # the source's words lack a field the target's need: leave them
        return match.group(0)
