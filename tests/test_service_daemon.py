"""The daemon's life: one per root, socket permissions, TCP safety, restarts, signals, budget."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from service_helpers import (
    Daemon,
    disk_usage,
    load,
    running_daemon,
    serve_command,
    temporary_root,
    wait_for,
    wait_job,
    write_big_npy,
)

pytest.importorskip("fastapi")

TOKEN = "s3cret-token-0123456789"


@pytest.fixture
def root() -> Iterator[Path]:
    with temporary_root() as path:
        yield path


@pytest.fixture
def data() -> Iterator[Path]:
    """A source directory on the tmpfs when there is one (fast, like the cache)."""
    with temporary_root() as path:
        path.mkdir()
        yield path


def serve_once(root: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCACHE_")}
    return subprocess.run(
        serve_command(root, *args), capture_output=True, text=True, timeout=timeout, env=env
    )


def test_socket_is_private_and_a_second_daemon_is_refused(root: Path) -> None:
    with running_daemon(root) as daemon:
        mode = os.stat(daemon.socket_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert (root / "daemon.pid").read_text().strip() == str(daemon.pid)
        second = serve_once(root)
        assert second.returncode == 1
        assert f"pid {daemon.pid}" in second.stderr and "already serves" in second.stderr
        with daemon.client() as client:  # the first one is unharmed
            assert client.get("/v1/health").status_code == 200
        assert daemon.stop() == 0
    assert not (root / "daemon.sock").exists() and not (root / "daemon.pid").exists()


def test_socket_elsewhere_is_not_taken_from_a_live_daemon(root: Path, data: Path) -> None:
    sock = data / "run" / "shmcache.sock"
    with running_daemon(root, "--socket", str(sock)) as daemon:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and not (root / "daemon.sock").exists()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as client:
            assert client.get("/v1/health").json()["pid"] == daemon.pid
        with temporary_root() as other_root:
            other = serve_once(other_root, "--socket", str(sock))
            assert other.returncode == 1 and "another daemon listens on" in other.stderr
        assert sock.exists()  # left alone
    assert not sock.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_peers_of_another_uid_are_dropped(root: Path) -> None:
    with running_daemon(root) as daemon:
        os.chmod(root, 0o711)  # only the SO_PEERCRED check stands in the way now
        os.chmod(daemon.socket_path, 0o666)
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
        assert "refused a connection" in daemon.log and "uid 65534" in daemon.log
        os.chmod(root, 0o700)
        with daemon.client() as client:
            assert client.get("/v1/health").status_code == 200


def test_kill_9_mid_load_then_restart_leaves_nothing_partial(root: Path, data: Path) -> None:
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
            wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["bytes_done"] > 0, what="the load")
            assert disk_usage(root / "tmp") >= 64 << 20  # a partial copy exists
            daemon.signal(signal.SIGKILL)
            daemon.wait_exit()
    finally:
        daemon.signal(signal.SIGKILL)
    assert (root / "daemon.sock").exists() and (root / "daemon.pid").exists()  # stale

    with running_daemon(root) as again, again.client() as client:
        assert client.get("/v1/entries/big").status_code == 404
        assert client.get("/v1/stats").json()["entries"] == 0
        assert os.listdir(root / "tmp") == [] and os.listdir(root / "objects") == []
        assert disk_usage(root) < 1 << 20  # the partial copy's memory is back
        assert "cleanup freed" in again.log
        job = load(client, "big", source)  # and the same load now works
        assert job["state"] == "done" and client.get("/v1/entries/big").json()["size"] > size


def test_sigterm_cancels_running_loads_and_removes_socket(root: Path, data: Path) -> None:
    source = write_big_npy(data / "slow.npy", 256 << 20)
    daemon = Daemon(root, "--max-load-rate", "64MiB").wait_ready()
    with daemon.client() as client:
        job = client.put("/v1/entries/slow", json={"source": str(source)}).json()
        wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["state"] == "running", what="the load")
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(20) == 0
    assert "cancelled" in daemon.log
    assert not (root / "daemon.sock").exists() and not (root / "daemon.pid").exists()
    assert os.listdir(root / "entries") == [] and os.listdir(root / "objects") == []
    assert os.listdir(root / "tmp") == []


def test_cleanup_on_exit_evicts_everything(root: Path, data: Path) -> None:
    np.save(data / "a.npy", np.arange(10))
    daemon = Daemon(root, "--cleanup-on-exit").wait_ready()
    with daemon.client() as client:
        assert load(client, "a", data / "a.npy")["state"] == "done"
    assert os.listdir(root / "entries") != []
    daemon.signal(signal.SIGINT)
    assert daemon.wait_exit(20) == 0
    assert os.listdir(root / "entries") == [] and os.listdir(root / "objects") == []
    assert "evicted 1 entries" in daemon.log


def test_entries_survive_a_restart(root: Path, data: Path) -> None:
    np.save(data / "a.npy", np.arange(10))
    with running_daemon(root) as daemon, daemon.client() as client:
        assert load(client, "a", data / "a.npy")["state"] == "done"
    with running_daemon(root) as daemon, daemon.client() as client:
        assert [e["key"] for e in client.get("/v1/entries").json()] == ["a"]


def test_budget_evicts_least_recently_used_unpinned_entries(root: Path, data: Path) -> None:
    for name in "abcd":
        np.save(data / f"{name}.npy", np.zeros(1 << 20, dtype=np.uint8))  # 1 MiB each
    with running_daemon(root, "--max-bytes", "3.5MiB") as daemon, daemon.client() as client:
        assert client.get("/v1/stats").json()["budget"] == int(3.5 * (1 << 20))
        assert load(client, "a", data / "a.npy", pin=True)["state"] == "done"
        assert load(client, "b", data / "b.npy")["state"] == "done"
        assert load(client, "c", data / "c.npy")["state"] == "done"
        assert load(client, "d", data / "d.npy")["state"] == "done"  # evicts b, the oldest unpinned
        assert [e["key"] for e in client.get("/v1/entries").json()] == ["a", "c", "d"]
        too_big = write_big_npy(data / "too_big.npy", 4 << 20)
        response = client.put("/v1/entries/too_big", json={"source": str(too_big)})
        assert response.status_code == 507 and response.json()["error"] == "CacheFullError"


def test_tcp_on_a_public_address_needs_a_token_and_allowed_sources(root: Path, data: Path) -> None:
    refused = serve_once(root, "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2 and "--token" in refused.stderr
    no_dirs = serve_once(root, "--host", "0.0.0.0", "--port", "0", "--token", TOKEN)
    assert no_dirs.returncode == 2 and "--allow-source" in no_dirs.stderr
    assert not (root / "daemon.sock").exists()


def test_tcp_token_is_checked_on_loopback_too(root: Path, data: Path) -> None:
    with running_daemon(
        root, "--host", "127.0.0.1", "--port", "0", "--allow-source", str(data), env={"SHMCACHE_TOKEN": TOKEN}
    ) as daemon:
        assert daemon.tcp_url is not None and daemon.tcp_url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=daemon.tcp_url) as tcp:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
                response = tcp.get("/v1/stats", headers=headers)
                assert response.status_code == 401, headers
                assert response.json()["error"] == "UnauthorizedError"
                assert response.headers["www-authenticate"] == "Bearer"
            ok = tcp.get("/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200
            schema = tcp.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        with daemon.client() as local:  # the Unix socket authenticates by uid instead
            assert local.get("/v1/stats").status_code == 200


def test_config_file_preloads_datasets_and_flags_override_it(root: Path, data: Path) -> None:
    np.save(data / "labels.npy", np.arange(100))
    (data / "feats").mkdir()
    np.save(data / "feats" / "x.npy", np.ones((4, 4)))
    config = data / "shmcache.toml"
    config.write_text(
        f'root = "{root}"\nmax_bytes = "1GiB"\nallow_source = ["{data}"]\n\n'
        '[[datasets]]\nkey = "labels"\nsource = "labels.npy"\npin = true\n\n'
        '[[datasets]]\nkey = "feats"\nsource = "feats"\n'
    )
    with (
        running_daemon(root, "--config", str(config), "--max-bytes", "2GiB") as daemon,
        daemon.client() as client,
    ):
        assert client.get("/v1/stats").json()["budget"] == 2 << 30  # the flag wins
        for job in client.get("/v1/jobs").json():
            assert wait_job(client, job["id"])["state"] == "done"
        entries = {e["key"]: e for e in client.get("/v1/entries").json()}
        assert set(entries) == {"labels", "feats/x"} and entries["labels"]["pinned"]
    with running_daemon(root, "--config", str(config)) as daemon, daemon.client() as client:
        assert client.get("/v1/jobs").json() == []  # unchanged sources are not loaded again
        assert daemon.log.count("unchanged since it was loaded") == 2
        assert client.get("/v1/stats").json()["budget"] == 1 << 30


def test_bad_settings_are_usage_errors(root: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('max_bytes = "lots"\n')
    result = serve_once(root, "--config", str(bad))
    assert result.returncode == 2 and "max_bytes" in result.stderr
    typo = tmp_path / "typo.toml"
    typo.write_text("max_byte = 5\n")
    result = serve_once(root, "--config", str(typo))
    assert result.returncode == 2 and "unknown setting(s) max_byte" in result.stderr
    result = serve_once(root, "--max-bytes", "1G", "--max-fraction", "0.5")
    assert result.returncode == 2 and "not both" in result.stderr


def test_serve_help_lists_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from shmcache.cli import main; main()", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    for option in (
        "--root",
        "--socket",
        "--max-bytes",
        "--max-fraction",
        "--config",
        "--host",
        "--port",
        "--token",
        "--allow-source",
        "--cleanup-on-exit",
        "--load-workers",
        "--max-load-rate",
        "--log-level",
    ):
        assert option in out, option
    assert "SHMCACHE_TOKEN" in out and "shmcache[service]" in out  # brackets survive rich markup
