"""The ``shmcache`` command's public entry point (``shmcache.cli:main``); the commands
live in :mod:`shmcache._cli`.

This module imports nothing but the standard library until ``main`` runs, so that a
Ctrl+C while the command loads its modules (Typer, rich, the store: long on a loaded
machine) says "interrupted: nothing done" instead of a traceback from inside an import."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

__all__ = ["app", "main"]

app: typer.Typer


def main() -> None:
    """Console entry point."""
    try:
        from ._cli.app import main as run
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: nothing done\n")
        raise SystemExit(130) from None
    run()


def __getattr__(name: str) -> Any:
    if name == "app":  # the Typer app (docs and tests render it)
        from ._cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
