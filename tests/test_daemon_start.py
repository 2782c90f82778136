"""A daemon serves from the moment it starts, however many entries its root holds: the
entry view (every entry's ``meta.json``; about 10 s for 100,000 entries on a loaded
machine) is read in the background, and a listing that comes first waits for it, exact.

The slow read is made real and unbounded: one entry's ``meta.json`` is a named pipe, so
reading it blocks until this test writes the metadata into the pipe."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from service_helpers import running_daemon, wait_for

from shmcache import Store


def _open_for_writing(fifo: Path) -> int | None:
    """The pipe's write end once the daemon is blocked reading it (None before)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet
        return None


@pytest.mark.integration
def test_a_daemon_answers_before_it_has_read_every_entry(root: Path) -> None:
    store = Store(root)
    store.put_array("a", np.arange(3))
    store.put_array("b", np.arange(4))
    version = os.readlink(store.layout.entry_link("b")).rpartition("/")[2]
    meta = store.layout.version_dir(version) / "meta.json"
    saved = meta.read_bytes()
    meta.unlink()
    os.mkfifo(meta, 0o600)

    with running_daemon(root) as daemon, daemon.client(timeout=60) as client:
        # Served while the entry view's read is blocked on b's meta.json.
        assert client.get("/v1/health").status_code == 200
        assert client.get("/v1/jobs").status_code == 200
        listed: list[object] = []
        lister = threading.Thread(target=lambda: listed.append(client.get("/v1/entries").json()))
        with daemon.client(timeout=60) as other:
            lister.start()
            assert other.get("/v1/health").status_code == 200  # a waiting listing holds nothing up
        fds: list[int] = []
        wait_for(lambda: (fd := _open_for_writing(meta)) is not None and not fds.append(fd), 30, "a reader")
        os.write(fds[0], saved)
        os.close(fds[0])
        lister.join(60)
        assert not lister.is_alive(), "the listing never came back"
        staged = meta.with_name("meta.json.tmp")
        staged.write_bytes(saved)
        os.replace(staged, meta)  # a regular file again, for any later read
        assert [entry["key"] for entry in listed[0]] == ["a", "b"]  # type: ignore[index]
        assert client.get("/v1/stats").json()["entries"] == 2
    assert "2 entries" in daemon.log
