"""What every command shares: the ``--debug`` switch, failing with a one-line message (the
fix it suggests in flags) and the exit status of the one error table
(:mod:`shmcache._error_table`, whose exit statuses are re-exported here), and plain tables.

The bottom of the CLI: command modules import it, and :mod:`.app` re-exports
:func:`fail` and :func:`debug_enabled`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import typer

from .._error_table import CLI, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, exit_status, reword
from .._team.commands import for_team
from ..errors import ShmCacheError

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "ROOT_AND_TEAM",
    "debug_enabled",
    "fail",
    "failures_exit_1",
    "forget_root_source",
    "global_root",
    "note_root_source",
    "note_team_root",
    "print_table",
    "root_given",
    "set_debug",
    "set_team",
    "team_option",
    "usage_error",
    "warn_or_raise",
]

_state = {"debug": False, "root_given": False}
_team: list[str | None] = [None]
_global_root: list[Path | None] = [None]
_worked_on: list[str | None] = [None]


def set_team(team: str | None) -> None:
    """``shmcache --team NAME``: every command works on that team's root. (``$SHMCACHE_TEAM``
    is not passed here: the core reads it where no root is given, as for library calls.)
    Beside a root on the command line: a usage error."""
    if team is not None and _state["root_given"]:
        raise usage_error(ROOT_AND_TEAM)
    _team[0] = team


def forget_root_source(root: Path | None = None) -> None:
    """At the start of each command line (the app's callback, before any command's
    ``--root``): ``root`` is the global ``shmcache --root R COMMAND``, None without one."""
    _state["root_given"] = root is not None
    _global_root[0] = root
    _worked_on[0] = None


def note_team_root(team: str) -> None:
    """The command works on ``team``'s root: its errors' suggested commands get ``--team``."""
    _worked_on[0] = team


ROOT_AND_TEAM = (
    "pass --root or --team, not both: a team's root comes from the administrator's teams file "
    "(shmcache --team NAME COMMAND works on it)"
)


def usage_error(message: str) -> typer.Exit:
    """Print ``error: message`` and return the exit to raise: status 2, a usage error."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def note_root_source(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """``--root``'s callback: note whether the root is on the command line (not from
    ``$SHMCACHE_ROOT``): an explicit root wins over ``$SHMCACHE_TEAM``, as ``root=`` does,
    and is a usage error beside ``shmcache --team``."""
    source = ctx.get_parameter_source(param.name or "root")  # typer bundles its own click: by name
    if source is not None and source.name == "COMMANDLINE":
        if _team[0] is not None:
            raise usage_error(ROOT_AND_TEAM)
        _state["root_given"] = True
        return value
    return value if _global_root[0] is None else _global_root[0]  # `shmcache --root R`: over the env


def global_root() -> Path | None:
    """``shmcache --root R COMMAND``'s R (a command's own ``--root`` wins over it)."""
    return _global_root[0]


def root_given() -> bool:
    """Whether this command's ``--root`` (or its group's) was on the command line."""
    return _state["root_given"]


def team_option() -> str | None:
    return _team[0]


def set_debug(enabled: bool) -> None:
    """``--debug``: errors propagate with their traceback instead of a one-line message."""
    _state["debug"] = enabled


def debug_enabled() -> bool:
    return _state["debug"]


def fail(exc: BaseException) -> typer.Exit:
    """Print ``error: <exc>`` (its fix in flags: ``--overwrite``) and return the exit to
    raise (the error table's status, 1); with ``--debug``, raise ``exc`` itself instead."""
    if debug_enabled():
        raise exc
    typer.echo(f"error: {_cli_words(str(exc))}", err=True)
    return typer.Exit(exit_status(exc))


def warn_or_raise(exc: BaseException, message: str | None = None) -> None:
    """Print ``error: <message or exc>`` (its fix in flags) and carry on (the command exits
    1 later); with ``--debug``, raise ``exc``."""
    if debug_enabled():
        raise exc
    typer.echo(f"error: {_cli_words(message if message is not None else str(exc))}", err=True)


def _cli_words(text: str) -> str:
    """A message's fixes in flags, naming the team (``--team``) where the command works on one."""
    return for_team(reword(text, CLI), _worked_on[0])


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
