"""A daemon whose root goes away while it runs (``rm -rf``): it answers 503 ``CacheRootError``
saying so, stops with that message in its log and exit status 1, and never removes the pid
file or socket of a daemon started since on the recreated root."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from service_helpers import app_client, load, running_daemon, unique
from shmcache.service.server import PidFile

from shmcache._disk.layout import Layout

GONE = "while the daemon was running"


def test_a_removed_root_stops_the_daemon_with_a_clear_message(root: Path, data_dir: Path) -> None:
    """Before: health kept answering 200 and every load failed with a misleading
    ``SourceNotFoundError``. Now every answer is a 503 naming the root and what to do, the
    daemon exits 1 within seconds with that message, and a new daemon recreates the root."""
    source = data_dir / "gone.npy"
    np.save(source, np.arange(16))
    tcp = ("--host", "127.0.0.1", "--port", "0")
    with running_daemon(root, "--allow-source", str(data_dir), *tcp) as daemon:
        assert daemon.tcp_url is not None
        with httpx.Client(base_url=daemon.tcp_url, timeout=10) as client:
            assert load(client, "before", source)["state"] == "done"
            shutil.rmtree(root)
            answers, deadline = [], time.monotonic() + 60
            while daemon.process.poll() is None and time.monotonic() < deadline:
                try:
                    answers.append(client.get("/v1/health"))
                    answers.append(client.put(f"/v1/entries/{unique('k')}", json={"source": str(source)}))
                except httpx.TransportError:
                    break  # stopped listening
                time.sleep(0.05)
        assert daemon.wait_exit(timeout=30) == 1
        for response in answers:
            assert response.status_code == 503, response.text
            error = response.json()
            assert error["error"] == "CacheRootError" and str(root) in error["detail"], error
            assert GONE in error["detail"] and "shmcache serve" in error["detail"]
        assert f"ERROR shmcache.service.server: the cache root {root} was removed {GONE}" in daemon.log
        assert "Traceback" not in daemon.log, daemon.log
    with running_daemon(root) as again, again.client() as client:  # the next start recreates it
        assert client.get("/v1/health").status_code == 200
        assert client.get("/v1/entries").json() == []


@pytest.mark.parametrize("how", ["removed", "replaced", "emptied"])
def test_requests_get_503_once_the_root_is_gone(root: Path, data_dir: Path, how: str) -> None:
    source = data_dir / "gone.npy"
    np.save(source, np.arange(16))
    with app_client(root, allow_source=[data_dir]) as client:
        assert load(client, "before", source)["state"] == "done"
        if how == "emptied":  # rm -rf root/*
            for child in root.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        else:
            shutil.rmtree(root)
            if how == "replaced":
                root.mkdir(mode=0o700)
        for response in (
            client.get("/v1/health"),
            client.get("/v1/stats"),
            client.get("/v1/entries"),
            client.put("/v1/entries/after", json={"source": str(source)}),
            client.delete("/v1/entries/before"),
        ):
            assert response.status_code == 503, response.text
            error = response.json()
            assert error["error"] == "CacheRootError" and GONE in error["detail"], error
        expected = {"removed": "was removed", "replaced": "was replaced", "emptied": "lost its entries/"}
        assert expected[how] in client.get("/v1/health").json()["detail"]


def test_a_stopping_daemon_leaves_a_new_daemons_pid_file(tmp_path: Path) -> None:
    """The old daemon's root went (and its pid file with it), a new daemon made a new pid file
    at the same path: the old one's release must not remove it (nor its socket, the same check)."""
    path = Layout(tmp_path).pid_file
    old = PidFile(path)
    old.acquire()
    os.unlink(path)  # rm -rf of the root
    new = PidFile(path)
    new.acquire()
    old.release()
    assert path.exists() and path.read_text().strip() == str(os.getpid())
    new.release()
    assert not path.exists()
