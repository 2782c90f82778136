"""What a real ``shmcache serve`` reports about itself: every eviction it makes counted in
``/metrics`` (by reason), and ``held_by_readers_bytes`` no older than the scan age the docs
promise, even for the first request after a quiet period. Readers are real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx
from service_helpers import Daemon, load, running_daemon, temporary_root, unique
from shmcache.service.state import SCAN_MAX_AGE_S

pytestmark = pytest.mark.integration

MiB = 1 << 20


def sample(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels) in a Prometheus text answer."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics:\n{text}")


@pytest.fixture
def budget_daemon(data_dir: Path) -> Iterator[Daemon]:
    """A daemon whose root's budget holds two 1 MiB entries, not three."""
    with temporary_root() as root, running_daemon(
        root, "--allow-source", str(data_dir), "--max-bytes", str(5 * MiB // 2)
    ) as daemon:
        yield daemon


def test_budget_evictions_of_a_load_are_counted(budget_daemon: Daemon, data_dir: Path) -> None:
    keys = [unique(name) for name in "abc"]
    for key in keys:
        np.save(data_dir / f"{key}.npy", np.ones(MiB, dtype=np.uint8))
    with budget_daemon.client() as client:
        for key in keys:
            assert load(client, key, data_dir / f"{key}.npy")["state"] == "done"
        listed = [entry["key"] for entry in client.get("/v1/entries").json()]
        assert sorted(listed) == sorted(keys[1:])  # the least recently used went
        text = client.get("/metrics").text
        assert sample(text, 'shmcache_evictions_total{reason="budget"}') == 1
        assert sample(text, 'shmcache_evicted_bytes_total{reason="budget"}') >= MiB
        assert sample(text, 'shmcache_evictions_total{reason="request"}') == 0

        assert client.delete(f"/v1/entries/{keys[1]}").status_code == 200
        text = client.get("/metrics").text
        assert sample(text, 'shmcache_evictions_total{reason="request"}') == 1
        assert sample(text, 'shmcache_evicted_bytes_total{reason="request"}') >= MiB
        assert sample(text, 'shmcache_evictions_total{reason="budget"}') == 1


def _held(client: httpx.Client, endpoint: str) -> int:
    if endpoint == "/v1/stats":
        return int(client.get(endpoint).json()["held_by_readers_bytes"])
    return int(sample(client.get(endpoint).text, "shmcache_held_by_readers_bytes"))


@pytest.mark.parametrize("endpoint", ["/v1/stats", "/metrics"])
def test_first_answer_after_a_quiet_period_is_current(daemon: Daemon, data_dir: Path, endpoint: str) -> None:
    key = unique("held")
    array = np.ones(4 * MiB, dtype=np.uint8)
    np.save(data_dir / f"{key}.npy", array)
    code = (
        "import sys, shmcache; a = shmcache.open_array(sys.argv[1], root=sys.argv[2])\n"
        "print('ready', flush=True); sys.stdin.read()"
    )
    with daemon.client() as client:
        assert load(client, key, data_dir / f"{key}.npy")["state"] == "done"
        reader = subprocess.Popen(
            [sys.executable, "-c", code, key, str(daemon.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert reader.stdin is not None and reader.stdout is not None
        try:
            assert reader.stdout.readline().strip() == b"ready"
            before = _held(client, endpoint)  # a scan now: the reader's version is still the entry's
            assert load(client, key, data_dir / f"{key}.npy", overwrite=True)["state"] == "done"
            time.sleep(SCAN_MAX_AGE_S + 0.5)  # no stats request meanwhile: the last scan is too old
            assert _held(client, endpoint) >= before + array.nbytes
        finally:
            reader.stdin.close()
            reader.wait(30)
        time.sleep(SCAN_MAX_AGE_S + 0.5)
        assert _held(client, endpoint) == before
