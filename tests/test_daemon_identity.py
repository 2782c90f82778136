"""Know who answers: the CLI and ``Client`` check, on the connected Unix socket and before
sending anything, that the process listening there runs as the root's owner
(``SO_PEERCRED``); another user's fake daemon gets nothing and its numbers are never shown.
And a daemon that is slow (not stopped) keeps its whole timeout.

The fake daemon is a plain socket server (``fake_daemon.py``), run as another user when the
tests run as root.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_helpers import cli
from service_helpers import scratch_dir, temporary_root
from shmcache.client import Client

from shmcache.errors import UntrustedDaemonError

FAKE = Path(__file__).with_name("fake_daemon.py")
OTHER_PYTHON = "/usr/bin/python3"
"""An interpreter another user can run (this one may live under root's home)."""


def _other_user() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("running a server as another user needs root")
    if not os.access(OTHER_PYTHON, os.X_OK):
        pytest.skip(f"no {OTHER_PYTHON} for the other user's server")
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


@contextmanager
def fake_daemon(
    socket_path: Path, root: Path, delay_s: float = 0.0, user: tuple[int, int] | None = None
) -> Iterator[list[int]]:
    """The fake daemon listening on ``socket_path``; yields the list that receives, once it
    stopped, the number of bytes each connection sent it."""
    python = sys.executable if user is None else OTHER_PYTHON
    process = subprocess.Popen(
        [python, str(FAKE), str(socket_path), str(root), str(delay_s)],
        stdout=subprocess.PIPE,
        text=True,
        user=None if user is None else user[0],
        group=None if user is None else user[1],
    )
    assert process.stdout is not None
    received: list[int] = []
    try:
        assert process.stdout.readline().strip() == "ready"
        yield received
    finally:
        process.kill()
        out, _ = process.communicate(timeout=30)
        received += [int(line.split()[1]) for line in out.splitlines() if line.startswith("got ")]


@pytest.fixture
def other_users_socket() -> Iterator[tuple[Path, Path, tuple[int, int]]]:
    """A root of ours, and a socket path in a directory that another user owns."""
    user = _other_user()
    with temporary_root() as root, scratch_dir("sockets") as sockets:
        root.mkdir(mode=0o700, exist_ok=True)
        os.chown(sockets, *user)
        sockets.chmod(0o755)
        yield root, sockets / "daemon.sock", user


def test_client_refuses_another_users_daemon_before_sending(
    other_users_socket: tuple[Path, Path, tuple[int, int]],
) -> None:
    root, socket_path, user = other_users_socket
    with fake_daemon(socket_path, root, user=user) as received:
        with Client(root, socket=socket_path) as client, pytest.raises(UntrustedDaemonError) as raised:
            client.health()
        with Client(root, socket=socket_path) as client, pytest.raises(UntrustedDaemonError):
            client.load("k", "/data/x.npy", overwrite=True)
        with Client(root, socket=socket_path, daemon_uids=[user[0]]) as client:
            assert client.health().version == "fake"  # the hook for a service account: it answers
    message = str(raised.value)
    assert f"uid {user[0]}" in message and "nothing was sent" in message and str(socket_path) in message
    assert isinstance(raised.value, PermissionError)
    assert received[:2] == [0, 0] and received[2] > 0  # refused: not a byte; trusted: its request


def test_cli_refuses_another_users_daemon_before_sending(
    other_users_socket: tuple[Path, Path, tuple[int, int]],
) -> None:
    root, socket_path, user = other_users_socket
    env = {"SHMCACHE_SOCKET": str(socket_path)}
    with fake_daemon(socket_path, root, user=user) as received:
        ls = cli("ls", "--root", str(root), env=env)
        stats = cli("stats", "--root", str(root), env=env)
    for code, out, err in (ls, stats):
        assert code == 1 and "666" not in out, (out, err)
        assert err.startswith("error: the process listening on") and f"uid {user[0]}" in err, err
        assert "Traceback" not in err
    assert received and set(received) == {0}  # connected, checked, closed: nothing sent


def test_doctor_fails_its_daemon_check_on_another_users_daemon(
    other_users_socket: tuple[Path, Path, tuple[int, int]],
) -> None:
    root, socket_path, user = other_users_socket
    with fake_daemon(socket_path, root, user=user) as received:
        code, out, _ = cli("doctor", "--json", "--root", str(root), "--socket", str(socket_path))
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 1 and checks["daemon"]["status"] == "fail", checks["daemon"]
    assert f"uid {user[0]}" in checks["daemon"]["summary"] and "666" not in out
    assert set(received) == {0}


def test_a_slow_daemon_of_ours_keeps_the_whole_timeout(tmp_path: Path) -> None:
    with scratch_dir("sockets") as sockets, temporary_root() as root:
        root.mkdir(mode=0o700, exist_ok=True)
        socket_path = sockets / "daemon.sock"
        with fake_daemon(socket_path, root, delay_s=4.0), Client(root, socket=socket_path) as client:
            health = client.health()  # answers after 4 s, more than a stopped daemon is given
    assert health.version == "fake" and health.root == str(root)
