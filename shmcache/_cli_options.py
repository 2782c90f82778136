"""Command-line options shared by every ``shmcache`` command module."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._disk.layout import ENV_ROOT

__all__ = ["RootOption"]

RootOption = Annotated[
    Path | None,
    typer.Option(
        "--root",
        envvar=ENV_ROOT,
        help="Cache root (default: $SHMCACHE_ROOT or /dev/shm/shmcache-<uid>).",
        show_default=False,
    ),
]
