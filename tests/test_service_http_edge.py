"""The daemon's HTTP edge, byte for byte, on a real ``shmcache serve`` over both transports:
request heads over 64 KiB get 431 however they are cut into reads, every parser error is
the JSON error body, bodies are strict (no ``"pin": "yes"``).

The requests are raw bytes on a socket, so the tests choose the read boundaries: one
``sendall`` of a whole request (one read by the daemon on a Unix socket), pieces sent
apart, several requests in one send (pipelined)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import Daemon, unique

pytestmark = pytest.mark.integration

LIMIT = 64 << 10
HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n"
Response = tuple[int, dict[str, str], bytes]


@pytest.fixture(scope="module")
def daemon_args(data_dir: Path) -> tuple[str, ...]:
    """The module's daemon also listens on loopback TCP (no token: the Host check only)."""
    return ("--allow-source", str(data_dir), "--host", "127.0.0.1", "--port", "0")


@pytest.fixture(params=["unix", "tcp"])
def address(request: pytest.FixtureRequest, daemon: Daemon) -> str | tuple[str, int]:
    if request.param == "unix":
        return str(daemon.socket_path)
    assert daemon.tcp_url is not None
    url = urlsplit(daemon.tcp_url)
    assert url.hostname is not None and url.port is not None
    return (url.hostname, url.port)


def exchange(
    address: str | tuple[str, int], pieces: list[bytes], pause: float = 0.0, half_close: bool = False
) -> list[Response]:
    """Send ``pieces`` (``pause`` seconds apart: separate reads; then ``shutdown(SHUT_WR)`` with
    ``half_close``), then read until the daemon closes; the responses it sent, in order."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(address)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may answer and close early
            for i, piece in enumerate(pieces):
                if i and pause:
                    time.sleep(pause)
                sock.sendall(piece)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        raw = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                raw += chunk
    return parse_responses(raw)


def parse_responses(raw: bytes) -> list[Response]:
    """HTTP/1.1 responses with a Content-Length, one after another."""
    found = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"incomplete response: {raw[:300]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        found.append((int(lines[0].split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return found


def head_of(size: int, *, close: bool = True) -> bytes:
    """A ``GET /v1/health`` whose request line and headers are exactly ``size`` bytes."""
    start = HEALTH + (b"Connection: close\r\n" if close else b"") + b"X-Pad: "
    pad = size - len(start) - 4
    assert pad >= 0
    head = start + b"p" * pad + b"\r\n\r\n"
    assert len(head) == size
    return head


def error_of(response: Response) -> dict[str, Any]:
    """The JSON error body of ``response`` (asserting it is one)."""
    status, headers, body = response
    assert headers["content-type"] == "application/json", (status, headers, body[:200])
    error: dict[str, Any] = json.loads(body)
    assert set(error) == {"error", "detail"} and error["detail"], error
    return error


def pieces_of(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


# ---------------------------------------------------------------------- 431


@pytest.mark.parametrize(
    "split",
    ["one read", "4 KiB reads", "at the limit", "blank line apart"],
)
def test_heads_over_64_kib_get_431_whatever_the_read_boundaries(address: Any, split: str) -> None:
    """A head of exactly 64 KiB is served, one byte more is 431 (and 70 KB, 200 KB), sent in
    one piece (before the fix: 200 for a head that came in one read), in 4 KiB pieces, cut
    just before the limit, or with its final blank line sent apart."""
    for size, expected in ((LIMIT, 200), (LIMIT + 1, 431), (70_000, 431), (200_000, 431)):
        head = head_of(size)
        if split == "one read":
            pieces = [head]
        elif split == "4 KiB reads":
            pieces = pieces_of(head, 4096)
        elif split == "at the limit":
            pieces = [head[: LIMIT - 1], head[LIMIT - 1 :]]
        else:
            pieces = [head[:-2], head[-2:]]
        answers = exchange(address, pieces, pause=0.002 if split != "one read" else 0.0)
        assert [status for status, _, _ in answers] == [expected], (size, split, answers)
        if expected == 431:
            assert error_of(answers[0])["error"] == "RequestHeadTooLargeError"
            assert answers[0][1]["connection"] == "close"


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    size=st.integers(LIMIT - 40, LIMIT + 40),
    cuts=st.lists(st.floats(0, 1, exclude_max=True), max_size=4),
)
def test_the_limit_is_exact_at_any_cut(address: Any, size: int, cuts: list[float]) -> None:
    """Heads around the limit, cut at random places into up to five pieces sent apart:
    served up to 64 KiB exactly, 431 from one byte more."""
    head = head_of(size)
    points = sorted({int(cut * size) for cut in cuts} - {0})
    pieces = [head[a:b] for a, b in zip([0, *points], [*points, size], strict=True)]
    answers = exchange(address, pieces, pause=0.002)
    assert [status for status, _, _ in answers] == [200 if size <= LIMIT else 431], (size, points)


def test_a_pipelined_oversized_head_is_431_after_the_answers_before_it(address: Any) -> None:
    """Requests sent in one piece (the last one's head starts in the middle of a read): the
    earlier ones are answered in order, then the 431, then the connection is closed. Such a
    head is measured by its parsed parts, which leave out the space after each header's
    colon: at most 3 bytes short here."""
    small = HEALTH + b"\r\n"
    body = b'{"source": "/nowhere.npy"}'
    put = (
        b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    for big in (head_of(70_000, close=False), head_of(200_000, close=False), head_of(LIMIT + 4)):
        answers = exchange(address, [small + put + big])
        assert [status for status, _, _ in answers] == [200, 400, 431], answers
        assert error_of(answers[2])["error"] == "RequestHeadTooLargeError"
    answers = exchange(address, [small + head_of(LIMIT)])
    assert [status for status, _, _ in answers] == [200, 200]


def test_a_head_that_never_ends_is_cut_at_64_kib(daemon: Daemon) -> None:
    """An endless header in 1 KiB pieces: 431 once 64 KiB have come, not buffered on."""
    head = HEALTH + b"X-Pad: " + b"p" * (LIMIT + 4096)
    answers = exchange(str(daemon.socket_path), pieces_of(head, 1024), pause=0.001)
    assert len(answers) == 1 and answers[0][0] == 431


# ---------------------------------------------------------------------- parser errors as JSON

MALFORMED = {
    "request line": b"G@T /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "version": b"GET /v1/health HTTP/1.1x\r\nHost: localhost\r\n\r\n",
    "non-ASCII target": b"GET /v1/entries/\xc3\xa9 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "header name": b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nBad Header: x\r\n\r\n",
    "bare LF": b"GET /v1/health HTTP/1.1\nHost: localhost\n\n",
    "Content-Length": b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n",
    "two Content-Lengths": b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",
    "Content-Length and chunked": b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunk size": b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "chunk framing": b"PUT /v1/entries/k HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_requests_get_the_json_error_body(address: Any, kind: str) -> None:
    """Each kind (before the fix: uvicorn's plain-text "Invalid HTTP request received.") is a
    400 with ``{"error": "InvalidRequestError", "detail": ...}`` saying what was wrong; the
    connection is closed, and the daemon serves the next one."""
    answers = exchange(address, [MALFORMED[kind]])
    assert len(answers) == 1 and answers[0][0] == 400, answers
    error = error_of(answers[0])
    assert error["error"] == "InvalidRequestError" and "malformed" in error["detail"], error
    assert answers[0][1]["connection"] == "close"
    assert [status for status, _, _ in exchange(address, [HEALTH + b"Connection: close\r\n\r\n"])] == [200]


def test_a_malformed_request_after_good_ones_is_answered_in_order(daemon: Daemon) -> None:
    good = HEALTH + b"\r\n"
    answers = exchange(str(daemon.socket_path), [good + good + MALFORMED["header name"]])
    assert [status for status, _, _ in answers] == [200, 200, 400]
    assert error_of(answers[2])["error"] == "InvalidRequestError"


def test_bodies_that_are_not_utf8_json_get_422_with_what_is_wrong(daemon: Daemon) -> None:
    with daemon.client() as client:
        for body, expected in (
            (b'{"source": "/x\xff.npy"}', "not valid UTF-8 (byte 0xff at position 14)"),
            (b'{"source": "/x.npy",}', "not valid JSON at character"),
        ):
            response = client.put(
                f"/v1/entries/{unique('k')}", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 422, response.text
            error = response.json()
            assert error["error"] == "InvalidRequestError" and expected in error["detail"], error


def test_an_upgrade_request_is_answered_plainly_and_the_connection_closed(address: Any) -> None:
    for upgrade in (b"websocket", b"h2c"):
        request = HEALTH + b"Connection: upgrade\r\nUpgrade: " + upgrade + b"\r\n\r\n"
        started = time.monotonic()
        answers = exchange(address, [request + HEALTH + b"\r\n"])  # the second is never read
        assert [status for status, _, _ in answers] == [200]
        assert answers[0][1]["connection"] == "close" and time.monotonic() - started < 4  # not kept alive


# ---------------------------------------------------------------------- strict bodies


@pytest.mark.parametrize(
    "field",
    [
        {"pin": "yes"},
        {"pin": 1},
        {"pin": "true"},
        {"pin": None},
        {"overwrite": 0},
        {"overwrite": "false"},
        {"source": 5},
        {"as": True},
        {"pinned": True},
    ],
    ids=repr,
)
def test_load_bodies_are_strict(daemon: Daemon, data_dir: Path, field: dict[str, Any]) -> None:
    """``"pin": "yes"`` was taken as true; now any value of another JSON type is a 422 naming
    the field, and nothing is loaded."""
    np.save(data_dir / "strict.npy", np.arange(4))
    key = unique("strict")
    with daemon.client() as client:
        response = client.put(f"/v1/entries/{key}", json={"source": str(data_dir / "strict.npy"), **field})
        assert response.status_code == 422, response.text
        error = response.json()
        assert error["error"] == "InvalidRequestError" and next(iter(field)) in error["detail"], error
        assert client.get(f"/v1/entries/{key}").status_code == 404
        assert all(job["key"] != key for job in client.get("/v1/jobs").json())


def test_a_client_that_half_closes_after_its_request_gets_the_answer(address: Any, data_dir: Path) -> None:
    """Before: uvicorn closed the connection on the client's EOF, before a route that takes a
    moment (a thread) had answered: no answer at all."""
    body = json.dumps({"source": str(data_dir / "absent.npy")}).encode()
    put = (
        b"PUT /v1/entries/%s HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (unique("half").encode(), len(body), body)
    )
    for request in (put, HEALTH + b"\r\n"):
        answers = exchange(address, [request], half_close=True)  # returns once the daemon closed
        assert len(answers) == 1 and answers[0][0] in (200, 400), answers


def test_unknown_query_parameters_are_refused(daemon: Daemon) -> None:
    """``?prefx=a`` listed every entry as if no prefix had been given; now a 422 naming it."""
    with daemon.client() as client:
        for url, name in (("/v1/entries?prefx=a", "prefx"), ("/v1/health?verbose=1", "verbose")):
            response = client.get(url)
            assert response.status_code == 422, response.text
            error = response.json()
            assert error["error"] == "InvalidRequestError" and f"query.{name}: unknown" in error["detail"]
        assert client.get("/v1/entries?prefix=a").status_code == 200


def test_the_edge_logs_no_traceback(daemon: Daemon) -> None:
    """Everything above was answered without an exception in the daemon."""
    assert "Traceback" not in daemon.log and "Exception in ASGI" not in daemon.log, daemon.log[-2000:]
