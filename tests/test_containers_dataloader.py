"""Shared containers and shmcache.torch inside real DataLoaders (fork, spawn, forkserver)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shmcache
import shmcache.torch
from tests.container_datasets import SharedContainersDataset, as_tensor_sum

START_METHODS = ["fork", "spawn", "forkserver"]
N = 300


@pytest.fixture
def filled(store: shmcache.Store) -> shmcache.Store:
    paths = [f"/data/{i:05d}.jpg" for i in range(N)]
    store.put_strings("paths", paths)
    store.put_records("anns", [{"id": i, "label": f"c{i % 7}"} for i in range(N)])
    store.put_mapping("lengths", {p: len(p) for p in paths})
    store.put_array("feats", np.arange(N * 4, dtype=np.float32).reshape(N, 4))
    store.put_array("labels", np.arange(N, dtype=np.int64))
    return store


@pytest.mark.parametrize("method", START_METHODS)
def test_containers_in_dataloader_workers(filled: shmcache.Store, method: str) -> None:
    dataset = SharedContainersDataset(str(filled.root))
    assert len(pickle.dumps(dataset)) < 2048
    loader = DataLoader(dataset, batch_size=32, num_workers=2, multiprocessing_context=method, timeout=120)
    seen: list[int] = []
    pids: set[int] = set()
    for batch in loader:
        assert bool(batch["path_ok"].all() and batch["record_ok"].all() and batch["lookup_ok"].all())
        assert set(batch["kinds"]) == {"SharedStrings/SharedRecords/SharedMapping"}
        seen.extend(batch["index"].tolist())
        pids.update(batch["pid"].tolist())
    assert sorted(seen) == list(range(N))
    assert len(pids) == 2 and os.getpid() not in pids
    assert filled.open_records("anns")[0] == {"id": 0, "label": "c0"}


@pytest.mark.parametrize("method", START_METHODS)
def test_cached_dataset_batches_without_copies_or_warnings(filled: shmcache.Store, method: str) -> None:
    dataset = shmcache.torch.CachedDataset({"x": "feats", "y": "labels"}, root=filled.root)
    assert len(pickle.dumps(dataset)) < 1024 and len(dataset) == N
    loader = DataLoader(
        dataset,
        batch_size=50,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=shmcache.torch.collate,
        timeout=120,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-array warning would fail here
        batches = list(loader)
    xs = torch.cat([b["x"] for b in batches])
    ys = torch.cat([b["y"] for b in batches])
    assert torch.equal(xs, torch.arange(N * 4, dtype=torch.float32).reshape(N, 4))
    assert torch.equal(ys, torch.arange(N))


def test_cached_dataset_with_default_collate_and_tuple_items(filled: shmcache.Store) -> None:
    dataset = shmcache.torch.CachedDataset("feats", "labels", root=filled.root)
    x, y = dataset[5]
    assert x.tolist() == [20.0, 21.0, 22.0, 23.0] and int(y) == 5
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    assert batch[0].shape == (4, 4) and batch[1].tolist() == [0, 1, 2, 3]
    filled.put_array("short", np.zeros(3))
    mismatch = r"different lengths \('feats': 300, 'short': 3 rows\)"
    with pytest.raises(shmcache.InvalidRequestError, match=mismatch):
        shmcache.torch.CachedDataset("feats", "short", root=filled.root)


def test_as_tensor_shares_memory_and_writes_stay_private(filled: shmcache.Store) -> None:
    tensor = shmcache.torch.as_tensor("feats", root=filled.root)
    assert tensor.shape == (N, 4) and tensor.dtype == torch.float32
    tensor[0, 0] = 123.0  # copy-on-write: only this process's page changes
    assert filled.open_array("feats")[0, 0] == 0.0
    assert shmcache.torch.as_tensor("feats", root=filled.root)[0, 0] == 0.0
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        total, mappings = pool.apply(as_tensor_sum, ("feats", str(filled.root)))
    assert total == float(np.arange(N * 4).sum()) - 1.0
    assert mappings == 1  # one copy-on-write mapping, not a shared one and a private one
    assert filled.open_array("feats")[0, 0] == 0.0
    with pytest.raises(ValueError, match="does not live in the shmcache"):
        shmcache.torch.as_tensor(np.zeros(3))
