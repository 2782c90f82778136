"""What a real ``shmcache serve`` reports about itself: every eviction it makes counted in
``/metrics`` (by reason)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from service_helpers import Daemon, load, running_daemon, temporary_root, unique

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
