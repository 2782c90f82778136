"""What every command shares: the ``--debug`` switch, failing with a one-line message and
exit status 1, and plain tables.

The bottom of the CLI: command modules import it, and :mod:`.app` re-exports
:func:`fail` and :func:`debug_enabled`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import typer

from ..errors import ShmCacheError

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "debug_enabled", "fail", "failures_exit_1", "print_table", "set_debug", "warn_or_raise"]

EXIT_OK = 0
EXIT_FAILED = 1
"""The operation failed (one line on stderr says why)."""
EXIT_USAGE = 2
"""Bad flags or arguments (Typer's own)."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl+C), and nothing was published by the interrupted operation."""

_state = {"debug": False}


def set_debug(enabled: bool) -> None:
    """``--debug``: errors propagate with their traceback instead of a one-line message."""
    _state["debug"] = enabled


def debug_enabled() -> bool:
    return _state["debug"]


def fail(exc: BaseException) -> typer.Exit:
    """Print ``error: <exc>`` and return the exit (status 1) to raise; with ``--debug``,
    raise ``exc`` itself instead."""
    if debug_enabled():
        raise exc
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def warn_or_raise(exc: BaseException, message: str | None = None) -> None:
    """Print ``error: <message or exc>`` and carry on (the command exits 1 later); with
    ``--debug``, raise ``exc``."""
    if debug_enabled():
        raise exc
    typer.echo(f"error: {message if message is not None else exc}", err=True)


@contextmanager
def failures_exit_1() -> Iterator[None]:
    """Turn an operation's error into a one-line message and exit status 1."""
    try:
        yield
    except (ShmCacheError, OSError) as exc:
        raise fail(exc) from None


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    for line in (tuple(header), *rows):
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip())
