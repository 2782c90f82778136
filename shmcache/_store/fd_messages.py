"""The descriptor channel's framing: one JSON object per ``SOCK_SEQPACKET`` message, with
at most one file descriptor beside it (``SCM_RIGHTS``).

The daemon of a root listens on ``ROOT/daemon.fds`` (mode and group those of its HTTP
socket) for members' writes: it creates each file of a new version in the root's
``tmp/``, hands its descriptor to the member to fill, and checks and publishes it on
commit (``shmcache.service.fd_channel``; the member's side is ``member_writes``). HTTP
stays the control plane; this channel only carries writes, because HTTP has no way to
pass a descriptor. Message boundaries are the kernel's (seqpacket), so a message is
never half read, and a descriptor always arrives with the message it belongs to.

Requests (member -> daemon), answered in order, each with ``{"ok": true, ...}`` or
``{"ok": false, "error": <ShmCacheError class name>, "detail": <message>}``:

- ``{"op": "begin", "entries": [{"key", "kind", "files": {name: bytes}}], "overwrite",
  "pin"}``: reserve room (quota, budget, tmpfs) and make one version per entry.
- ``{"op": "file", "entry": i, "name": name}``: the answer carries the descriptor of
  ``<name>.npy`` of entry ``i``, preallocated to its size, open for writing.
- ``{"op": "commit", "extra": [{...} per entry]}``: every descriptor handed out must be
  closed by then (the daemon proves it with a read lease); the files are validated as
  sources are and published all at once; the answer lists the entries.

A connection that ends before its commit publishes nothing, and what it reserved is freed
at once (a member killed mid-put included).
"""

from __future__ import annotations

import array
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

from .. import errors
from ..errors import InvalidRequestError, ShmCacheError

__all__ = ["FDS_SOCKET", "MAX_MESSAGE", "error_body", "raise_error", "recv_message", "send_message"]

FDS_SOCKET = "daemon.fds"
"""The channel's socket, beside ``daemon.sock`` in the root."""
MAX_MESSAGE = 1 << 20
"""Largest message read (a commit's metadata for a directory of many files)."""


def send_message(sock: socket.socket, body: dict[str, Any], fd: int | None = None) -> None:
    """Send ``body`` as one message, with ``fd`` beside it if given."""
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise InvalidRequestError(f"message of {len(data)} bytes is over the channel's {MAX_MESSAGE}")
    if fd is None:
        sock.sendall(data)
    else:
        socket.send_fds(sock, [data], [fd])


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], int | None] | None:
    """The next message and the descriptor that came with it; None when the peer hung up.

    More than one descriptor, a truncated message or one that is not a JSON object is an
    :class:`InvalidRequestError` (every descriptor received is closed first)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if not data and not received:
        return None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(received) > 1:
            raise InvalidRequestError("a message over the channel's limits (size or descriptors)")
        body = json.loads(data)
        if not isinstance(body, dict):
            raise InvalidRequestError("a message that is not a JSON object")
    except (ValueError, InvalidRequestError) as exc:
        _close_all(received)
        raise (
            exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(f"unreadable message: {exc}")
        ) from None
    return body, (received[0] if received else None)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def error_body(exc: ShmCacheError) -> dict[str, Any]:
    """The answer that carries ``exc`` to the member."""
    return {"ok": False, "error": type(exc).__name__, "detail": str(exc)}


def raise_error(body: dict[str, Any]) -> None:
    """Raise the error an answer carries (its class by name, :class:`ShmCacheError` for a
    name this version does not know); return if the answer is ``ok``."""
    if body.get("ok") is True:
        return
    detail = str(body.get("detail") or "the daemon refused the request")
    cls = getattr(errors, str(body.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, ShmCacheError)):
        cls = ShmCacheError
    raise cls(detail)
