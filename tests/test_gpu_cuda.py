"""GPU-direct on a real GPU (mark ``gpu``; skipped without CUDA): registration without a
page copied, CUDA views and copies of entries, reference counting, GPULoader on the
device and through the pinned-staging fallback. ``scripts/gpu_check.sh`` runs them.

Imports only numpy, pytest, torch and shmcache (a GPU machine may have no fastapi)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import shmcache
import shmcache.torch as st
from shmcache import _cuda
from shmcache._disk.layout import ARRAY_FILE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU, its driver, a CUDA torch)"),
]

MiB = 1 << 20


def _anonymous_kib() -> int:
    """This process's anonymous memory: a page copied out of a private mapping lands here."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError("no Anonymous: line in /proc/self/smaps_rollup")


@pytest.fixture
def rows(store: shmcache.Store) -> np.ndarray:
    data = np.arange(64 * MiB // 4, dtype=np.float32).reshape(-1, 256)  # 64 MiB, 1 KiB rows
    store.put_array("rows", data)
    return data


@pytest.fixture
def staged() -> Iterator[None]:
    """Play a GPU without read-only host registration (a B300): the pinned-staging path."""
    index = torch.cuda.current_device()
    saved = _cuda._SUPPORT.get(index)
    _cuda._SUPPORT[index] = False
    yield
    if saved is None:
        _cuda._SUPPORT.pop(index, None)
    else:
        _cuda._SUPPORT[index] = saved


def test_read_only_registration_is_supported_here() -> None:
    assert st.read_only_registration_supported() is True  # an H100: what the probes measured


def test_pin_registers_without_copying_a_page_and_counts_holders(
    store: shmcache.Store, rows: np.ndarray
) -> None:
    before = _anonymous_kib()
    first = st.pin("rows")
    assert first.registered and first.array.nbytes == rows.nbytes
    assert _anonymous_kib() - before < 8 * 1024  # a copy would add 64 MiB
    second = st.pin(store.open_array("rows")[10:20])
    assert np.array_equal(second.array, rows[10:20])
    ident = (str(store.root), store.info("rows").version, ARRAY_FILE)
    assert _cuda._REGISTRY[ident].count == 2
    assert store.mapped_by("rows") == [os.getpid()]  # a pinned entry counts as mapped
    first.release()
    assert _cuda._REGISTRY[ident].count == 1 and _cuda._REGISTRY[ident].registered
    second.release()
    assert ident not in _cuda._REGISTRY
    # unregistered: CUDA accepts the same pages again
    pointer = int(first.array.__array_interface__["data"][0])
    cudart = torch.cuda.cudart()
    assert _cuda._code(cudart.cudaHostRegister(pointer, first.array.nbytes, 8)) == 0
    cudart.cudaHostUnregister(pointer)


def test_cuda_view_aliases_the_cache_and_releases_with_the_tensor(
    store: shmcache.Store, rows: np.ndarray
) -> None:
    view = st.cuda_view("rows")
    assert view.is_cuda and view.shape == rows.shape and view.dtype == torch.float32
    positions = torch.tensor([0, 5, 65535], device=view.device)
    assert torch.equal(view.index_select(0, positions).cpu(), torch.from_numpy(rows[[0, 5, 65535]]))
    assert len(_cuda._REGISTRY) == 1
    strided = st.cuda_view(store.open_array("rows")[3:9, ::2])
    assert torch.equal(strided.cpu(), torch.from_numpy(np.ascontiguousarray(rows[3:9, ::2])))
    del view, strided
    gc.collect()
    assert _cuda._REGISTRY == {}


def test_to_cuda_copies_the_whole_entry_and_leaves_nothing_pinned(
    store: shmcache.Store, rows: np.ndarray
) -> None:
    copy = st.to_cuda("rows")
    assert copy.is_cuda and torch.equal(copy.cpu(), torch.from_numpy(rows))
    copy.add_(1)  # its own memory
    assert float(store.open_array("rows")[0, 0]) == 0.0
    assert _cuda._REGISTRY == {}


def test_to_cuda_through_pinned_staging(
    store: shmcache.Store, rows: np.ndarray, staged: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cuda, "STAGING_CHUNK", 3 * MiB + 4)  # several turns, a ragged last one
    assert torch.equal(st.to_cuda("rows").cpu(), torch.from_numpy(rows))
    with pytest.raises(shmcache.GPUUnavailableError, match="read-only host registration"):
        st.cuda_view("rows")
    assert _cuda._REGISTRY == {}


@pytest.mark.parametrize("staging", [False, True], ids=["registered", "staged"])
def test_gpu_loader_gives_the_cpu_batches_on_the_device(
    store: shmcache.Store, rows: np.ndarray, staging: bool, request: pytest.FixtureRequest
) -> None:
    if staging:
        request.getfixturevalue("staged")
    store.put_array("labels", np.arange(len(rows)))
    dataset = st.CachedDataset({"x": "rows", "y": "labels"})
    seed = 11
    on_gpu = st.GPULoader(dataset, 4096, shuffle=True, generator=torch.Generator().manual_seed(seed))
    on_cpu = st.GPULoader(
        dataset, 4096, shuffle=True, generator=torch.Generator().manual_seed(seed), device="cpu"
    )
    count = 0
    for gpu_batch, cpu_batch in zip(on_gpu, on_cpu, strict=True):
        assert gpu_batch["x"].is_cuda and gpu_batch["y"].is_cuda
        assert torch.equal(gpu_batch["x"].cpu(), cpu_batch["x"]) and torch.equal(
            gpu_batch["y"].cpu(), cpu_batch["y"]
        )
        count += 1
    assert count == len(on_gpu) == 16  # 65,536 rows
    on_gpu.close()


def test_an_entry_evicted_while_pinned_stays_readable(store: shmcache.Store, rows: np.ndarray) -> None:
    view = st.cuda_view("rows")
    store.evict("rows")
    assert torch.equal(view[-1].cpu(), torch.from_numpy(rows[-1]))


def test_a_process_exiting_with_pins_unregisters_cleanly(root: Path, rows: np.ndarray) -> None:
    code = (
        "import shmcache.torch as st, torch\n"
        "v = st.cuda_view('rows'); p = st.pin('rows')\n"
        "print(float(v[1, 0].item()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "256.0" and "Error" not in done.stderr


def test_processes_pinning_one_entry_copy_no_page(root: Path, rows: np.ndarray) -> None:
    code = (
        "import sys, torch, shmcache.torch as st\n"
        "def anonymous():\n"
        "    for line in open('/proc/self/smaps_rollup'):\n"
        "        if line.startswith('Anonymous:'): return int(line.split()[1])\n"
        "torch.zeros(1, device='cuda')\n"
        "before = anonymous(); held = st.pin('rows'); view = st.cuda_view('rows')\n"
        "assert held.registered and float(view[2, 0].item()) == 512.0\n"
        "print(anonymous() - before); sys.stdout.flush(); sys.stdin.read()\n"  # hold until told
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    try:
        grown = [int(child.stdout.readline()) for child in children if child.stdout is not None]
    finally:
        for child in children:
            child.communicate("", timeout=120)
    assert len(grown) == 3 and all(kib < 8 * 1024 for kib in grown), grown  # a copy: +65,536 KiB each
    assert all(child.returncode == 0 for child in children)


def test_gpu_loader_stages_when_one_columns_registration_fails(
    store: shmcache.Store, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration refused (here: the labels' answered cudaErrorMemoryAllocation, what a
    locked-memory limit gives) sends the whole loader through pinned staging, same batches."""
    store.put_array("labels", np.arange(len(rows)))
    real = _cuda._host_register
    labels = store.open_array("labels").nbytes

    def refuse_labels(pointer: int, nbytes: int, device: torch.device) -> int:
        return 2 if nbytes == labels else real(pointer, nbytes, device)

    monkeypatch.setattr(_cuda, "_host_register", refuse_labels)
    dataset = st.CachedDataset({"x": "rows", "y": "labels"})
    loader = st.GPULoader(dataset, 4096)
    batches = list(loader)
    assert loader._staged and len(batches) == 16 and batches[3]["x"].is_cuda
    assert torch.equal(batches[3]["x"].cpu(), torch.from_numpy(rows[3 * 4096 : 4 * 4096]))
    assert torch.equal(batches[-1]["y"].cpu(), torch.arange(15 * 4096, 16 * 4096))
    assert _cuda._REGISTRY == {}  # the registered column was released, not leaked
    with pytest.raises(shmcache.GPUUnavailableError, match="cudaErrorMemoryAllocation"):
        st.cuda_view("labels")
    loader.close()


def test_nvml_sees_this_process_gpu_memory_when_installed() -> None:
    pytest.importorskip("pynvml", reason="the gpu extra (nvidia-ml-py) is not installed")
    from shmcache._diagnose.nvml import GpuMemory

    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    gpus = GpuMemory()
    try:
        assert gpus.available, gpus.missing
        assert gpus.by_pid().get(os.getpid(), 0) >= 256 * MiB
    finally:
        gpus.close()
        del block
