"""``shmcache put`` through a daemon that is killed (``kill -9``) during the load says that
the load ended with the daemon, not merely that no daemon answers (which read as "start
one", as if the put had never begun)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from cli_helpers import cli_process
from service_helpers import running_daemon, scratch_dir, wait_for, write_big_npy
from shmcache.client import Client

from shmcache import DaemonUnavailableError

pytest.importorskip("fastapi")

SIZE = 96 << 20
"""About 3 s at 32 MiB/s: the kill lands inside the load."""


def test_a_put_whose_daemon_is_killed_mid_load_says_the_load_ended_with_it(root: Path) -> None:
    slow = ("--max-load-rate", "32MiB")
    with scratch_dir() as data, running_daemon(root, "--allow-source", str(data), *slow) as daemon:
        source = write_big_npy(data / "big.npy", SIZE)
        put = cli_process("put", str(source), "--key", "big", "--root", str(root))
        with daemon.client() as http:
            wait_for(lambda: any(job["state"] == "running" for job in http.get("/v1/jobs").json()),
                     timeout=60, what="the load to run")
        daemon.signal(signal.SIGKILL)
        _, err = put.communicate(timeout=120)
    assert put.returncode == 1, err
    assert "the daemon stopped during the load of 'big'" in err, err
    assert "nothing more of it will be published" in err, err


def test_a_paused_daemon_is_not_said_to_have_stopped_and_its_load_goes_on(root: Path) -> None:
    """Ctrl+Z of the daemon's terminal (SIGSTOP) while a client waits with a short timeout:
    the error says it is stopped and how to resume it, never that the load ended."""
    slow = ("--max-load-rate", "32MiB")
    with scratch_dir() as data, running_daemon(root, "--allow-source", str(data), *slow) as daemon:
        source = write_big_npy(data / "big.npy", SIZE)
        client = Client(root, timeout=1.0)
        job = client.load("big", source)
        wait_for(lambda: client.job(job.id).state == "running", timeout=60, what="the load to run")
        pause = threading.Timer(0.3, daemon.signal, (signal.SIGSTOP,))
        pause.start()
        try:
            with pytest.raises(DaemonUnavailableError) as raised:
                client.wait(job.id, timeout=120)
        finally:
            pause.join()
            daemon.signal(signal.SIGCONT)
        assert "stopped during the load" not in str(raised.value), raised.value
        assert "kill -CONT" in str(raised.value), raised.value
        with Client(root, timeout=30) as resumed:
            assert list(resumed.wait(job.id, timeout=120).keys) == ["big"]
