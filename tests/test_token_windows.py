"""``shmcache.torch.TokenWindows``: random (x, y) windows of a token entry, gathered in one
operation per batch, the same in the main process and in DataLoader workers of every
start method."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from token_datasets import write_megatron
from torch.utils.data import DataLoader

from shmcache import Store
from shmcache.errors import InvalidRequestError, KeyNotFoundError, UnsupportedDataError
from shmcache.torch import GatheredBatch, TokenWindows, collate

TOKENS = 5_000
BLOCK = 16
BATCH_TIMEOUT_S = 120.0  # spawn workers import torch (seconds each, on 2 noisy cores)


@pytest.fixture
def tokens(store: Store, tmp_path: Path) -> np.ndarray:
    """A nanoGPT-style token file, put as ``train``."""
    values = np.random.default_rng(1).integers(0, 65535, TOKENS, dtype=np.uint16)
    values.tofile(tmp_path / "train.bin")
    store.put_file("train", tmp_path / "train.bin", dtype="uint16")
    return values


def _check_windows(x: torch.Tensor, y: torch.Tensor, starts: torch.Tensor, tokens: np.ndarray) -> None:
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (len(starts), BLOCK)
    for row, start in enumerate(starts.tolist()):
        np.testing.assert_array_equal(x[row].numpy(), tokens[start : start + BLOCK])
        np.testing.assert_array_equal(y[row].numpy(), tokens[start + 1 : start + 1 + BLOCK])  # shifted by one


def test_batches_are_random_shifted_windows(store: Store, tokens: np.ndarray) -> None:
    dataset = TokenWindows("train", BLOCK, root=store.root)
    assert len(dataset) == (TOKENS - 1) // BLOCK
    indices = list(range(0, 64))
    batch = dataset.__getitems__(indices)
    assert isinstance(batch, GatheredBatch) and len(batch) == 64
    x, y = batch.columns
    starts = dataset.starts(indices)
    assert int(starts.min()) >= 0 and int(starts.max()) <= TOKENS - BLOCK - 1
    assert len(set(starts.tolist())) > 50  # random starts, not a stride
    _check_windows(x, y, starts, tokens)
    x0, y0 = dataset[0]
    assert torch.equal(x0, x[0]) and torch.equal(y0, y[0])
    again = TokenWindows("train", BLOCK, root=store.root).starts(indices)
    assert torch.equal(again, starts)  # the same (seed, epoch, index): the same window
    dataset.set_epoch(1)
    assert not torch.equal(dataset.starts(indices), starts)
    other = TokenWindows("train", BLOCK, seed=7, root=store.root).starts(indices)
    assert not torch.equal(other, starts)


def test_shuffle_false_walks_disjoint_windows(store: Store, tokens: np.ndarray) -> None:
    dataset = TokenWindows("train", BLOCK, shuffle=False, dtype=torch.int32, root=store.root)
    x, y = dataset.__getitems__([0, 1, 2]).columns
    assert x.dtype == torch.int32
    np.testing.assert_array_equal(x.numpy().ravel(), tokens[: 3 * BLOCK])
    np.testing.assert_array_equal(y.numpy().ravel(), tokens[1 : 3 * BLOCK + 1])
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_windows_over_a_megatron_entry(store: Store, tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", [[list(range(100))], [list(range(100, 150))]])
    store.put_file("c", tmp_path / "c.idx")
    dataset = TokenWindows("c", 8, root=store.root)
    x, y = dataset[5]
    assert torch.equal(y[:-1], x[1:]) and int(y[-1]) == int(x[-1]) + 1  # documents laid end to end


def test_refusals(store: Store, tokens: np.ndarray) -> None:
    with pytest.raises(InvalidRequestError, match="too few for one window"):
        TokenWindows("train", TOKENS, root=store.root)
    store.put_array("floats", np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(UnsupportedDataError, match="a 2-d float32 array"):
        TokenWindows("floats", 2, root=store.root)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer from 1 to"),
        ({"block_size": -1}, "block_size must be an integer from 1 to"),
        ({"block_size": 1.5}, "block_size must be an integer, not 1.5"),
        ({"block_size": True}, "block_size must be an integer, not True"),
        ({"length": 0}, r"length \(a number of windows\) must be an integer from 1 to"),
        (
            {"length": 10**30},
            r"length \(a number of windows\) must be an integer from 1 to 9223372036854775807",
        ),
        ({"length": 2.0}, r"length \(a number of windows\) must be an integer, not 2.0"),
        ({"seed": 2**64}, r"seed must be an integer from -9223372036854775808 to 18446744073709551615"),
        ({"seed": 0.5}, "seed must be an integer, not 0.5"),
        ({"dtype": "int64"}, "dtype must be a torch.dtype"),
    ],
)
def test_bad_arguments_are_refused_when_made(
    store: Store, tokens: np.ndarray, arguments: dict[str, object], message: str
) -> None:
    """Each was a builtin error (ValueError, or OverflowError at len() or the first batch)
    or accepted silently; now InvalidRequestError (a ValueError) at construction."""
    given: dict[str, object] = {"block_size": BLOCK, **arguments}
    with pytest.raises(InvalidRequestError, match=message):
        TokenWindows("train", root=store.root, **given)  # type: ignore[arg-type]


def test_seeds_and_indices_are_64_bit_integers(store: Store, tokens: np.ndarray) -> None:
    top = TokenWindows("train", BLOCK, seed=2**64 - 1, root=store.root)
    assert torch.equal(
        top.starts([0, 1]), TokenWindows("train", BLOCK, seed=-1, root=store.root).starts([0, 1])
    )
    assert len(TokenWindows("train", BLOCK, length=2**63 - 1, shuffle=False, root=store.root)) == 2**63 - 1
    dataset = TokenWindows("train", BLOCK, shuffle=False, root=store.root)
    assert torch.equal(dataset[np.int64(1)][0], dataset[1][0])  # numpy integers are integers
    for index in (1.7, True, "1"):
        with pytest.raises(InvalidRequestError, match="window index must be an integer"):
            dataset[index]  # type: ignore[index]
    with pytest.raises(InvalidRequestError, match="window indices must be integers, not float64"):
        dataset.__getitems__([0.5, 1.0])  # type: ignore[list-item]
    with pytest.raises(IndexError):
        dataset.__getitems__([2**70])
    with pytest.raises(InvalidRequestError, match="epoch must be an integer"):
        dataset.set_epoch(1.5)  # type: ignore[arg-type]


def test_pickles_as_its_version(store: Store, tokens: np.ndarray) -> None:
    dataset = TokenWindows("train", BLOCK, root=store.root)
    dataset[0]  # mapped here: the mapping must not travel
    payload = pickle.dumps(dataset)
    assert len(payload) < 1024, f"{len(payload)} bytes pickled"
    loaded = pickle.loads(payload)
    assert torch.equal(loaded[3][0], dataset[3][0])


@pytest.mark.slow
@pytest.mark.parametrize("context", [None, "fork", "spawn", "forkserver"])
def test_dataloader_gives_the_same_batches_with_and_without_workers(
    store: Store, tokens: np.ndarray, context: str | None
) -> None:
    dataset = TokenWindows("train", BLOCK, length=256, root=store.root)
    workers = {} if context is None else {"num_workers": 2, "multiprocessing_context": context}
    loader = DataLoader(
        dataset, batch_size=32, collate_fn=collate, timeout=BATCH_TIMEOUT_S if context else 0, **workers
    )
    batches = list(loader)
    assert len(batches) == 256 // 32
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    _check_windows(x, y, dataset.starts(range(256)), tokens)
    plain = list(DataLoader(dataset, batch_size=32, **workers))  # torch's default_collate re-stacks
    assert torch.equal(torch.cat([b[0] for b in plain]), x)


def _overwrite(store: Store, tmp_path: Path, values: np.ndarray) -> None:
    values.tofile(tmp_path / "train.bin")
    store.put_file("train", tmp_path / "train.bin", dtype="uint16", overwrite=True)


def _last_window(dataset: TokenWindows, **workers: object) -> torch.Tensor:
    loader = DataLoader(
        dataset, batch_size=8, collate_fn=collate, timeout=BATCH_TIMEOUT_S if workers else 0, **workers
    )
    return list(loader)[-1][0][-1]  # type: ignore[no-any-return]


def test_reads_the_version_it_was_made_from_after_an_overwrite(
    store: Store, tokens: np.ndarray, tmp_path: Path
) -> None:
    """Its windows are sized from that version: a shorter one under the key gave numpy's
    IndexError, a same-length one another dataset's tokens."""
    dataset = TokenWindows("train", BLOCK, shuffle=False, root=store.root)
    _overwrite(store, tmp_path, tokens[:100])  # shorter
    want = tokens[(len(dataset) - 1) * BLOCK :][:BLOCK]
    np.testing.assert_array_equal(_last_window(dataset).numpy(), want)  # mapped here since __init__
    copy = pickle.loads(pickle.dumps(dataset))  # attaches the version again, as a worker does
    with pytest.raises(KeyNotFoundError, match="make a new TokenWindows"):
        copy[0]


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_its_version_or_refuse(
    store: Store, tokens: np.ndarray, tmp_path: Path, context: str
) -> None:
    """A forked worker inherits the version's mapping; a spawned one attaches the version
    and finds it gone: KeyNotFoundError, never the new version's tokens."""
    dataset = TokenWindows("train", BLOCK, shuffle=False, root=store.root)
    _overwrite(store, tmp_path, tokens[::-1].copy())  # same length, other tokens
    want = tokens[(len(dataset) - 1) * BLOCK :][:BLOCK]
    workers = {"num_workers": 2, "multiprocessing_context": context}
    if context == "fork":
        np.testing.assert_array_equal(_last_window(dataset, **workers).numpy(), want)
    else:
        with pytest.raises(KeyNotFoundError, match=r"version it was made from .* was replaced or evicted"):
            _last_window(dataset, **workers)
