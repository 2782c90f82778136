"""Running the daemon: one per root (an flocked pid file), uvicorn on a Unix socket
(mode 0600, peers checked by uid with ``SO_PEERCRED``) and optionally on TCP.

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
import signal
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from shmcache import Store

from .app import create_app
from .errors import DaemonRunningError
from .settings import Settings, is_loopback

__all__ = ["PidFile", "configure_logging", "peer_credentials", "serve"]

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SHUTDOWN_GRACE_S = 5


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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still locked: nobody can take over a file we delete
        os.close(self._fd)
        self._fd = None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _peer_checking_protocol(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol that drops Unix-socket peers of another uid."""
    allowed = {os.geteuid(), 0}

    class PeerCheckingProtocol(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is None or sock.family != socket.AF_UNIX:
                return
            try:
                pid, uid, _ = peer_credentials(sock)
            except OSError:
                pid, uid = -1, -1
            if uid not in allowed:
                logger.warning("refused a connection from pid %d (uid %d): not the daemon's user", pid, uid)
                transport.abort()  # type: ignore[attr-defined]

    return PeerCheckingProtocol


def _http_protocol() -> type[asyncio.Protocol]:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return _peer_checking_protocol(HttpToolsProtocol)
    except ImportError:  # httptools missing: the pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return _peer_checking_protocol(H11Protocol)


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _unix_listener(path: Path) -> socket.socket:
    """Bind ``path`` with mode 0600 from the start (no window where others may connect)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _umask(0o177):
            sock.bind(str(path))
        os.chmod(path, 0o600)
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
        Store(settings.root).prepare()
        pid_file = PidFile(settings.pid_path)
        pid_file.acquire()
        try:
            return _serve_locked(settings, stop_requested)
        finally:
            pid_file.release()
            logger.info("stopped (pid %d)", os.getpid())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_locked(settings: Settings, stop_requested: list[int]) -> int:
    sockets: list[socket.socket] = []
    unix_bound = False
    try:
        app = create_app(settings)
        sockets.append(_unix_listener(settings.socket_path))
        unix_bound = True
        where = [f"unix:{settings.socket_path}"]
        if settings.host is not None and settings.port is not None:
            tcp = _tcp_listener(settings.host, settings.port)
            sockets.append(tcp)
            host, port = tcp.getsockname()[:2]
            where.append(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
            if is_loopback(settings.host) and not settings.token:
                logger.warning("TCP without --token: every local user can control this cache")
        config = uvicorn.Config(
            app,
            http=_http_protocol(),
            loop="auto",  # uvloop when installed (the service extra brings it)
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        )
        server = uvicorn.Server(config)
        _log_ready(server, where)
        if not stop_requested:
            server.run(sockets=sockets)
        return 0 if server.started or stop_requested else 1
    finally:
        for sock in sockets:
            sock.close()
        if unix_bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.socket_path)


def _log_ready(server: uvicorn.Server, where: list[str]) -> None:
    """Log where the daemon listens once uvicorn has started (tests wait for this line)."""
    original = server.startup

    async def startup(*args: Any, **kwargs: Any) -> None:
        await original(*args, **kwargs)
        if server.started:
            logger.info("shmcache daemon (pid %d) listening on %s", os.getpid(), " and ".join(where))

    server.startup = startup  # type: ignore[method-assign]
