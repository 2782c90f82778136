"""Running the daemon: one per root (an flocked pid file), uvicorn on a Unix socket
(mode 0600, peers checked by uid with ``SO_PEERCRED``; a team's: 0660, the members of
its group, :mod:`.team`) and optionally on TCP, with the
descriptor limit raised; the HTTP edge (head limit, parser errors as JSON, slow, idle or
surplus connections closed) is :mod:`.protocol`.

The kernel drops the pid file's flock when the daemon dies, even by ``kill -9``, so a
stale pid file or socket never blocks the next daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import resource
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from shmcache import Store
from shmcache._disk.layout import Layout

from .app import create_app
from .errors import DaemonRunningError
from .fd_channel import FdChannel, start_fd_channel
from .protocol import MAX_HEAD_BYTES, ConnectionGuard, guarded_protocol, peer_credentials
from .settings import Settings, is_loopback
from .state import RootWatch
from .team import TEAM_SOCKET_MODE, TeamPeers, prepare_team

__all__ = [
    "MAX_HEAD_BYTES",
    "ConnectionGuard",
    "PidFile",
    "configure_logging",
    "peer_credentials",
    "raise_descriptor_limit",
    "serve",
]

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SHUTDOWN_GRACE_S = 5
_STUCK_THREAD_WAIT_S = 1.0
"""After a stop signal and the loads' cancellation, how long threads that still run get."""
_KEEP_ALIVE_S = 5  # uvicorn closes a connection idle this long between requests
_MAX_TCP_CONNECTIONS = 1024
_NOFILE_IF_UNLIMITED = 1 << 20
_ROOT_CHECK_S = 1.0
"""How often the daemon checks that its root is still there."""


def configure_logging(level: str) -> None:
    """One line per event on stderr (only ``shmcache serve`` configures logging)."""
    logging.basicConfig(level=level.upper(), format=_LOG_FORMAT, force=True)
    # uvicorn's start-up chatter only at debug; its errors always.
    logging.getLogger("uvicorn.error").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


class PidFile:
    """``<root>/daemon.pid``, flocked for the daemon's lifetime."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, Layout(self.path.parent).file_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                pid = self._read_pid()
                stop = f"kill -TERM {pid}" if pid.isdigit() else f"kill -TERM $(cat {self.path})"
                raise DaemonRunningError(
                    f"another shmcache daemon (pid {pid}) already serves {self.path.parent}; "
                    f"stop it first ({stop}) or pick another --root"
                ) from None
            # The previous owner may have unlinked the file between our open and flock.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _read_pid(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        # While still locked: nobody can take over a file we delete. Not a file another daemon
        # made since ours went with its root (rm -rf).
        _unlink_if_same(self.path, os.fstat(self._fd))
        os.close(self._fd)
        self._fd = None


def _unlink_if_same(path: Path, ours: os.stat_result) -> None:
    """Unlink ``path`` if it still is the file ``ours`` describes (held open, so not reused)."""
    with contextlib.suppress(FileNotFoundError):
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
            os.unlink(path)


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft descriptor limit (RLIMIT_NOFILE) to its hard limit: every
    connection holds one. Returns (before, now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, _NOFILE_IF_UNLIMITED)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open
            logger.warning("could not raise the descriptor limit from %d to %d: %s", soft, target, exc)
            return soft, soft
        return soft, target
    return soft, soft


def _max_tcp_connections(nofile: int) -> int:
    """TCP connections allowed at once: a quarter of the descriptors, at most ``_MAX_TCP_CONNECTIONS``;
    the rest stay for the Unix socket, loads and ``/proc`` scans."""
    return max(1, min(_MAX_TCP_CONNECTIONS, nofile // 4))


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _unix_listener(path: Path, mode: int = 0o600) -> socket.socket:
    """Bind ``path`` with ``mode`` (0600; a team's 0660) from the start (no window where
    others may connect)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _umask(0o777 & ~mode):
            sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket left by a dead daemon; refuse one somebody still listens on (a
    ``--socket`` path is not covered by this root's pid file)."""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise DaemonRunningError(f"{path} exists and is not a socket; remove it or pick another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: stale
    else:
        raise DaemonRunningError(f"another daemon listens on {path}; stop it or pick another --socket")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(settings: Settings) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the process exit status."""
    configure_logging(settings.log_level)
    stop_requested: list[int] = []

    def note_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    # uvicorn re-raises the signal that stopped it once it is done: let that be a no-op.
    previous = {sig: signal.signal(sig, note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        before, nofile = raise_descriptor_limit()
        if nofile != before:
            logger.info("descriptor limit raised from %d to %d", before, nofile)
        peers = None
        if settings.team is not None:  # the team's root, budget and sources; members may connect
            settings, team = prepare_team(settings)
            peers = TeamPeers(team)
        Store(settings.root).prepare()
        pid_file = PidFile(settings.pid_path)
        pid_file.acquire()
        try:
            return _serve_locked(settings, stop_requested, nofile, peers)
        finally:
            pid_file.release()
            logger.info("stopped (pid %d)", os.getpid())
            if stop_requested:
                _exit_now_if_threads_are_stuck()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_now_if_threads_are_stuck() -> None:
    """After a stop signal, end the process even if a load thread cannot be interrupted
    (waiting on another process's key lock, or blocked in a system call on a hung file
    system): the interpreter would otherwise wait for it at exit, for as long as it takes.

    Everything is cleaned up by now (socket and pid file gone); what such a thread was
    writing sits in ``tmp/`` under its flock, which the exit releases, and the next start's
    cleanup frees it, as after a ``kill -9``.
    """
    deadline = time.monotonic() + _STUCK_THREAD_WAIT_S
    while True:
        stuck = [
            t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()
        ]
        if not stuck:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    logger.warning(
        "exiting without waiting for %d thread(s) that do not stop (%s); what they were loading "
        "is freed by the next start's cleanup", len(stuck), ", ".join(t.name for t in stuck)
    )
    logging.shutdown()
    os._exit(0)


def _serve_locked(
    settings: Settings, stop_requested: list[int], nofile: int, peers: TeamPeers | None = None
) -> int:
    sockets: list[socket.socket] = []
    bound: os.stat_result | None = None
    channel: FdChannel | None = None
    failures: list[str] = []
    try:
        app = create_app(settings)
        sockets.append(_unix_listener(settings.socket_path, 0o600 if peers is None else TEAM_SOCKET_MODE))
        bound = os.lstat(settings.socket_path)
        channel = start_fd_channel(app.state.service, settings, None if peers is None else peers.refusal)
        where = [f"unix:{settings.socket_path}"]
        if settings.host is not None and settings.port is not None:
            tcp = _tcp_listener(settings.host, settings.port)
            sockets.append(tcp)
            host, port = tcp.getsockname()[:2]
            where.append(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
            if is_loopback(settings.host) and not settings.token:
                logger.warning("TCP without --token: every local user can control this cache")
        guard = ConnectionGuard(_max_tcp_connections(nofile), settings.request_timeout)
        if settings.uses_tcp:
            logger.info("at most %d TCP connections at once (descriptor limit %d)", guard.max_tcp, nofile)
        config = uvicorn.Config(
            app,
            http=guarded_protocol(guard, None if peers is None else peers.refusal),
            ws="none",  # no WebSocket route: an upgrade request is answered as a plain one
            loop="auto",  # uvloop when installed (the service extra brings it)
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_keep_alive=_KEEP_ALIVE_S,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        )
        server = uvicorn.Server(config)
        _on_started(server, where, app.state.service.root_watch, failures)
        if not stop_requested:
            server.run(sockets=sockets)
        if failures:
            return 1
        return 0 if server.started or stop_requested else 1
    finally:
        if channel is not None:
            channel.close()
        for sock in sockets:
            sock.close()
        if bound is not None:
            _unlink_if_same(settings.socket_path, bound)


def _on_started(server: uvicorn.Server, where: list[str], watch: RootWatch, failures: list[str]) -> None:
    """Once uvicorn has started: log where the daemon listens (tests wait for this line) and
    start watching the root."""
    original = server.startup
    tasks: list[asyncio.Task[None]] = []

    async def startup(*args: Any, **kwargs: Any) -> None:
        await original(*args, **kwargs)
        if server.started:
            logger.info("shmcache daemon (pid %d) listening on %s", os.getpid(), " and ".join(where))
            tasks.append(asyncio.create_task(_watch_root(server, watch, failures)))

    server.startup = startup  # type: ignore[method-assign]


async def _watch_root(server: uvicorn.Server, watch: RootWatch, failures: list[str]) -> None:
    """Stop the daemon (exit status 1) with a clear message if its root goes away: removed
    (``rm -rf``), replaced, or emptied of its entries. Requests meanwhile get 503 saying so."""
    while not server.should_exit:
        await asyncio.sleep(_ROOT_CHECK_S)
        problem = watch.problem()
        if problem is not None:
            logger.error("%s", problem)
            failures.append(problem)
            server.should_exit = True
            return
