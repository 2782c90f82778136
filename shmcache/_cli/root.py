"""``shmcache root``: the cache root the other commands would use, for shell scripts.

A script that talks to the daemon with curl needs its socket, ``$(shmcache root)/daemon.sock``,
which a hard-coded ``/dev/shm/shmcache-$(id -u)`` gets wrong once ``--root`` or
``$SHMCACHE_ROOT`` points elsewhere.
"""

from __future__ import annotations

import typer

from .backend import resolve_root
from .options import RootOption

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command("root")(root)


def root(root: RootOption = None) -> None:
    """Print the cache root: --root, else $SHMCACHE_ROOT, else /dev/shm/shmcache-<uid>.

    The daemon's socket is $(shmcache root)/daemon.sock unless $SHMCACHE_SOCKET says otherwise.
    """
    typer.echo(resolve_root(root))
