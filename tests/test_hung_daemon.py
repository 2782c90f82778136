"""A daemon that lives but does not answer (stopped with SIGSTOP) is named, never bypassed.

It holds its root's pid file locked, so the CLI, ``Client`` and ``doctor`` know it lives:
within a few seconds they say that daemon pid N does not answer, and the CLI exits non-zero
instead of working on the root behind its back (``--local`` does that when asked). A dead
daemon's leftovers (an unlocked pid file, a stale socket) still mean "no daemon".
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, cli_process, save, stale_socket
from service_helpers import Daemon, running_daemon, temporary_root, unique
from shmcache.client import Client

import shmcache
from shmcache._disk.layout import Layout
from shmcache.errors import DaemonUnavailableError

pytest.importorskip("fastapi")

OLD_TIMEOUT_S = 30.0
"""What every command waited before, silently, then worked on the root directly."""
BOUND_S = 20.0
"""Generous for "a few seconds" on a loaded machine, and well under the old 30 s."""


@pytest.fixture(scope="module")
def hung(data_dir: Path) -> Iterator[Daemon]:
    """A daemon of its own (the others' tests must not see it stopped), with one entry."""
    with temporary_root() as root, running_daemon(root, "--allow-source", str(data_dir)) as running:
        with Client(root) as client:
            client.load("kept", save(data_dir / "kept.npy", np.arange(4)), wait=True)
        yield running


@contextmanager
def stopped(daemon: Daemon) -> Iterator[None]:
    """The daemon stopped by SIGSTOP (as by Ctrl+Z), resumed whatever happens."""
    daemon.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        daemon.signal(signal.SIGCONT)


def test_the_cli_names_a_stopped_daemon_and_never_works_around_it(hung: Daemon, data_dir: Path) -> None:
    key = unique("bypass")
    source = save(data_dir / f"{key}.npy", np.arange(8))
    root = str(hung.root)
    commands = {
        "put": ["put", str(source), "--key", key, "--root", root],
        "stats": ["stats", "--root", root],
        "ls": ["ls", "--root", root],
        "info": ["info", "kept", "--root", root],
        "evict": ["evict", "kept", "--root", root],
    }
    with stopped(hung):
        started = time.monotonic()
        processes = {name: cli_process(*argv) for name, argv in commands.items()}  # at once: one wait
        try:
            answers = {
                name: process.communicate(timeout=OLD_TIMEOUT_S + 30) for name, process in processes.items()
            }
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
        elapsed = time.monotonic() - started
    for name, (out, err) in answers.items():
        assert processes[name].returncode == 1, (name, out, err)
        assert f"daemon pid {hung.pid}" in err and "does not answer" in err, (name, err)
        assert f"kill -CONT {hung.pid}" in err and "--local" in err, (name, err)
        assert "Traceback" not in err and "not running" not in out, (name, out, err)
    assert elapsed < BOUND_S, f"the commands took {elapsed:.1f} s: they waited as long as before"
    with Client(hung.root) as client:  # resumed: nothing happened behind its back
        assert not shmcache.Store(hung.root).exists(key) and key not in {j.key for j in client.jobs()}
        assert client.info("kept").key == "kept"  # the evict did not go around it either


def test_local_works_on_the_root_while_the_daemon_is_stopped(hung: Daemon, data_dir: Path) -> None:
    key = unique("local")
    source = save(data_dir / f"{key}.npy", np.arange(6))
    root = str(hung.root)
    with stopped(hung):
        code, out, err = cli("put", str(source), "--key", key, "--local", "--root", root)
        assert code == 0 and out.split() == [key], err
        assert f"notice: --local on {hung.root}; loading in this process" in err
        code, out, err = cli("stats", "--local", "--root", root)
        assert code == 0 and "daemon:   not used (--local)" in out, err
        code, out, _ = cli("ls", "--local", "--json", "--root", root)
        assert code == 0 and key in {entry["key"] for entry in json.loads(out)}
        code, out, _ = cli("evict", key, "--local", "--root", root)
        assert code == 0 and out.startswith(f"evicted {key}")


def test_client_names_the_stopped_daemon(hung: Daemon) -> None:
    with stopped(hung), Client(hung.root, timeout=2) as client:
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError) as raised:
            client.list()
        elapsed = time.monotonic() - started
    message = str(raised.value)
    assert f"daemon pid {hung.pid}" in message and "does not answer" in message
    assert "stopped" in message and f"kill -CONT {hung.pid}" in message
    assert "start one with" not in message  # it lives: starting another would fail
    assert elapsed < BOUND_S


def test_client_with_its_default_timeout_names_the_stopped_daemon_within_seconds(hung: Daemon) -> None:
    with Client(hung.root) as client:  # connected while it runs: the stop lands on a live connection
        assert client.health().pid == hung.pid
        with stopped(hung):
            started = time.monotonic()
            with pytest.raises(DaemonUnavailableError) as raised:
                client.list()
            elapsed = time.monotonic() - started
    message = str(raised.value)
    assert client.timeout == OLD_TIMEOUT_S and f"kill -CONT {hung.pid}" in message and "stopped" in message
    assert f"no answer within {OLD_TIMEOUT_S:g} s" not in message, message
    assert elapsed < BOUND_S, f"Client took {elapsed:.1f} s: it waited out its {OLD_TIMEOUT_S:g} s timeout"


def test_doctor_fails_on_a_stopped_daemon(hung: Daemon) -> None:
    with stopped(hung):
        code, out, _ = cli("doctor", "--json", "--root", str(hung.root))
    daemon = {check["name"]: check for check in json.loads(out)["checks"]}["daemon"]
    assert code == 1 and daemon["status"] == "fail", daemon
    assert f"daemon pid {hung.pid} lives" in daemon["summary"] and "does not answer" in daemon["summary"]
    assert "stopped" in daemon["summary"] and f"kill -CONT {hung.pid}" in daemon["fix"]
    assert daemon["details"]["pid"] == hung.pid


def test_a_dead_daemons_pid_file_and_socket_mean_no_daemon(root: Path, tmp_path: Path) -> None:
    layout = Layout(root)
    stale_socket(layout.socket)
    layout.pid_file.write_text("999999\n")  # what kill -9 leaves: the file, without its lock
    code, out, err = cli("put", str(save(tmp_path / "a.npy", np.arange(3))), "--key", "a")
    assert code == 0 and out.split() == ["a"] and f"notice: no daemon on {root}" in err
    code, out, _ = cli("stats")
    assert code == 0 and "daemon:   not running" in out
