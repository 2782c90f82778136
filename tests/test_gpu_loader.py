"""GPU-direct without a GPU: GPULoader's sampling, batching, epochs and errors on
``device="cpu"`` (the same code as on CUDA), the one typed error every GPU function
raises without CUDA, and a pin's bookkeeping (a live shared mapping of the entry's
version, which is what keeps the budget from evicting it), and ``grid_search.py --loader
gpu`` without a GPU."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

import shmcache
import shmcache.torch as st
from shmcache import _cuda
from shmcache.errors import GPUUnavailableError, ShmCacheError, UnsupportedDataError

ROWS = 103


@pytest.fixture
def dataset(store: shmcache.Store) -> st.CachedDataset:
    feats = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    store.put_array("feats", feats)
    store.put_array("labels", np.arange(ROWS, dtype=np.int64))
    return st.CachedDataset({"x": "feats", "y": "labels"}, root=store.root)


def _labels(loader: st.GPULoader) -> list[list[int]]:
    return [batch["y"].tolist() for batch in loader]


def _flat(batches: list[list[int]]) -> list[int]:
    return [label for batch in batches for label in batch]


def test_sequential_batches_match_rows_and_drop_last(dataset: st.CachedDataset) -> None:
    loader = st.GPULoader(dataset, batch_size=10, device="cpu")
    batches = list(loader)
    assert len(loader) == len(batches) == 11 and len(batches[-1]["y"]) == 3
    assert torch.equal(torch.cat([b["y"] for b in batches]), torch.arange(ROWS))
    assert torch.equal(batches[2]["x"], torch.arange(80, 120, dtype=torch.float32).reshape(10, 4))
    dropped = st.GPULoader(dataset, batch_size=10, drop_last=True, device="cpu")
    assert len(dropped) == len(list(dropped)) == 10


def test_shuffle_is_a_fresh_permutation_each_epoch_reproducible_by_generator(
    dataset: st.CachedDataset,
) -> None:
    loader = st.GPULoader(dataset, batch_size=16, shuffle=True, device="cpu")
    first, second = _labels(loader), _labels(loader)
    assert sorted(_flat(first)) == sorted(_flat(second)) == list(range(ROWS))
    assert first != second
    runs = [
        st.GPULoader(dataset, 16, shuffle=True, generator=torch.Generator().manual_seed(7), device="cpu")
        for _ in range(2)
    ]
    epochs = [[_labels(run), _labels(run)] for run in runs]
    assert epochs[0] == epochs[1] and epochs[0][0] != epochs[0][1]
    torch.manual_seed(3)
    seeded = _labels(loader)
    torch.manual_seed(3)
    assert _labels(loader) == seeded  # without a generator: torch's global RNG


def test_distributed_sampler_splits_ranks_and_set_epoch_reshuffles(dataset: st.CachedDataset) -> None:
    ranks = [DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=3) for r in range(2)]
    loaders = [st.GPULoader(dataset, batch_size=8, sampler=s, device="cpu") for s in ranks]
    seen = [_flat(_labels(loader)) for loader in loaders]
    assert len(loaders[0]) == 7 and len(seen[0]) == len(seen[1]) == 52  # 103 padded to 104
    assert set(seen[0]) | set(seen[1]) == set(range(ROWS))
    assert seen[0] == _flat(_labels(loaders[0]))  # same epoch, same order
    loaders[0].set_epoch(1)
    assert _flat(_labels(loaders[0])) != seen[0]


def test_tuple_and_single_column_datasets(store: shmcache.Store) -> None:
    store.put_array("a", np.arange(12, dtype=np.int32).reshape(6, 2))
    store.put_array("b", np.arange(6, dtype=np.uint8))
    pairs = list(st.GPULoader(st.CachedDataset("a", "b", root=store.root), 4, device="cpu"))
    assert isinstance(pairs[0], tuple) and pairs[0][1].tolist() == [0, 1, 2, 3]
    single = list(st.GPULoader(st.CachedDataset("a", root=store.root), 4, device="cpu"))
    assert torch.equal(single[1], torch.tensor([[8, 9], [10, 11]], dtype=torch.int32))


def test_batches_are_fresh_tensors_writes_do_not_reach_the_cache(dataset: st.CachedDataset) -> None:
    batch = next(iter(st.GPULoader(dataset, 5, device="cpu")))
    batch["x"].add_(1000)
    assert float(shmcache.get_store(dataset._root).open_array("feats")[0, 0]) == 0.0
    assert float(next(iter(st.GPULoader(dataset, 5, device="cpu")))["x"][0, 0]) == 0.0


def test_bad_arguments_are_refused(store: shmcache.Store, dataset: st.CachedDataset) -> None:
    with pytest.raises(TypeError, match="CachedDataset"):
        st.GPULoader([1, 2, 3], 2, device="cpu")  # type: ignore[arg-type]
    for size in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            st.GPULoader(dataset, size, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exclusive"):
        st.GPULoader(dataset, 2, shuffle=True, sampler=range(3), device="cpu")
    with pytest.raises(ValueError, match="not meta"):
        st.GPULoader(dataset, 2, device="meta")
    store.put_array("recs", np.zeros(ROWS, dtype=[("a", "<i4"), ("b", "<f4")]))
    store.put_array("names", np.array(["x"] * ROWS))
    for key in ("recs", "names"):  # refused by the dataset already: torch holds no such column
        with pytest.raises(UnsupportedDataError, match=f"column '{key}'.*DataLoader"):
            st.CachedDataset("labels", key, root=store.root)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_every_gpu_function_raises_one_typed_error_without_cuda(dataset: st.CachedDataset) -> None:
    calls = [
        lambda: st.pin("feats", root=dataset._root),
        lambda: st.cuda_view("feats", root=dataset._root),
        lambda: st.to_cuda("feats", root=dataset._root),
        lambda: st.read_only_registration_supported(),
        lambda: st.GPULoader(dataset, 4),  # device None means CUDA
        lambda: st.GPULoader(dataset, 4, device="cuda:0"),
    ]
    for call in calls:
        with pytest.raises(GPUUnavailableError, match="needs CUDA") as caught:
            call()
        assert isinstance(caught.value, ShmCacheError) and isinstance(caught.value, RuntimeError)
        assert "CPU-only build" in str(caught.value) or "no CUDA device" in str(caught.value)


def _maps_of(version: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if version in line]


def test_a_hold_is_a_shared_read_only_mapping_of_the_version_counted_per_process(
    store: shmcache.Store,
) -> None:
    store.put_array("held", np.arange(4096, dtype=np.float64))
    version = store.info("held").version
    assert _maps_of(version) == []
    first = _cuda.hold("held", store.root, torch.device("cpu"), register=False)
    second = _cuda.hold("held", store.root, torch.device("cpu"), register=False)
    lines = _maps_of(version)
    assert len(lines) == 1 and lines[0].split()[1] == "r--s"  # one MAP_SHARED PROT_READ mapping
    assert store.mapped_by("held") == [__import__("os").getpid()]  # what the budget checks
    assert not first.array.flags.writeable and first.array[10] == 10.0 and not first.registered
    first.release()
    first.release()  # idempotent
    assert len(_maps_of(version)) == 1  # the second hold keeps it
    second.release()
    del first, second  # each Pinned keeps its array (and so the mapping) while it lives
    gc.collect()
    assert _maps_of(version) == []


def test_a_hold_of_an_array_view_maps_the_same_bytes(store: shmcache.Store) -> None:
    store.put_array("grid", np.arange(60, dtype=np.int16).reshape(6, 10))
    view = store.open_array("grid")[2:5, ::3]
    with _cuda.hold(view, None, torch.device("cpu"), register=False) as held:
        assert np.array_equal(held.array, view) and held.array.strides == view.strides
        assert held.key == "grid" and held.version == store.info("grid").version
    with pytest.raises(ValueError, match="does not live in the shmcache"):
        _cuda.hold(np.zeros(3), None, torch.device("cpu"), register=False)
    store.put_strings("words", ["a", "b"])
    with pytest.raises(UnsupportedDataError, match="strings entry"):
        _cuda.hold("words", store.root, torch.device("cpu"), register=False)


def test_a_key_and_an_array_of_it_share_one_hold_per_process(store: shmcache.Store) -> None:
    store.put_array("one", np.arange(10.0))
    by_key = _cuda.hold("one", None, torch.device("cpu"), register=False)
    by_array = _cuda.hold(store.open_array("one")[2:4], None, torch.device("cpu"), register=False)
    ident = (str(store.root), store.info("one").version, "data.npy")
    assert list(_cuda._REGISTRY) == [ident] and _cuda._REGISTRY[ident].count == 2
    by_key.release()
    by_array.release()
    assert _cuda._REGISTRY == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_grid_search_loader_gpu_without_a_gpu_says_so_and_compares_on_cpu(root: Path) -> None:
    script = Path(__file__).parent.parent / "scripts" / "grid_search.py"
    args = ["--loader", "gpu", "-n", "1", "--rows", "4096", "--dim", "16", "--workers", "0"]
    args += ["--root", str(root)]  # no daemon there: a temporary root
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no GPU: GPULoader and the DataLoader both run on device cpu" in done.stdout
    assert "## GPULoader (no worker process)" in done.stdout
    assert "## DataLoader (0 workers each)" in done.stdout
    compared = r"epoch \(median of 1\): GPULoader [\d.]+ s vs DataLoader \(0 workers\) [\d.]+ s on cpu"
    assert re.search(compared, done.stdout), done.stdout


def test_bfloat16_and_float8_columns_come_in_their_own_dtype(store: shmcache.Store) -> None:
    """A bfloat16 column (stored as its raw bits) is gathered as bfloat16, float8 as float8,
    bit for bit; on CUDA such columns go through the staging path (no registered view of
    a structured dtype)."""
    weights = torch.randn(64, 8).to(torch.bfloat16)
    acts = torch.randn(64, 4).to(torch.float8_e4m3fn)
    store.put_array("lp/weights", weights)
    store.put_array("lp/acts", acts)
    dataset = st.CachedDataset("lp/weights", "lp/acts", root=store.root)
    loader = st.GPULoader(dataset, batch_size=16, device="cpu")
    assert loader._bits_columns
    batches = list(loader)
    got_w = torch.cat([w for w, _ in batches])
    got_a = torch.cat([a for _, a in batches])
    assert got_w.dtype == torch.bfloat16 and got_a.dtype == torch.float8_e4m3fn
    assert torch.equal(got_w.view(torch.int16), weights.view(torch.int16))
    assert torch.equal(got_a.view(torch.uint8), acts.view(torch.uint8))
