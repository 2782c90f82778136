"""The descriptor channel's framing: one JSON object per ``SOCK_SEQPACKET`` message, with
at most one file descriptor beside it (``SCM_RIGHTS``).

The daemon of a root listens on ``ROOT/daemon.fds`` (mode and group those of its HTTP
socket) for members' writes: it creates each file of a new version in the root's
``tmp/``, hands its descriptor to the member to fill, and checks and publishes it on
commit (``shmcache.service.fd_channel``; the member's side is ``member_writes``). HTTP
stays the control plane; this channel only carries writes, because HTTP has no way to
pass a descriptor. Record boundaries are the kernel's (seqpacket), so a record is never
half read, and a descriptor always arrives with the first record of its message. The kernel
refuses a seqpacket record larger than the socket's send buffer (208 KiB by default): a
message over 192 KiB (the commit of a directory of thousands of files, and its answer)
goes as records of :data:`RECORD` bytes, each but the last starting with ``\x01``.

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
import threading
from collections.abc import Sequence
from typing import Any

from .. import errors
from ..errors import InvalidRequestError, ShmCacheError

__all__ = [
    "FDS_SOCKET",
    "MAX_MESSAGE",
    "MAX_REQUEST",
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
"""Largest message a member reads (the daemon's answer to a commit: ~400 bytes an entry)."""
MAX_REQUEST = 8 << 20
"""Largest request the daemon reads (a begin or commit of ~20,000 entries). Parsed JSON
takes up to ~26x its bytes, and the daemon parses one request over :data:`_BIG` at a
time: a member cannot make it hold more than ~200 MiB for one (1 MiB before records)."""
RECORD = 32 << 10
"""Size of each record of a message split in records."""
_SINGLE = 192 << 10  # sent as one record up to this (as before records; kernel default: 208 KiB)
_BIG = 1 << 20  # a request over this waits for any other one over it to be parsed
_MORE = b"\x01"  # first byte of a record that is not its message's last
_big_requests = threading.Lock()


def message_size(body: dict[str, Any]) -> int:
    """The bytes ``body`` takes on the channel."""
    return len(_encoded(body))


def check_fits(body: dict[str, Any], what: str) -> None:
    """Raise :class:`InvalidRequestError` (naming ``what``: whose message, what to do) if
    the request ``body`` is over :data:`MAX_REQUEST`: a member asks before it writes."""
    size = message_size(body)
    if size > MAX_REQUEST:
        raise InvalidRequestError(
            f"{size} bytes of metadata, over the daemon channel's limit of {MAX_REQUEST}; {what}"
        )


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def send_message(sock: socket.socket, body: dict[str, Any], fd: int | None = None) -> None:
    """Send ``body`` as one message, with ``fd`` beside it if given: one record up to 192
    KiB (what a peer of an older version reads), else records of :data:`RECORD` bytes but
    the last, each of those starting with ``\\x01`` (a JSON object starts with ``{``)."""
    data = _encoded(body)
    if len(data) > MAX_MESSAGE:
        raise InvalidRequestError(f"message of {len(data)} bytes is over the channel's {MAX_MESSAGE}")
    records, start = [], 0
    if len(data) > _SINGLE:
        while len(data) - start > RECORD:  # (JSON escapes control characters: no 0x01 in data)
            records.append(_MORE + data[start : start + RECORD - len(_MORE)])
            start += RECORD - len(_MORE)
    records.append(data[start:])
    for index, record in enumerate(records):
        if fd is not None and index == 0:
            socket.send_fds(sock, [record], [fd])
        else:
            sock.sendall(record)


def recv_message(
    sock: socket.socket, limit: int = MAX_MESSAGE, one_big_at_a_time: bool = False
) -> tuple[dict[str, Any], int | None] | None:
    """The next message and the descriptor that came with it; None when the peer hung up.

    More than one descriptor, a truncated record, a record but the last of other than
    :data:`RECORD` bytes, a message over ``limit`` or one that is not a JSON object is an
    :class:`InvalidRequestError` (every descriptor received is closed first).
    ``one_big_at_a_time`` (the daemon): a message over 1 MiB is received and parsed while
    no other is, in any thread (waiting at most a minute for it)."""
    data = bytearray()
    received: list[int] = []
    big = False
    try:
        while True:
            record, fds, flags = _recv_record(sock)
            received += fds
            if not data and not record and not fds:
                return None
            if data and not record:
                raise InvalidRequestError("the connection ended in the middle of a message")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(received) > 1 or not record:
                raise InvalidRequestError("a message over the channel's limits (size or descriptors)")
            more = record.startswith(_MORE)
            if more and len(record) != RECORD:
                raise InvalidRequestError(f"a record of a message but its last is not {RECORD} bytes")
            data += record[len(_MORE) :] if more else record
            if len(data) > limit:
                raise InvalidRequestError(f"a message over the channel's {limit} bytes")
            if one_big_at_a_time and not big and len(data) > _BIG:
                if not _big_requests.acquire(timeout=60):
                    raise InvalidRequestError("the daemon is reading another large request: try again")
                big = True
            if not more:
                break
        body = json.loads(data)
        if not isinstance(body, dict):
            raise InvalidRequestError("a message that is not a JSON object")
    except (ValueError, InvalidRequestError) as exc:
        _close_all(received)
        raise (
            exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(f"unreadable message: {exc}")
        ) from None
    finally:
        if big:
            _big_requests.release()
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
