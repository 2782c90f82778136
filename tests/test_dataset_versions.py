"""A CachedDataset reads the versions it was sized from, in every process: a put under
the same key after it was made never reaches its workers (other rows, another length,
one column new and the other old); they say so instead, or keep the version they mapped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shmcache
import shmcache.torch
from shmcache.errors import KeyNotFoundError

START_METHODS = ["fork", "spawn", "forkserver"]
N = 64


@pytest.fixture
def columns(store: shmcache.Store) -> shmcache.Store:
    store.put_array("feats", np.arange(N * 2, dtype=np.float32).reshape(N, 2))
    store.put_array("labels", np.arange(N, dtype=np.int64))
    return store


def _replace(store: shmcache.Store, rows: int) -> None:
    """Today's refresh: new rows under both keys (another length when ``rows`` != N)."""
    store.put_array("feats", np.full((rows, 2), -1.0, dtype=np.float32), overwrite=True)
    store.put_array("labels", np.full(rows, -1, dtype=np.int64), overwrite=True)


def _loader(dataset: shmcache.torch.CachedDataset, method: str, **kwargs: object) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=16,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=shmcache.torch.collate,
        timeout=120,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("rows", [N, N // 2])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_after_a_replace_say_so_instead_of_reading_it(
    columns: shmcache.Store, method: str, rows: int
) -> None:
    dataset = shmcache.torch.CachedDataset("feats", "labels", root=columns.root)
    _replace(columns, rows)
    with pytest.raises(KeyNotFoundError) as caught:
        list(_loader(dataset, method))
    message = str(caught.value)
    assert "replaced or evicted since the dataset was made" in message
    assert f"its {N} rows came from that version" in message
    assert "make a new CachedDataset" in message and "persistent_workers=True" in message
    fresh = shmcache.torch.CachedDataset("feats", "labels", root=columns.root)
    assert len(fresh) == rows
    labels = torch.cat([batch[1] for batch in _loader(fresh, method)])
    assert labels.tolist() == [-1] * rows


@pytest.mark.parametrize("rows", [N, N // 2])
def test_fork_workers_started_after_a_replace_read_the_datasets_version(
    columns: shmcache.Store, rows: int
) -> None:
    """The dataset maps its columns when it is made: fork workers (Linux's default start
    method) inherit that version, whatever was put under the keys since."""
    dataset = shmcache.torch.CachedDataset("feats", "labels", root=columns.root)
    _replace(columns, rows)
    for _epoch in range(2):  # each epoch's workers are new processes
        feats = torch.cat([batch[0] for batch in _loader(dataset, "fork")])
        assert torch.equal(feats, torch.arange(N * 2, dtype=torch.float32).reshape(N, 2))


@pytest.mark.parametrize("method", START_METHODS)
def test_persistent_workers_keep_the_version_they_mapped(columns: shmcache.Store, method: str) -> None:
    dataset = shmcache.torch.CachedDataset("feats", "labels", root=columns.root)
    loader = _loader(dataset, method, persistent_workers=True)
    first = torch.cat([batch[1] for batch in loader])
    _replace(columns, N // 2)
    second = torch.cat([batch[1] for batch in loader])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(N))


def test_the_main_process_reads_its_version_after_a_replace(columns: shmcache.Store) -> None:
    dataset = shmcache.torch.CachedDataset({"x": "feats", "y": "labels"}, root=columns.root)
    _replace(columns, N // 2)
    assert len(dataset) == N and int(dataset[N - 1]["y"]) == N - 1
    assert dataset.__getitems__([5, 6]).columns["y"].tolist() == [5, 6]
    fresh = shmcache.torch.CachedDataset({"x": "feats", "y": "labels"}, root=columns.root)
    assert len(fresh) == N // 2 and int(fresh[5]["y"]) == -1


def test_gpu_loader_on_the_cpu_gathers_the_datasets_version(columns: shmcache.Store) -> None:
    dataset = shmcache.torch.CachedDataset("feats", "labels", root=columns.root)
    loader = shmcache.torch.GPULoader(dataset, batch_size=16, device="cpu")
    _replace(columns, N // 2)
    labels = torch.cat([batch[1] for batch in loader])  # the dataset's columns: its version
    assert labels.tolist() == list(range(N))
    with pytest.raises(KeyNotFoundError, match="make a new CachedDataset"):  # its files are gone
        shmcache.torch.GPULoader(dataset, batch_size=16, device="cpu")
