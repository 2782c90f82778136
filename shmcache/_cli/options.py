"""Command-line options shared by every ``shmcache`` command module, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._disk.layout import ENV_ROOT, ENV_SOCKET, SHM_DIR, SOCKET_NAME
from .common import note_root_source

__all__ = ["ByUserOption", "JsonOption", "LocalOption", "RootOption", "SocketOption"]

RootOption = Annotated[
    Path | None,
    typer.Option(
        "--root",
        envvar=ENV_ROOT,
        help=f"Cache root (default: ${ENV_ROOT} or {SHM_DIR}/shmcache-<uid>).",
        show_default=False,
        readable=False,  # the core says why a root is unusable (another user's: CacheRootError)
        callback=note_root_source,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
ByUserOption = Annotated[
    bool, typer.Option("--by-user", help="Each user's entries and bytes (who loaded them).")
]
LocalOption = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Work on the root in this process even if a daemon serves it (the root's budget still "
        "applies). Without it, a daemon that does not answer is an error.",
    ),
]
SocketOption = Annotated[
    Path | None,
    typer.Option(
        "--socket",
        envvar=ENV_SOCKET,
        show_default=False,
        help=f"The daemon's Unix socket (default <root>/{SOCKET_NAME}).",
        readable=False,
    ),
]
