"""The daemon's HTTP/1.1 edge: uvicorn's httptools protocol, made exact where it is lenient.

- Request heads over ``MAX_HEAD_BYTES`` get 431 whatever the read boundaries. uvicorn
  (like h11's ``max_incomplete_event_size``) bounds only a head that is still *incomplete*:
  one that arrives whole in one read, 70 KB or 200 KB, went to the app. Here a head that
  starts at a read boundary (every request of a client that does not pipeline) is measured
  to the byte before the parser sees it (its end is the first blank line, the parser being
  strict about CRLF); one that starts in the middle of a read (pipelined after a body) is
  measured by its parsed parts (request line, header names and values: at least its size)
  as the parser reports them, and refused before the app sees it.
- Every error the parser finds (malformed request line, header, ``Content-Length``, chunked
  framing, a non-ASCII target) is the JSON error body of every other error,
  ``{"error": "InvalidRequestError", "detail": ...}`` with 400, not uvicorn's plain text;
  an error in a pipelined request is answered after the responses before it.
- A request asking to upgrade (WebSocket, h2c) is answered as a plain request and its
  connection closed: the parser reads nothing after such a request. A client that
  half-closes after its request still gets the answer.
- :class:`ConnectionGuard`: slow, idle and surplus connections; Unix-socket peers of
  another uid are dropped (``SO_PEERCRED``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = [
    "MAX_HEAD_BYTES",
    "PEER_UID",
    "ConnectionGuard",
    "error_answer",
    "guarded_protocol",
    "peer_credentials",
]

PEER_UID = "shmcache_peer_uid"
"""``request.state`` attribute: the uid of the Unix-socket peer that sent the request (None: TCP)."""

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
"""Longest request line and headers read; the longest valid ones are well under 1 KiB."""
_SHED_LOG_INTERVAL_S = 10.0
_HEAD_END = b"\r\n\r\n"
_BLANK = b"\r\n"
_MIN_HEAD = len(b"  HTTP/1.1\r\n\r\n")
"""A request line's spaces, version and CRLF and the blank line: counted before its parts."""
_IDLE, _HEAD, _BODY = 0, 1, 2
"""Where the parser is: between messages, in a head, in a body."""

_HEAD_TOO_LARGE = (
    "RequestHeadTooLargeError",
    f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes, the most this daemon reads",
)
_PARSER_DETAILS = {
    httptools.HttpParserInvalidMethodError: "malformed request line: unknown or invalid method",
    httptools.HttpParserInvalidURLError: "malformed request line: invalid character in the request target "
    "(percent-encode it)",
}


def error_answer(status: int, error: str, detail: str) -> bytes:
    """A whole HTTP/1.1 error response with the JSON error body; it closes the connection."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    return b"%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        STATUS_LINE[status],
        len(body),
        body,
    )


def _parser_detail(exc: httptools.HttpParserError) -> str:
    """What was wrong with a request the parser refused, in a sentence for the client."""
    cause = exc.__context__
    if isinstance(cause, UnicodeDecodeError):  # uvicorn decodes the path as ASCII
        return "malformed request line: the request target must be ASCII (percent-encode other characters)"
    for cls, detail in _PARSER_DETAILS.items():
        if isinstance(exc, cls):
            return detail
    reason = str(exc).strip().rstrip(".") or "unreadable"
    first = reason.split(" ", 1)[0]
    if first.isalpha():  # "Invalid character in ...", not a header's name
        reason = first.lower() + reason[len(first) :]
    return f"malformed HTTP/1.1 request: {reason}"


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class ConnectionGuard:
    """Keeps slow, idle and surplus connections from holding the daemon's descriptors.

    uvicorn closes a connection idle *between* requests (``timeout_keep_alive``), but not one
    that never sends a whole request, and it accepts connections until ``accept`` fails with
    EMFILE, which locks out the Unix socket too. So: every connection must send each request
    (line, headers, body) within ``request_timeout`` of opening or starting it; a request
    head over ``MAX_HEAD_BYTES`` is refused (431); at most ``max_tcp`` TCP connections are
    open (well below the descriptor limit), and one more closes the TCP connection that has
    waited longest for a request (or is refused when all are busy). Unix-socket peers (the
    daemon's own user) are never shed. Every connection closed this way is logged, summed up.
    """

    def __init__(self, max_tcp: int, request_timeout: float) -> None:
        self.max_tcp = max_tcp
        self.request_timeout = request_timeout
        self.tcp: set[Any] = set()
        self.waiting: OrderedDict[Any, None] = OrderedDict()  # TCP, no request in progress: oldest first
        self._shed: Counter[str] = Counter()  # connections shed and not yet logged, by why
        self._due: dict[str, float] = {}  # when the next line of that kind may be logged
        self._reports: dict[str, asyncio.TimerHandle] = {}

    def admit(self, connection: Any) -> bool:
        """Count a new TCP connection in, making room if need be; False: refuse it."""
        if len(self.tcp) >= self.max_tcp:
            if not self.waiting:
                self.shed("refused new TCP connections: every open one had a request in progress")
                return False
            oldest, _ = self.waiting.popitem(last=False)
            self.tcp.discard(oldest)
            oldest.transport.abort()
            self.shed("closed the TCP connection waiting longest for a request, to admit a new one")
        self.tcp.add(connection)
        self.waiting[connection] = None
        return True

    def busy(self, connection: Any) -> None:
        self.waiting.pop(connection, None)

    def rest(self, connection: Any) -> None:
        if connection in self.tcp:
            self.waiting[connection] = None
            self.waiting.move_to_end(connection)

    def forget(self, connection: Any) -> None:
        self.tcp.discard(connection)
        self.waiting.pop(connection, None)

    def shed(self, why: str) -> None:
        """Count a connection closed to protect the daemon: the first of a kind is logged at
        once, later ones summed up in one line per kind and ``_SHED_LOG_INTERVAL_S``."""
        self._shed[why] += 1
        wait = self._due.get(why, 0.0) - time.monotonic()
        if wait <= 0:
            self._report(why)
        elif why not in self._reports:
            self._reports[why] = asyncio.get_running_loop().call_later(wait, self._report, why)

    def _report(self, why: str) -> None:
        self._reports.pop(why, None)
        logger.warning(
            "shedding load: %s: %d (TCP connections open: %d of at most %d)",
            why,
            self._shed.pop(why, 0),
            len(self.tcp),
            self.max_tcp,
        )
        self._due[why] = time.monotonic() + _SHED_LOG_INTERVAL_S


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the head's parsed parts already pass the limit."""


def guarded_protocol(
    guard: ConnectionGuard, refusal: Callable[[int], str | None] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the exact edge described in the module docstring,
    dropping Unix-socket peers of another uid and applying ``guard``. ``refusal`` (a team
    daemon's): why a peer uid may not use the socket, or None; a refused peer's first
    request is answered 403 with that reason, and nothing else."""
    allowed = {os.geteuid(), 0}

    class GuardedProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _tcp = False
        _phase = _IDLE
        _head_known = True
        """Whether the current head started at a read boundary (so ``_head_bytes`` is exact)."""
        _head_bytes = 0
        """Bytes of the current head received in earlier reads (exact when ``_head_known``)."""
        _tail = b""
        """The last bytes of the current head so far: its blank line may straddle two reads."""
        _read_from_idle = False
        """Whether the parser was between messages when this read came: its first head starts it."""
        _begins = 0
        """Messages begun during this read."""
        _parsed = 0
        """The current head's parsed parts, in bytes: a lower bound of its size."""
        _refused = False
        _peer_uid: int | None = None
        """The uid of a Unix-socket peer (``SO_PEERCRED``); None over TCP."""
        _pending: bytes | None = None
        """An error answer that waits for the responses to the requests before it."""
        _forbidden: str | None = None
        """Why this Unix-socket peer may not use a team daemon: its first request gets 403."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family == socket.AF_UNIX:
                try:
                    pid, uid, _ = peer_credentials(sock)
                except OSError:
                    pid, uid = -1, -1
                self._peer_uid = uid
                if refusal is not None:
                    why = refusal(uid)
                    if why is not None:
                        logger.warning("refused a connection from pid %d (uid %d): %s", pid, uid, why)
                        self._forbidden = why
                elif uid not in allowed:
                    logger.warning(
                        "refused a connection from pid %d (uid %d): not the daemon's user", pid, uid
                    )
                    transport.abort()  # type: ignore[attr-defined]
                    return
            else:
                self._tcp = True
                if not guard.admit(self):
                    transport.abort()  # type: ignore[attr-defined]
                    return
            self._arm()

        # ------------------------------------------------------------ reading

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # an error was answered (or is waiting to be): nothing more is read
            if self._forbidden is not None:
                self._refuse(403, "UnauthorizedError", self._forbidden)
                return
            if self._between_requests() and self._deadline is None:
                self._arm()  # a new request starts: it has request_timeout to arrive whole
            entry_phase, start = self._phase, 0
            if entry_phase == _IDLE:  # a head starts here (after blank lines, which the parser skips)
                start = len(data) - len(data.lstrip(_BLANK))
                self._head_known, self._head_bytes, self._tail = True, 0, b""
            if entry_phase != _BODY and self._head_known and self._head_too_large(data, start):
                self._refuse(431, *_HEAD_TOO_LARGE)
                return
            self._read_from_idle, self._begins = entry_phase == _IDLE, 0
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                pass  # answered as a plain request; on_headers_complete closes the connection after
            except httptools.HttpParserError as exc:
                if isinstance(exc.__context__, _HeadTooLarge):
                    self._refuse(431, *_HEAD_TOO_LARGE)
                else:
                    self._refuse(400, "InvalidRequestError", _parser_detail(exc))
                return
            if self.transport.is_closing():
                return
            self._count_incomplete_head(data, start)
            if self._refused or self._between_requests():
                return  # refused, or the head is not complete yet
            if self._tcp:
                guard.busy(self)
            if not self.cycle.more_body:
                self._disarm()

        def _head_too_large(self, data: bytes, start: int) -> bool:
            """Whether the head in progress (it started at a read boundary) passes the limit
            once ``data[start:]`` is added: its end within the limit, or too much without one."""
            seen = self._tail + data[start:]
            room = MAX_HEAD_BYTES - self._head_bytes + len(self._tail)
            if seen.find(_HEAD_END, 0, room) >= 0:
                return False
            return self._head_bytes + len(data) - start > MAX_HEAD_BYTES

        def _count_incomplete_head(self, data: bytes, start: int) -> None:
            """After a read, remember how much of a still incomplete head has arrived."""
            if self._phase != _HEAD:
                return
            if self._begins == 0:  # the head in progress before this read took all of it
                self._head_bytes += len(data)
                if self._head_known:
                    self._tail = (self._tail + data)[-(len(_HEAD_END) - 1) :]
                elif self._head_bytes > MAX_HEAD_BYTES:  # counted from the first whole read of it
                    self._refuse(431, *_HEAD_TOO_LARGE)
            elif self._head_known:  # it began in this read, at ``start``
                self._head_bytes = len(data) - start
                self._tail = data[start:][-(len(_HEAD_END) - 1) :]
            # else it began in the middle of this read: the next reads are counted

        # ------------------------------------------------------------ parser callbacks

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"][PEER_UID] = self._peer_uid  # routes authorize members by it
            self._begins += 1
            self._phase, self._parsed = _HEAD, _MIN_HEAD
            self._head_known = self._begins == 1 and self._read_from_idle
            self._head_bytes, self._tail = 0, b""

        def on_url(self, url: bytes) -> None:
            self._add_parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._add_parsed(len(name) + len(value) + 3)  # at least "name:value\r\n"
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._add_parsed(len(self.parser.get_method()))
            self._phase = _BODY
            super().on_headers_complete()
            if self.parser.should_upgrade():
                self.cycle.keep_alive = False  # the parser reads nothing after it: close once answered

        def on_message_complete(self) -> None:
            self._phase = _IDLE
            super().on_message_complete()

        def _add_parsed(self, size: int) -> None:
            self._parsed += size
            if self._parsed > MAX_HEAD_BYTES:
                raise _HeadTooLarge

        # ------------------------------------------------------------ answering

        def _refuse(self, status: int, error: str, detail: str) -> None:
            """Answer an error the app never sees, then close: now, or after the responses to
            the requests before it (a pipelined request) have gone out."""
            self._refused = True
            self._disarm()
            if status == 431:
                guard.shed(f"refused request heads over {MAX_HEAD_BYTES} bytes (431)")
            else:
                logger.debug("refused a malformed request: %s", detail)
            answer = error_answer(status, error, detail)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if not cycle.more_body or cycle.response_started or self.pipeline:
                    self._pending = answer  # it belongs to a later request
                    return
                cycle.disconnected = True  # its own body was malformed: the app's answer is dropped
                cycle.message_event.set()
            self.transport.write(answer)
            self.transport.close()

        def send_400_response(self, msg: str) -> None:  # pragma: no cover - data_received answers
            self._refuse(400, "InvalidRequestError", f"malformed HTTP/1.1 request: {msg}")

        def on_response_complete(self) -> None:
            if self._pending is not None and not self.pipeline:
                self.server_state.total_requests += 1
                if not self.transport.is_closing():
                    self.transport.write(self._pending)
                    self.transport.close()
                self._pending = None
                return
            super().on_response_complete()
            if self._tcp and not self.transport.is_closing():
                guard.rest(self)

        def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio allows True
            """A client that half-closes after a whole request (``shutdown(SHUT_WR)``) still gets
            its answer, then the connection closes (uvicorn closed it at once: no answer)."""
            cycle = self.cycle
            answering = cycle is not None and not cycle.response_complete and not cycle.more_body
            if answering and not self.pipeline:
                cycle.keep_alive = False
                return True
            return None

        # ------------------------------------------------------------ deadlines

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._tcp:
                guard.forget(self)
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or bool(self.cycle.response_complete)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(guard.request_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                guard.shed(
                    f"closed connections that sent no whole request within {guard.request_timeout:g} s"
                )
                self.transport.abort()

    return GuardedProtocol
