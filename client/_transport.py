"""The Unix-socket connection to a daemon: who answers is checked on the very socket the
requests go through, and a stopped daemon is named within seconds.

- **Who answers.** Right after ``connect()``, before a byte is sent, the peer's
  credentials (``SO_PEERCRED``: the uid the kernel recorded when the listener called
  ``listen()``) must be one of the expected uids, by default the owner of the cache root
  (the user whose daemon serves it). Anyone else listening there (a socket path in a
  directory another user can write, a stale path taken over) gets
  :class:`~shmcache.errors.UntrustedDaemonError` and never sees the request. The check is
  on the connected socket itself, so there is no window between checking and using it.
- **A stopped daemon.** The kernel accepts connections on a stopped (SIGSTOP, Ctrl+Z)
  daemon's socket, so a request would wait its whole timeout. Reads wait in slices of
  :data:`SLICE_S`; after :data:`STOPPED_AFTER_S` without an answer the stream asks the
  kernel whether the root's daemon is stopped (:mod:`._liveness`) and gives up at once if
  it is. A daemon that is merely slow keeps the full timeout.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import httpcore

from shmcache._disk.layout import ENV_SOCKET
from shmcache.errors import UntrustedDaemonError

from ._liveness import live_daemon

__all__ = ["SLICE_S", "STOPPED_AFTER_S", "CheckedUnixBackend", "expected_uids", "peer_uid"]

SLICE_S = 0.5
"""How long one read waits before the stream looks at the daemon's state."""
STOPPED_AFTER_S = 2.0
"""How long a read waits before a stopped daemon is reported (then within one slice)."""
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process that listens at the other end of a connected Unix socket."""
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


def expected_uids(root: Path, extra: Iterable[int] = ()) -> frozenset[int]:
    """Who may answer for ``root``: its owner (this user while it does not exist yet),
    plus ``extra`` (a team's service account: the hook for a shared daemon)."""
    try:
        owner = os.stat(root).st_uid
    except OSError:
        owner = os.getuid()
    return frozenset({owner, *extra})


class CheckedUnixBackend(httpcore.NetworkBackend):
    """Connects to the daemon's Unix socket (whatever host the URL names), checks who
    listens there, and returns a stream that notices a stopped daemon."""

    def __init__(self, socket_path: Path, root: Path, uids: Callable[[], Collection[int]]) -> None:
        self._path = str(socket_path)
        self._root = root
        self._uids = uids
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        return self.connect_unix_socket(self._path, timeout, socket_options)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_unix_socket(self._path, timeout, socket_options)
        try:
            uid = peer_uid(stream.get_extra_info("socket"))
            allowed = self._uids()
            if uid not in allowed:
                raise UntrustedDaemonError(
                    f"the process listening on {self._path} runs as uid {uid} ({_user(uid)}), not as "
                    f"{' or '.join(f'uid {u} ({_user(u)})' for u in sorted(allowed))}, whose daemon serves "
                    f"{self._root}: nothing was sent to it. Check ${ENV_SOCKET} and --socket (a "
                    "socket in a directory others can write can be anyone's), or start your own daemon"
                )
        except BaseException:
            stream.close()
            raise
        return _WatchedStream(stream, self._root)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _WatchedStream(httpcore.NetworkStream):
    """A stream whose reads give up early when the root's daemon is stopped."""

    def __init__(self, inner: httpcore.NetworkStream, root: Path) -> None:
        self._inner = inner
        self._root = root

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        start = time.monotonic()
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise httpcore.ReadTimeout(f"no answer within {timeout:g} s")
            try:
                return self._inner.read(max_bytes, SLICE_S if left is None else min(SLICE_S, left))
            except httpcore.ReadTimeout:
                waited = time.monotonic() - start
                if waited >= STOPPED_AFTER_S and _stopped(self._root):
                    raise httpcore.ReadTimeout(f"no answer within {waited:.0f} s") from None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _stopped(root: Path) -> bool:
    live = live_daemon(root)
    return live is not None and live.stopped


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return "no user name"
