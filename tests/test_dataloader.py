"""A real DataLoader with worker processes over a Dataset holding a shared array.

With every start method the workers must see the same data, the Dataset must travel as
a reference (under 1 KiB), and each worker must read the entry through its own mapping
of the shared file, never a private copy (DESIGN.md, "Public Python API").
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from dataloader_datasets import SharedRowsDataset, describe_array
from torch.utils.data import DataLoader, default_collate

import shmcache

ROWS, COLS = 2048, 512  # float32: 4 MiB, so worker start-up dominates
BATCH = 64
NUM_WORKERS = 2
BATCH_TIMEOUT_S = 120.0
"""Per-batch timeout: generous, since spawn workers import torch (~3 s each, 2 noisy cores)."""

READ_ONLY_WARNING = "ignore:The given NumPy array is not writable"
"""torch warns once per process when ``default_collate`` converts a read-only row."""


@pytest.fixture
def data(store: shmcache.Store) -> np.ndarray:
    """The rows, published as ``rows`` in the fixture's root (also $SHMCACHE_ROOT)."""
    rows = (np.arange(ROWS * COLS, dtype=np.float32) * 0.25).reshape(ROWS, COLS)
    store.put_array("rows", rows)
    return rows


def test_default_collate_stacks_read_only_rows(data: np.ndarray) -> None:
    array = shmcache.open_array("rows")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        batch = default_collate([array[i] for i in range(5, 9)])
    assert isinstance(batch, torch.Tensor)
    assert batch.dtype == torch.float32
    np.testing.assert_array_equal(batch.numpy(), data[5:9])
    batch.add_(1.0)  # the batch is a fresh tensor: writing it leaves the cache alone
    np.testing.assert_array_equal(array[5:9], data[5:9])


def test_dataset_pickles_small(data: np.ndarray) -> None:
    dataset = SharedRowsDataset("rows")
    payload = pickle.dumps(dataset)
    assert len(payload) < 1024, f"{len(payload)} bytes pickled"
    loaded = pickle.loads(payload)
    np.testing.assert_array_equal(loaded[17]["row"], data[17])
    assert loaded[17]["shared"] and loaded[17]["mapped"]


@pytest.mark.slow
@pytest.mark.filterwarnings(READ_ONLY_WARNING)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_read_the_shared_entry(context: str, data: np.ndarray) -> None:
    dataset = SharedRowsDataset("rows")
    assert len(pickle.dumps(dataset)) < 1024
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=False,
        num_workers=NUM_WORKERS,
        multiprocessing_context=context,
        timeout=BATCH_TIMEOUT_S,
    )

    batches: list[dict[str, Any]] = list(loader)

    assert len(batches) == ROWS // BATCH
    tensors = torch.cat([b["tensor"] for b in batches])
    rows = torch.cat([b["row"] for b in batches])
    indices = torch.cat([b["index"] for b in batches])
    np.testing.assert_array_equal(tensors.numpy(), data)
    np.testing.assert_array_equal(rows.numpy(), data)
    np.testing.assert_array_equal(indices.numpy(), np.arange(ROWS))

    pids = set(torch.cat([b["pid"] for b in batches]).tolist())
    assert len(pids) == NUM_WORKERS and os.getpid() not in pids
    base_types = {t for b in batches for t in b["base_types"]}
    assert base_types == {"MappedFile"}, f"workers hold {base_types}, not the shared mapping"
    assert bool(torch.cat([b["shared"] for b in batches]).all())
    assert bool(torch.cat([b["mapped"] for b in batches]).all()), "entry file not mapped by a worker"
    assert not bool(torch.cat([b["writeable"] for b in batches]).any())

    # The main process's array is untouched and still the shared mapping.
    _pid, shared, mapped, writeable, _types = describe_array(dataset.rows)
    assert shared and mapped and not writeable
    np.testing.assert_array_equal(dataset.rows, data)
