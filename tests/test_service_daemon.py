"""The daemon's life: one per root, socket permissions, TCP safety, restarts, signals, budget,
config preloads and settings errors.

What only a real ``shmcache serve`` can show (the Unix socket and its peer check, the pid-file
lock, signals, kill -9 and restart, a real TCP port) runs it as a subprocess and is marked
``integration``; the rest drives the app in this process (``TestClient(create_app(...))``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx
from service_helpers import (
    Daemon,
    app_client,
    clean_env,
    disk_usage,
    load,
    running_daemon,
    serve_command,
    temporary_root,
    unique,
    wait_for,
    wait_job,
    write_big_npy,
)
from shmcache.service import SettingsError, load_settings
from source_times import age
from typer.testing import CliRunner

import shmcache
from shmcache._disk.layout import ENV_TOKEN, Layout

TOKEN = "s3cret-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def daemon_args(data_dir: Path) -> tuple[str, ...]:
    """The module's shared daemon also listens on loopback TCP (a real port) with a token."""
    return ("--host", "127.0.0.1", "--port", "0", "--allow-source", str(data_dir))


@pytest.fixture(scope="module")
def daemon_env() -> dict[str, str]:
    return {ENV_TOKEN: TOKEN}


@pytest.fixture
def data(data_dir: Path) -> Path:
    """This test's own directory of sources (under the module's ``data_dir``)."""
    path = data_dir / unique("case")
    path.mkdir()
    return path


def serve_once(root: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``shmcache serve`` that is expected to exit at once (refused)."""
    return subprocess.run(
        serve_command(root, *args), capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def entry_keys(client: httpx.Client) -> list[str]:
    return [e["key"] for e in client.get("/v1/entries").json()]


# ---------------------------------------------------------------------- a real daemon


@pytest.mark.integration
def test_socket_is_private_and_a_second_daemon_is_refused(daemon: Daemon) -> None:
    layout = Layout(daemon.root)
    assert daemon.socket_path == layout.socket
    mode = os.stat(layout.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.root).st_mode) == 0o700
    assert layout.pid_file.read_text().strip() == str(daemon.pid)
    second = serve_once(daemon.root)
    assert second.returncode == 1
    assert f"pid {daemon.pid}" in second.stderr and "already serves" in second.stderr
    assert f"kill -TERM {daemon.pid}" in second.stderr  # the command to run, not a template
    with daemon.client() as client:  # the first one is unharmed
        assert client.get("/v1/health").json()["pid"] == daemon.pid
    assert layout.socket.exists() and layout.pid_file.read_text().strip() == str(daemon.pid)
    # A clean stop removes the socket and the pid file: test_sigterm_cancels_running_loads...


@pytest.mark.integration
def test_socket_elsewhere_is_not_taken_from_a_live_daemon(root: Path, data: Path) -> None:
    sock = data / "run" / "shmcache.sock"
    with running_daemon(root, "--socket", str(sock)) as daemon:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and not Layout(root).socket.exists()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as client:
            assert client.get("/v1/health").json()["pid"] == daemon.pid
        with temporary_root() as other_root:
            other = serve_once(other_root, "--socket", str(sock))
            assert other.returncode == 1 and "another daemon listens on" in other.stderr
        assert sock.exists()  # left alone
    assert not sock.exists()


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_peers_of_another_uid_are_dropped(daemon: Daemon) -> None:
    os.chmod(daemon.root, 0o711)  # only the SO_PEERCRED check stands in the way now
    os.chmod(daemon.socket_path, 0o666)
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - child process
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(10)
                    sock.connect(str(daemon.socket_path))
                    code = 2  # connected: the daemon must hang up without answering
                    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                    code = 0 if sock.recv(1024) == b"" else 3
            except OSError:
                code = 0 if code == 2 else 4  # reset by the daemon is fine too
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # the log line is read by another thread: it may come a moment after the hang-up
        wait_for(lambda: "refused a connection" in daemon.log, 10, "the refusal in the daemon's log")
        assert "uid 65534" in daemon.log
    finally:
        os.chmod(daemon.root, 0o700)
        os.chmod(daemon.socket_path, 0o600)
    with daemon.client() as client:
        assert client.get("/v1/health").status_code == 200


@pytest.mark.integration
def test_kill_9_mid_load_then_restart_leaves_nothing_partial(root: Path, data: Path) -> None:
    layout = Layout(root)
    size = 512 << 20
    source = data / "big.npy"
    write_big_npy(source, size)
    fd = os.open(source, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)  # really allocated: the copy takes real memory
    finally:
        os.close(fd)
    daemon = Daemon(root, "--max-load-rate", "256MiB").wait_ready()
    try:
        with daemon.client() as client:
            job = client.put("/v1/entries/big", json={"source": str(source)}).json()
            wait_for(lambda: disk_usage(layout.tmp) >= 64 << 20, what="a partial copy of 64 MiB")
            daemon.signal(signal.SIGKILL)
            daemon.wait_exit()
    finally:
        daemon.signal(signal.SIGKILL)
    assert layout.socket.exists() and layout.pid_file.exists()  # stale

    with running_daemon(root) as again, again.client() as client:
        assert client.get("/v1/entries/big").status_code == 404
        assert client.get("/v1/stats").json()["entries"] == 0
        assert os.listdir(layout.tmp) == [] and os.listdir(layout.objects) == []
        assert disk_usage(root) < 1 << 20  # the partial copy's memory is back
        assert "cleanup freed" in again.log
        job = load(client, "big", source)  # and the same load now works
        assert job["state"] == "done" and client.get("/v1/entries/big").json()["size"] > size


@pytest.mark.integration
def test_sigterm_cancels_running_loads_and_removes_socket(root: Path, data: Path) -> None:
    layout = Layout(root)
    source = write_big_npy(data / "slow.npy", 256 << 20)
    daemon = Daemon(root, "--max-load-rate", "64MiB").wait_ready()
    with daemon.client() as client:
        job = client.put("/v1/entries/slow", json={"source": str(source)}).json()
        wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["state"] == "running", what="the load")
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(20) == 0
    assert "cancelled" in daemon.log
    assert not layout.socket.exists() and not layout.pid_file.exists()
    assert os.listdir(layout.entries) == [] and os.listdir(layout.objects) == []
    assert os.listdir(layout.tmp) == []


@pytest.mark.integration
def test_sigterm_ends_the_daemon_even_when_a_load_cannot_be_interrupted(root: Path, data: Path) -> None:
    """A load waiting on a key lock that another process holds (60 s for loads) cannot see
    its cancellation; SIGTERM must still end the daemon within seconds, leaving nothing."""
    layout = Layout(root)
    np.save(data / "k.npy", np.arange(1000))
    holder = subprocess.Popen(  # cache() holds the key's lock while its loader runs
        [sys.executable, "-c", "import shmcache, time, numpy as np; "
         f"shmcache.Store({str(root)!r}).cache('k', lambda: (print('holding', flush=True), "
         "time.sleep(300), np.zeros(1))[2])"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        daemon = Daemon(root).wait_ready()
        with daemon.client() as client:
            job = client.put("/v1/entries/k", json={"source": str(data / "k.npy")}).json()
            # copied, then waiting for the key's lock to publish
            wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["bytes_done"] > 0, what="the copy")
        stopping = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(30) == 0
        assert time.monotonic() - stopping < 20  # the old daemon waited for the 60 s lock timeout
        assert "do not stop" in daemon.log
        assert not layout.socket.exists() and not layout.pid_file.exists()
        assert holder.poll() is None  # the other process is untouched
    finally:
        holder.kill()
        holder.wait()
    assert shmcache.Store(root).cleanup() >= 0 and os.listdir(layout.tmp) == []


@pytest.mark.integration
def test_entries_survive_a_restart_until_cleanup_on_exit(root: Path, data: Path) -> None:
    layout = Layout(root)
    np.save(data / "a.npy", np.arange(10))
    daemon = Daemon(root).wait_ready()
    with daemon.client() as client:
        assert load(client, "a", data / "a.npy")["state"] == "done"
    daemon.signal(signal.SIGINT)  # Ctrl-C: a clean stop that keeps the entries
    assert daemon.wait_exit(20) == 0
    assert os.listdir(layout.entries) != []

    daemon = Daemon(root, "--cleanup-on-exit").wait_ready()
    with daemon.client() as client:
        assert entry_keys(client) == ["a"]
    daemon.signal(signal.SIGINT)
    assert daemon.wait_exit(20) == 0
    assert os.listdir(layout.entries) == [] and os.listdir(layout.objects) == []
    assert "evicted 1 entries" in daemon.log


@pytest.mark.integration
def test_tcp_token_on_a_real_port(daemon: Daemon) -> None:
    assert daemon.tcp_url is not None and daemon.tcp_url.startswith("http://127.0.0.1:")
    with httpx.Client(base_url=daemon.tcp_url) as tcp:
        response = tcp.get("/v1/stats")
        assert response.status_code == 401 and response.json()["error"] == "UnauthorizedError"
        assert response.headers["www-authenticate"] == "Bearer"
        assert tcp.get("/v1/stats", headers=BEARER).status_code == 200
        rebound = tcp.get("/v1/stats", headers={**BEARER, "Host": "evil.example"})  # even with the token
        assert rebound.status_code == 421 and rebound.json()["error"] == "MisdirectedRequestError"
    with daemon.client() as local:  # the Unix socket authenticates by uid instead
        assert local.get("/v1/stats").status_code == 200
        assert local.get("/v1/stats", headers={"Host": "evil.example"}).status_code == 200  # no Host check


def peak_rss_mib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def raw_exchange(path: Path, head: bytes, body: Iterator[bytes], timeout: float = 30) -> bytes:
    """Send ``head`` and as much of ``body`` as the daemon takes on its Unix socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may answer and close early
            sock.sendall(head)
            for chunk in body:
                sock.sendall(chunk)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                answer += chunk
        return answer


@pytest.mark.integration
def test_a_300_mb_request_is_refused_unread(daemon: Daemon) -> None:
    """A 300 MB ``source`` (declared or chunked) is a short 413 at once: the daemon does not
    buffer it (peak memory), echo it or log it."""
    size, megabyte = 300_000_000, b"a" * (1 << 20)
    start = b'{"source": "/'
    put = b"PUT /v1/entries/huge HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
    peak, logged = peak_rss_mib(daemon.pid), len(daemon.log)

    def body() -> Iterator[bytes]:
        yield start
        for _ in range(size // len(megabyte)):
            yield megabyte
        yield b'"}'

    declared = put + f"content-length: {len(start) + size + 2}\r\n\r\n".encode()
    chunked = put + b"transfer-encoding: chunked\r\n\r\n"
    framed = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in body())
    for head, chunks in ((declared, body()), (chunked, framed)):
        answer = raw_exchange(daemon.socket_path, head, chunks)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert len(answer) < 1000 and b"PayloadTooLargeError" in answer
    assert peak_rss_mib(daemon.pid) < peak + 64
    assert len(daemon.log) - logged < 500, daemon.log[logged:][:500]
    with daemon.client() as client:
        assert client.get("/v1/health").status_code == 200


def soft_nofile(pid: int) -> int:
    """The process's soft descriptor limit, as /proc reports it."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no descriptor limit for pid {pid}")


def closed_by_daemon(sock: socket.socket, deadline: float) -> bool:
    """Whether the daemon closes ``sock`` (after any answer) before ``deadline`` (monotonic)."""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


@pytest.mark.integration
def test_idle_tcp_connections_do_not_lock_out_the_socket_or_token_holders(root: Path, data: Path) -> None:
    """Started under a descriptor limit of 64 (hard 256), the daemon raises it to 256, keeps at
    most a quarter for TCP, and 600 TCP connections that never send a request neither keep the
    Unix socket nor a token holder waiting: the longest-waiting one makes room, the rest are
    closed after --request-timeout, and the log says so."""
    timeout = 2.0
    tcp = ("--host", "127.0.0.1", "--port", "0", "--allow-source", str(data))
    args = (*tcp, "--request-timeout", str(timeout))
    with running_daemon(root, *args, env={ENV_TOKEN: TOKEN}, nofile=(64, 256)) as daemon:
        assert daemon.tcp_url is not None
        url = urlsplit(daemon.tcp_url)
        idle: list[socket.socket] = []
        try:
            for _ in range(600):
                idle.append(socket.create_connection((url.hostname, url.port), timeout=5))
            with daemon.client(timeout=5) as local:
                assert local.get("/v1/health").status_code == 200
            with httpx.Client(base_url=daemon.tcp_url, timeout=5) as tcp:
                assert tcp.get("/v1/stats", headers=BEARER).status_code == 200
            deadline = time.monotonic() + timeout + 5
            assert all(closed_by_daemon(sock, deadline) for sock in idle)
            wait_for(lambda: "shedding load" in daemon.log, what="the log line about shed connections")
        finally:
            for sock in idle:
                sock.close()
        assert "waiting longest for a request" in daemon.log and "no whole request within 2 s" in daemon.log
        assert "at most 64 TCP connections" in daemon.log
        assert soft_nofile(daemon.pid) == 256


@pytest.mark.integration
def test_slow_or_oversized_request_heads_are_cut_off(root: Path, data: Path) -> None:
    """A head sent a byte at a time is closed at --request-timeout however it trickles, and a
    head over 64 KiB is a short 431 (not buffered: a 1 MiB URL); whole requests still work."""
    with running_daemon(root, "--allow-source", str(data), "--request-timeout", "1") as daemon:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
            slow.connect(str(daemon.socket_path))
            started = time.monotonic()
            slow.sendall(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n")
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while time.monotonic() - started < 5:
                    slow.sendall(b"X")  # a header that never ends
                    time.sleep(0.2)
            assert closed_by_daemon(slow, started + 5) and time.monotonic() - started < 3
        huge = b"GET /v1/entries/" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: localhost\r\n\r\n"
        answer = raw_exchange(daemon.socket_path, huge, iter(()))
        assert answer.startswith(b"HTTP/1.1 431 ") and b"RequestHeadTooLargeError" in answer, answer[:200]
        assert len(answer) < 1000
        with daemon.client() as client:
            assert client.get("/v1/health").status_code == 200
        wait_for(lambda: "refused request heads over 65536 bytes" in daemon.log, what="the 431 logged")


@pytest.mark.integration
def test_a_settings_error_exits_2_before_serving(root: Path, tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("max_byte = 5\n")
    result = serve_once(root, "--config", str(typo))
    assert result.returncode == 2 and "unknown setting(s) max_byte" in result.stderr
    assert "Traceback" not in result.stderr
    assert not Layout(root).socket.exists() and not Layout(root).pid_file.exists()


# ---------------------------------------------------------------------- the app in this process


def test_budget_evicts_least_recently_used_unpinned_entries(root: Path, data: Path) -> None:
    for name in "abcd":
        np.save(data / f"{name}.npy", np.zeros(1 << 20, dtype=np.uint8))  # 1 MiB each
    with app_client(root, max_bytes="3.5MiB") as client:
        assert client.get("/v1/stats").json()["budget"] == int(3.5 * (1 << 20))
        assert load(client, "a", data / "a.npy", pin=True)["state"] == "done"
        assert load(client, "b", data / "b.npy")["state"] == "done"
        assert load(client, "c", data / "c.npy")["state"] == "done"
        assert load(client, "d", data / "d.npy")["state"] == "done"  # evicts b, the oldest unpinned
        assert entry_keys(client) == ["a", "c", "d"]
        too_big = write_big_npy(data / "too_big.npy", 4 << 20)
        response = client.put("/v1/entries/too_big", json={"source": str(too_big)})
        assert response.status_code == 507 and response.json()["error"] == "CacheFullError"


def test_tcp_token_is_checked_on_every_request(root: Path, data: Path) -> None:
    """Over TCP (not the Unix socket) every request needs ``Authorization: Bearer <token>``."""
    with app_client(root, host="127.0.0.1", port=0, allow_source=[data], env={ENV_TOKEN: TOKEN}) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            response = client.get("/v1/stats", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"] == "UnauthorizedError"
            assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/stats", headers=BEARER).status_code == 200
        assert client.get("/openapi.json").status_code == 401
        schema = client.get("/openapi.json", headers=BEARER).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_tcp_host_header_must_name_this_machine(root: Path, data: Path) -> None:
    """On loopback TCP (here without a token, as DNS rebinding finds it) the Host header must be
    a loopback name or an --allow-host one, with or without port; anything else is 421."""
    foreign = ("evil.example", "evil.example:8765", "127.0.0.1.evil.example", "localhost.evil:80", "[::2]:1")
    with app_client(root, host="127.0.0.1", port=0, allow_source=[data]) as client:
        for host in (
            "localhost",
            "localhost:8765",
            "127.0.0.1",
            "127.0.0.1:8765",
            "[::1]:8765",
            "LocalHost.",
        ):
            assert client.get("/v1/stats", headers={"Host": host}).status_code == 200, host
        for host in (*foreign, "cache.example:8765"):
            response = client.get("/v1/stats", headers={"Host": host})
            assert response.status_code == 421, host
            assert (
                response.json()["error"] == "MisdirectedRequestError"
                and "--allow-host" in response.json()["detail"]
            )
        assert "421" in client.get("/openapi.json").json()["paths"]["/v1/stats"]["get"]["responses"]
    with app_client(
        root, host="127.0.0.1", port=0, allow_source=[data], allow_host=["Cache.Example"]
    ) as client:
        assert client.get("/v1/stats", headers={"Host": "cache.example:8765"}).status_code == 200
        assert client.get("/v1/stats", headers={"Host": "localhost:8765"}).status_code == 200
        assert client.get("/v1/stats", headers={"Host": "evil.example:8765"}).status_code == 421
    with app_client(root) as client:  # no TCP: the Host of an in-process or socket request is not checked
        assert client.get("/v1/stats", headers={"Host": "evil.example"}).status_code == 200


def test_config_file_preloads_datasets_and_flags_override_it(
    root: Path, data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shmcache.service")
    np.save(data / "labels.npy", np.arange(100))
    (data / "feats").mkdir()
    np.save(data / "feats" / "x.npy", np.ones((4, 4)))
    config = data / "shmcache.toml"
    config.write_text(
        f'root = "{root}"\nmax_bytes = "1GiB"\nallow_source = ["{data}"]\n\n'
        '[[datasets]]\nkey = "labels"\nsource = "labels.npy"\npin = true\n\n'
        '[[datasets]]\nkey = "feats"\nsource = "feats"\n'
    )
    age(data / "labels.npy", data / "feats")  # else racily clean: loaded again at the next start
    with app_client(root, config_file=config, max_bytes="2GiB") as client:
        assert client.get("/v1/stats").json()["budget"] == 2 << 30  # the flag wins
        jobs = client.get("/v1/jobs").json()
        assert len(jobs) == 2
        for job in jobs:
            assert wait_job(client, job["id"])["state"] == "done"
        entries = {e["key"]: e for e in client.get("/v1/entries").json()}
        assert set(entries) == {"labels", "feats/x"} and entries["labels"]["pinned"]
    caplog.clear()
    with app_client(root, config_file=config) as client:
        assert client.get("/v1/jobs").json() == []  # unchanged sources are not loaded again
        assert caplog.text.count("unchanged since it was loaded") == 2
        assert client.get("/v1/stats").json()["budget"] == 1 << 30


@pytest.mark.parametrize(
    ("flags", "config", "message"),
    [
        ({}, 'max_bytes = "lots"\n', "max_bytes"),
        ({}, "max_byte = 5\n", "unknown setting(s) max_byte"),
        ({"max_bytes": "1G", "max_fraction": 0.5}, None, "not both"),
        ({"host": "0.0.0.0", "port": 0}, None, "--token"),
        ({"host": "0.0.0.0", "port": 0, "token": TOKEN}, None, "--allow-source"),
    ],
    ids=["bad-size", "unknown-key", "two-budgets", "public-tcp-no-token", "public-tcp-no-dirs"],
)
def test_bad_settings_are_refused(
    root: Path, tmp_path: Path, flags: dict[str, object], config: str | None, message: str
) -> None:
    config_file = None
    if config is not None:
        config_file = tmp_path / "shmcache.toml"
        config_file.write_text(config)
    with pytest.raises(SettingsError) as caught:
        load_settings({"root": root, **flags}, env={}, config_file=config_file)
    assert message in str(caught.value)
    assert not root.exists()  # refused before anything was created


def test_serve_help_lists_every_option() -> None:
    from shmcache.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    for option in (
        "--root",
        "--socket",
        "--max-bytes",
        "--max-fraction",
        "--config",
        "--host",
        "--port",
        "--token",
        "--allow-host",
        "--allow-source",
        "--cleanup-on-exit",
        "--load-workers",
        "--max-load-rate",
        "--request-timeout",
        "--log-level",
    ):
        assert option in out, option
    assert "SHMCACHE_TOKEN" in out and "shmcache[service]" in out  # brackets survive rich markup
