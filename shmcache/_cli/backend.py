"""Which cache a command works on, chosen once per command: the daemon's
(:class:`shmcache.client.Client`) when a daemon serving that root answers on its socket,
else this process's (:class:`shmcache.Store`). Both satisfy
:class:`shmcache._control.CacheControl`, so most commands do not care which they got.

Through the daemon, its budget applies and its loads are shared; a stale socket or a
daemon serving another root does not count. httpx is imported only when a socket exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .._disk.layout import ENV_SOCKET, Layout, default_root
from .._store import Store
from ..errors import ShmCacheError

if TYPE_CHECKING:
    from ..client import Client

__all__ = ["DAEMON_TIMEOUT_S", "daemon_client", "open_backend", "resolve_root"]

DAEMON_TIMEOUT_S = 30.0

def resolve_root(root: Path | None) -> Path:
    """The absolute root a command works on (``--root``, else ``$SHMCACHE_ROOT`` or the default)."""
    return Path(os.path.abspath(root if root is not None else default_root()))


def daemon_client(root: Path | None) -> Client | None:
    """A client of the daemon serving this root, or None when none answers there.

    The socket is ``$SHMCACHE_SOCKET`` or the root's, as for ``shmcache serve``.
    """
    resolved = resolve_root(root)
    socket_path = os.environ.get(ENV_SOCKET) or str(Layout(resolved).socket)
    if not os.path.exists(socket_path):  # cheap test first: no httpx import, no connection
        return None
    try:
        from ..client import Client
    except ImportError:  # pragma: no cover - httpx is a dependency; a --no-deps install
        typer.echo(f"notice: httpx is not installed, so not talking to the daemon on {resolved}", err=True)
        return None
    client = Client(resolved, timeout=DAEMON_TIMEOUT_S)
    try:
        served: str | None = client.health().root
    except ShmCacheError:
        served = None
    if served is None or os.path.abspath(served) != str(resolved):
        client.close()
        return None
    return client


@contextmanager
def open_backend(root: Path | None) -> Iterator[Store | Client]:
    """The daemon's client if one serves ``root``, else a local Store; closed afterwards."""
    client = daemon_client(root)
    if client is None:
        yield Store(resolve_root(root))
        return
    with client:
        yield client
