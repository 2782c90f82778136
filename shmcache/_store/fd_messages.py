"""The descriptor channel's framing: one JSON object per ``SOCK_SEQPACKET`` message, with
at most one file descriptor beside it (``SCM_RIGHTS``).

The daemon of a root listens on ``ROOT/daemon.fds`` (mode and group those of its HTTP
socket) for members' writes: it creates each file of a new version in the root's
``tmp/``, hands its descriptor to the member to fill, and checks and publishes it on
commit (``shmcache.service.fd_channel``; the member's side is ``member_writes``). HTTP
stays the control plane; this channel only carries writes, because HTTP has no way to
pass a descriptor. Record boundaries are the kernel's (seqpacket), so a record is never
half read, and a descriptor always arrives with the first record of its message. A record
is at most :data:`RECORD` bytes (the kernel refuses a seqpacket record larger than the
socket's send buffer, 208 KiB by default): a longer message (the commit of a directory of
thousands of files, and its answer) goes as several, each but the last starting with
``\x01`` (a JSON object starts with ``{``), up to :data:`MAX_MESSAGE` in all.

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

__all__ = [
    "FDS_SOCKET",
    "MAX_MESSAGE",
    "RECORD",
    "check_fits",
    "error_body",
    "message_size",
    "raise_error",
    "recv_message",
    "send_message",
]

FDS_SOCKET = "daemon.fds"
"""The channel's socket, beside ``daemon.sock`` in the root."""
MAX_MESSAGE = 64 << 20
"""Largest message (a commit's metadata for a directory of up to 100,000 files, and its
answer: ~400 bytes an entry); what a message costs its reader is bounded by it."""
RECORD = 32 << 10
"""Largest seqpacket record sent (below any send buffer the kernel gives by default)."""
_MORE = b"\x01"  # first byte of a record that is not its message's last


def message_size(body: dict[str, Any]) -> int:
    """The bytes ``body`` takes on the channel (checked against :data:`MAX_MESSAGE`)."""
    return len(_encoded(body))


def check_fits(body: dict[str, Any], what: str) -> None:
    """Raise :class:`InvalidRequestError` (naming ``what``: whose message, what to do) if
    ``body`` is over :data:`MAX_MESSAGE`: a sender asks before it writes anything."""
    size = message_size(body)
    if size > MAX_MESSAGE:
        raise InvalidRequestError(
            f"{size} bytes of metadata, over the daemon channel's limit of {MAX_MESSAGE}; {what}"
        )


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def send_message(sock: socket.socket, body: dict[str, Any], fd: int | None = None) -> None:
    """Send ``body`` as one message of one or more records, with ``fd`` beside its first."""
    data = _encoded(body)
    if len(data) > MAX_MESSAGE:
        raise InvalidRequestError(f"message of {len(data)} bytes is over the channel's {MAX_MESSAGE}")
    records, start = [], 0
    while len(data) - start > RECORD:  # (JSON escapes control characters: no 0x01 in data)
        records.append(_MORE + data[start : start + RECORD - len(_MORE)])
        start += RECORD - len(_MORE)
    records.append(data[start:])
    for index, record in enumerate(records):
        if fd is not None and index == 0:
            socket.send_fds(sock, [record], [fd])
        else:
            sock.sendall(record)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], int | None] | None:
    """The next message and the descriptor that came with it; None when the peer hung up.

    More than one descriptor, a truncated record, a message over :data:`MAX_MESSAGE` or one
    that is not a JSON object is an :class:`InvalidRequestError` (every descriptor
    received is closed first)."""
    parts: list[bytes] = []
    received: list[int] = []
    size = 0
    while True:
        data, fds, flags = _recv_record(sock)
        received += fds
        if not parts and not data and not fds:
            return None
        try:
            if parts and not data:
                raise InvalidRequestError("the connection ended in the middle of a message")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(received) > 1 or not data:
                raise InvalidRequestError("a message over the channel's limits (size or descriptors)")
            size += len(data)
            if size > MAX_MESSAGE + RECORD:
                raise InvalidRequestError(f"a message over the channel's {MAX_MESSAGE} bytes")
        except InvalidRequestError:
            _close_all(received)
            raise
        if not data.startswith(_MORE):
            parts.append(data)
            break
        parts.append(data[len(_MORE) :])
    data = b"".join(parts)
    try:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise InvalidRequestError("a message that is not a JSON object")
    except (ValueError, InvalidRequestError) as exc:
        _close_all(received)
        raise (
            exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(f"unreadable message: {exc}")
        ) from None
    return body, (received[0] if received else None)


def _recv_record(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One seqpacket record, the descriptors beside it and its flags (``MSG_TRUNC`` where
    it was longer than 256 KiB: an older peer sent a message as one record, at most what
    its send buffer took, 208 KiB by default)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(8 * RECORD + 1, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


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
