"""The ``shmcache`` command: put, list, inspect, evict and clean up a cache root; run the
daemon; diagnose memory.

Every command takes ``--root`` (default: ``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``),
after it or before it (``shmcache --root R ls``, as ``--team``).
Exit codes: 0 ok, 1 the operation failed (message, no traceback unless ``--debug``),
2 usage error, 130 interrupted.

The commands live in one module per group (:mod:`.entries`, :mod:`.demo`, :mod:`.serve`,
:mod:`.api_docs`, :mod:`.diagnose`, :mod:`.root`, :mod:`.budget`); this module builds the app from them and
re-exports the helpers they share (:func:`fail`, :func:`debug_enabled`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .._disk.layout import ENV_ROOT, ENV_TEAM, SHM_DIR
from . import api_docs, budget, demo, diagnose, entries, root, serve
from .common import debug_enabled, fail, forget_root_source, set_debug, set_team

__all__ = ["app", "debug_enabled", "fail", "main"]

def _flags_show_no_value() -> None:
    """Typer 0.29 shows each flag with a type, ``--json <bool>``, as if it took a value
    (``ls --json true`` then reads ``true`` as the prefix): a flag shows none, as in click."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # an older typer: it prints no type beside a flag
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_show_no_value()

app = typer.Typer(
    name="shmcache",
    help="Shared-memory dataset cache for PyTorch: load once into /dev/shm, open everywhere.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _options(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    team: Annotated[
        str | None,
        typer.Option(
            "--team",
            envvar=ENV_TEAM,
            show_default=False,
            help="Work on this team's root, as the administrator's teams file declares it "
            f"(shmcache --team vision ls); not with --root. ${ENV_TEAM} does the same for "
            "commands without --root.",
        ),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            "--root",
            show_default=False,
            readable=False,  # the core says why a root is unusable
            help=f"Cache root for the command (shmcache --root R ls, as shmcache ls --root R; the "
            f"command's own --root wins); default: ${ENV_ROOT} or {SHM_DIR}/shmcache-<uid>.",
        ),
    ] = None,
) -> None:
    set_debug(debug)
    forget_root_source(root)
    source = ctx.get_parameter_source("team")  # typer bundles its own click: compared by name
    from_env = source is not None and source.name == "ENVIRONMENT"
    set_team(None if from_env else team)  # the core reads the variable where no --root is given


entries.register(app)
demo.register(app)
serve.register(app)
budget.register(app)
api_docs.register(app)
diagnose.register(app)
root.register(app)


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:  # before a command took over (each says what it stopped)
        _interrupted_early()
    except SystemExit as exc:  # Typer turns a Ctrl+C while it parses the flags into a silent 130
        cause = exc.__context__.__cause__ if isinstance(exc.__context__, typer.Exit) else None
        if exc.code == 130 and isinstance(cause, KeyboardInterrupt):
            _interrupted_early()
        raise


def _interrupted_early() -> None:
    typer.echo("interrupted: nothing done", err=True)
    sys.exit(130)
