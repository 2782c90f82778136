"""Which cache a command works on, chosen once per command: the daemon's
(:class:`shmcache.client.Client`) when a daemon serves that root, else this process's
(:class:`shmcache.Store`). Both satisfy :class:`shmcache._control.CacheControl`, so most
commands do not care which they got.

Through the daemon, its loads are shared (the root's budget applies either way). A stale socket or a
daemon serving another root does not count; but a daemon that lives (it holds the root's
pid file locked) and does not answer is an error within a few seconds, never a reason
to work on the root behind its back: ``--local`` does that, and only when asked. httpx is
imported only when a socket or a pid file exists.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .._disk.layout import ENV_SOCKET, Layout, default_root
from .._store import Store
from .._team.config import TeamConfig, checked_team, team_of
from ..errors import DaemonUnavailableError, ShmCacheError, UntrustedDaemonError
from .common import fail, note_team_root, root_given, team_option

if TYPE_CHECKING:
    from ..client import Client

__all__ = [
    "DAEMON_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "command_team",
    "daemon_client",
    "local_store",
    "open_backend",
    "refuse_team_writes_here",
    "resolve_root",
]

DAEMON_TIMEOUT_S = 30.0
"""How long an operation through the daemon may take to answer."""
PROBE_TIMEOUT_S = 5.0
"""How long a live daemon has to answer its health check before the command gives up."""
_RETRY_S = 0.1


def command_team(root: Path | None) -> TeamConfig | None:
    """The team a command works on (``shmcache --team``, or ``$SHMCACHE_TEAM`` without
    ``--root``), its root checked against the teams file; None for a personal root.
    A refusal ends the command (exit 1) saying why. A ``--root`` on the command line wins
    over ``$SHMCACHE_TEAM``; ``$SHMCACHE_ROOT`` with either team is decided as for
    library calls (with ``--team``: the team; with ``$SHMCACHE_TEAM``: refused)."""
    try:
        team = team_of(root if root_given() else None, team_option())
        if team is not None:
            note_team_root(team)
        return None if team is None else checked_team(team)
    except ShmCacheError as exc:
        raise fail(exc) from None


def refuse_team_writes_here(root: Path | None, action: str) -> None:
    """End the command (exit 1) if it works on a team's root, which only the team's daemon
    writes, and that daemon does not run: say so, and how to start it (rather than the
    store's refusal of a write in place, which is about puts)."""
    team = command_team(root)
    if team is None or team.uid == os.geteuid():
        return
    raise fail(
        DaemonUnavailableError(
            f"team {team.name}'s daemon is not running (nothing answers on {Layout(team.root).socket}), "
            f"and only it may {action} in the team's root {team.root}: ask an administrator to "
            f"start it (`systemctl start shmcache-team@{team.name}`, or `sudo -u {team.owner} "
            f"shmcache serve --team {team.name}`)"
        )
    )


def resolve_root(root: Path | None) -> Path:
    """The absolute root a command works on (``--root``, else the team's, else
    ``$SHMCACHE_ROOT`` or the default)."""
    team = command_team(root)
    if team is not None:
        return team.root
    return Path(os.path.abspath(root if root is not None else default_root()))


def local_store(root: Path | None) -> Store:
    """The command's root in this process (a team's, trusted as the teams file says)."""
    team = command_team(root)
    if team is not None:
        try:
            return Store(team=team.name)
        except ShmCacheError as exc:
            raise fail(exc) from None
    return Store(resolve_root(root))


def daemon_client(root: Path | None, local: bool = False) -> Client | None:
    """A client of the daemon serving this root, or None when no daemon lives there (or
    with ``local``).

    The socket is ``$SHMCACHE_SOCKET`` or the root's, as for ``shmcache serve``. Raises
    :class:`~shmcache.DaemonUnavailableError` when a daemon lives but does not answer
    within :data:`PROBE_TIMEOUT_S` (one that is still starting gets that long to), and
    :class:`~shmcache.errors.UntrustedDaemonError` when another user listens on the socket.
    """
    if local:
        return None
    team = command_team(root)
    resolved = resolve_root(root)
    layout = Layout(resolved)
    socket_path = os.environ.get(ENV_SOCKET) or str(layout.socket)
    if not os.path.exists(socket_path) and not os.path.exists(layout.pid_file):
        return None  # cheap test first: no httpx import, no connection
    try:
        from ..client import Client
        from ..client._liveness import live_daemon
    except ImportError:  # pragma: no cover - httpx is a dependency; a --no-deps install
        typer.echo(f"notice: httpx is not installed, so not talking to the daemon on {resolved}", err=True)
        return None
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    def client(timeout: float) -> Client:
        if team is not None:  # the daemon must be the teams file's account
            return Client(team=team.name, timeout=timeout)
        return Client(resolved, timeout=timeout)

    while True:
        probe = client(round(max(0.5, deadline - time.monotonic()), 1))
        try:
            served = probe.health().root
        except DaemonUnavailableError:
            live = live_daemon(resolved)
            if live is None:
                return None  # a stale socket, or the daemon just stopped
            if live.stopped or time.monotonic() + _RETRY_S >= deadline:
                raise  # a stopped daemon will not start answering by itself: say so now
            time.sleep(_RETRY_S)  # starting (no socket yet) or stopping
            continue
        except UntrustedDaemonError:
            raise  # another user listens there: never talk to it, never work around it
        except ShmCacheError:  # an error status: not a shmcache daemon of this version
            served = None
        finally:
            probe.close()
        break
    if served is None or os.path.abspath(served) != str(resolved):
        live = live_daemon(resolved)
        if live is not None:
            raise DaemonUnavailableError(
                f"the shmcache daemon {live} serves {resolved}, but {socket_path} is not its socket "
                f"({'a daemon of ' + served if served else 'no shmcache daemon'} answers there): unset "
                f"${ENV_SOCKET} or point it at that daemon's socket, or pass --local"
            )
        return None
    return client(DAEMON_TIMEOUT_S)


@contextmanager
def open_backend(
    root: Path | None, local: bool = False, writes: str | None = None
) -> Iterator[Store | Client]:
    """The daemon's client if one serves ``root`` (and not ``local``), else a local Store;
    closed afterwards. A live daemon that does not answer ends the command (exit 1), and
    so does a command that ``writes`` (``"evict entries"``) a team's root without its daemon."""
    try:
        client = daemon_client(root, local)
    except (DaemonUnavailableError, UntrustedDaemonError) as exc:
        raise fail(exc) from None
    if client is None:
        if writes is not None and not local:  # --local: the store's own refusal says why
            refuse_team_writes_here(root, writes)
        yield local_store(root)
        return
    with client:
        yield client
