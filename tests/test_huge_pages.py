"""Issue 22 item 3: entries on 2 MiB pages without root (``_disk/huge_map.py``,
``CachedDataset(huge_pages=True)``): an aligned private mapping of the real tmpfs file,
``MADV_COLLAPSE`` by the kernel, and the fallbacks where it declines. No kernel call is
mocked: where this kernel cannot collapse, the tests that need it skip and say why."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke

import shmcache
from shmcache._disk import huge_map

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, get_worker_info  # noqa: E402

import shmcache.torch  # noqa: E402

MiB = 1 << 20
HUGE = huge_map.pmd_size() or 2 * MiB


def _why_no_collapse() -> str | None:
    """Why a collapse cannot be shown here, from a real one on a scratch file of /dev/shm
    (None: it works): the sysfs checks of ``supported()`` do not see a container or a
    ``prctl`` that disables huge pages for this process, nor a memory too fragmented."""
    if not huge_map.supported():
        return ("no MADV_COLLAPSE here (needs Linux >= 6.1 on a 64-bit x86/ARM/RISC-V/s390, "
                "transparent huge pages built in, shmem_enabled not 'deny')")
    with tempfile.TemporaryFile(dir="/dev/shm") as scratch:
        scratch.write(b"\1" * (2 * HUGE))
        scratch.flush()
        view = huge_map.map_aligned(scratch.fileno(), 2 * HUGE)
        if view is None:
            return "the kernel refused an aligned mapping of a /dev/shm file"
        done = huge_map.collapse(huge_map.address_of(view), 2 * HUGE)
        del view
    return None if done.collapsed else f"MADV_COLLAPSE refused here: {done.reason}"


_NO_COLLAPSE = _why_no_collapse() if os.path.isdir("/dev/shm") else "no /dev/shm"
needs_collapse = pytest.mark.skipif(_NO_COLLAPSE is not None, reason=_NO_COLLAPSE or "")


def _pmd_mapped(path_suffix: str) -> tuple[int, int]:
    """(mappings, bytes mapped with huge page entries) of this process's mappings of
    files whose path ends with ``path_suffix`` (``/proc/self/smaps``)."""
    mappings = pmd = 0
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if not first.endswith(":") or "-" in first:  # a mapping's first line
                inside = line.rstrip().endswith(path_suffix)
                mappings += inside
            elif inside and first in ("ShmemPmdMapped:", "FilePmdMapped:"):
                pmd += int(line.split()[1]) * 1024
    return mappings, pmd


def _data_file(store: shmcache.Store, key: str) -> str:
    return f"/{store.info(key).version}/data.npy"


@pytest.fixture
def file_on_tmpfs(root: Path) -> Iterator[Path]:
    """An 8 MiB + 100 bytes file of known bytes on the root's tmpfs."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "plain.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 * MiB + 100, dtype=np.uint8).tobytes())
    yield path


@needs_collapse
def test_an_aligned_mapping_holds_the_files_bytes_and_goes_with_its_last_array(file_on_tmpfs: Path) -> None:
    expected = np.fromfile(file_on_tmpfs, dtype=np.uint8)
    fd = os.open(file_on_tmpfs, os.O_RDONLY)
    try:
        buffer = huge_map.map_aligned(fd, len(expected))
    finally:
        os.close(fd)  # the mapping outlives the descriptor
    assert buffer is not None
    address = huge_map.address_of(buffer)
    assert address % HUGE == 0
    array = np.frombuffer(buffer, dtype=np.uint8)
    assert np.array_equal(array, expected)
    maps = Path("/proc/self/maps").read_text().splitlines()
    ours = [line for line in maps if line.endswith(str(file_on_tmpfs))]
    assert len(ours) == 1 and ours[0].split()[1] == "rw-p"  # private, copy-on-write
    start, end = (int(x, 16) for x in ours[0].split()[0].split("-"))
    assert start == address and end == address + -(-len(expected) // 4096) * 4096
    reserved_left = [line for line in maps if line.split()[0].split("-")[0] == f"{end:x}" and "---p" in line]
    assert reserved_left == []  # the reservation past the mapping was given back
    del buffer
    assert _pmd_mapped(str(file_on_tmpfs))[0] == 1  # the array keeps it mapped
    del array
    gc.collect()
    assert _pmd_mapped(str(file_on_tmpfs))[0] == 0


@needs_collapse
def test_a_shared_aligned_view_is_read_only_and_a_private_one_keeps_its_writes(file_on_tmpfs: Path) -> None:
    expected = file_on_tmpfs.read_bytes()
    fd = os.open(file_on_tmpfs, os.O_RDONLY)
    try:
        shared = huge_map.map_aligned(fd, len(expected), private=False)
        private = huge_map.map_aligned(fd, len(expected))
    finally:
        os.close(fd)
    assert shared is not None and private is not None
    assert huge_map.address_of(shared) % HUGE == 0 and huge_map.address_of(private) % HUGE == 0
    perms = sorted(
        line.split()[1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(str(file_on_tmpfs))
    )
    assert perms == ["r--s", "rw-p"]
    read_only = np.frombuffer(shared, dtype=np.uint8)
    assert not read_only.flags.writeable
    with pytest.raises(ValueError):
        read_only[0] = 1  # refused by numpy, not a SIGSEGV
    tensor = torch.from_numpy(np.frombuffer(private, dtype=np.uint8))
    tensor[: 3 * MiB] += 1  # through torch, over huge and small pages alike
    assert bytes(tensor[:4].tolist()) == bytes((b + 1) % 256 for b in expected[:4])
    assert file_on_tmpfs.read_bytes() == expected  # copy-on-write: the file keeps its bytes
    assert read_only.tobytes() == expected


@needs_collapse
def test_collapse_maps_the_file_with_huge_pages(file_on_tmpfs: Path) -> None:
    size = file_on_tmpfs.stat().st_size
    fd = os.open(file_on_tmpfs, os.O_RDONLY)
    try:
        buffer = huge_map.map_aligned(fd, size)
    finally:
        os.close(fd)
    assert buffer is not None
    done = huge_map.collapse(huge_map.address_of(buffer), size)
    # whole pages only; under memory pressure the kernel may collapse fewer (EAGAIN), saying why
    assert done.collapsed % HUGE == 0 and 0 < done.collapsed <= size // HUGE * HUGE
    assert (done.reason is None) == (done.collapsed == size // HUGE * HUGE)
    mappings, pmd = _pmd_mapped(str(file_on_tmpfs))
    assert mappings == 1 and pmd >= done.collapsed
    assert bytes(buffer) == file_on_tmpfs.read_bytes()
    again = huge_map.collapse(huge_map.address_of(buffer), size)  # already done: nothing to do, no error
    assert again.reason is None


def test_a_file_smaller_than_a_huge_page_is_declined(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "small.bin"
    path.write_bytes(b"x" * (HUGE - 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert huge_map.map_aligned(fd, HUGE - 1) is None  # the caller maps the usual way
    finally:
        os.close(fd)
    assert huge_map.collapse(0x10000, 4096).collapsed == 0


def test_huge_pages_are_for_private_writable_arrays_only(store: shmcache.Store) -> None:
    from shmcache._disk.attach import attach_array

    store.put_array("feats", np.zeros((4096, 256), np.float32))
    with pytest.raises(ValueError, match="mode='writable'"):
        attach_array(str(store.root), store.info("feats").version, "data.npy", "feats", huge_pages=True)


def _two_columns(store: shmcache.Store) -> tuple[np.ndarray, np.ndarray]:
    """feats: 8 MiB of 1 KiB rows (mapped on huge pages); labels: 64 KiB (too small: as usual)."""
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((8192, 256), dtype=np.float32)
    labels = rng.integers(0, 1000, 8192)
    store.put_array("feats", feats)
    store.put_array("labels", labels)
    return feats, labels


@needs_collapse
def test_a_dataset_on_huge_pages_gives_the_same_rows_and_batches(store: shmcache.Store) -> None:
    feats, labels = _two_columns(store)
    huge = shmcache.torch.CachedDataset("feats", "labels", huge_pages=True)
    column = huge._columns()[0]
    assert (column.data_ptr() - 128) % HUGE == 0  # the mapping (header included) is aligned
    mappings, pmd = _pmd_mapped(_data_file(store, "feats"))
    assert mappings == 1 and pmd >= (8 * MiB) // HUGE * HUGE - HUGE  # the constructor collapsed it
    plain = shmcache.torch.CachedDataset("feats", "labels")  # a mapping of its own, on 4 KiB pages
    indices = np.random.default_rng(2).permutation(len(feats))[:1000].tolist()
    for start in range(0, 1000, 256):
        batch = indices[start : start + 256]
        x, y = huge.__getitems__(batch).columns
        px, py = plain.__getitems__(batch).columns
        assert torch.equal(x, px) and torch.equal(y, py)
        assert np.array_equal(x.numpy(), feats[batch]) and np.array_equal(y.numpy(), labels[batch])
    x7, y7 = huge[7]
    assert np.array_equal(x7.numpy(), feats[7]) and int(y7) == labels[7]
    loaded = pickle.loads(pickle.dumps(huge))
    assert len(pickle.dumps(huge)) < 1024 and loaded._huge_pages
    assert (loaded._columns()[0].data_ptr() - 128) % HUGE == 0


@needs_collapse
def test_a_write_to_a_huge_page_tensor_stays_in_it(store: shmcache.Store) -> None:
    feats, _ = _two_columns(store)
    ds = shmcache.torch.CachedDataset("feats", huge_pages=True)
    assert _pmd_mapped(_data_file(store, "feats"))[1] > 0
    row = ds[5]
    row += 7  # in place, through the huge-page mapping: the kernel copies a 4 KiB page
    assert torch.equal(ds[5], torch.from_numpy(feats[5]) + 7)
    assert np.array_equal(shmcache.open_array("feats")[5], feats[5])  # this process's shared view
    check = "import shmcache; print(shmcache.open_array('feats')[5].tobytes().hex())"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=120
    )
    assert bytes.fromhex(out.stdout.strip()) == feats[5].tobytes()  # the cache keeps the original
    fresh = shmcache.torch.CachedDataset("feats", huge_pages=True)
    assert torch.equal(fresh[5], torch.from_numpy(feats[5]))


@needs_collapse
def test_a_mapped_huge_dataset_is_seen_by_mapped_by_and_survives_eviction(store: shmcache.Store) -> None:
    feats, _ = _two_columns(store)
    ds = shmcache.torch.CachedDataset("feats", huge_pages=True)
    assert os.getpid() in store.mapped_by("feats")
    store.evict("feats")
    gc.collect()
    assert np.array_equal(ds.__getitems__([1, 8000, 3]).columns.numpy(), feats[[1, 8000, 3]])


@needs_collapse
def test_the_column_mapping_goes_with_its_last_tensor(store: shmcache.Store) -> None:
    _two_columns(store)
    suffix = _data_file(store, "feats")
    array = store.open_private_array("feats", huge_pages=True)
    tensor = torch.from_numpy(array)
    assert _pmd_mapped(suffix)[0] == 1
    del array
    gc.collect()
    assert _pmd_mapped(suffix)[0] == 1 and float(tensor[3, 3]) == float(tensor[3, 3])
    del tensor
    gc.collect()
    assert _pmd_mapped(suffix)[0] == 0  # unmapped: no PROT_NONE reservation or mapping left


def worker_pages(batch: Any) -> tuple[Any, bool, int]:
    """``collate_fn`` run in a worker: the batch, whether the worker's feats column is
    aligned, and the bytes its mappings of feats map with huge page entries."""
    info = get_worker_info()
    assert info is not None
    dataset = info.dataset
    column = dataset._columns()[0]  # type: ignore[attr-defined]
    version = dataset._store().info(dataset._keys[0]).version  # type: ignore[attr-defined]
    aligned = (column.data_ptr() - 128) % HUGE == 0
    return shmcache.torch.collate(batch), aligned, _pmd_mapped(f"/{version}/data.npy")[1]


@needs_collapse
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_map_huge_pages_again(store: shmcache.Store, start_method: str) -> None:
    feats, labels = _two_columns(store)
    order = np.random.default_rng(3).permutation(len(feats)).tolist()
    batches = [order[i : i + 512] for i in range(0, 2048, 512)]
    ds = shmcache.torch.CachedDataset("feats", "labels", huge_pages=True)
    loader = DataLoader(
        ds,
        batch_sampler=batches,
        num_workers=2,
        collate_fn=worker_pages,
        multiprocessing_context=start_method,
        timeout=120,
    )
    seen = list(loader)
    assert len(seen) == len(batches)
    for _, aligned, pmd in seen:
        assert aligned and pmd > 0
    for ((x, y), _, _), batch in zip(seen, batches, strict=True):
        assert np.array_equal(x.numpy(), feats[batch]) and np.array_equal(y.numpy(), labels[batch])


_REFUSED = """
import ctypes, json, sys
import numpy as np, shmcache, shmcache.torch
from shmcache._disk import huge_map
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE: the kernel refuses huge pages here
ds = shmcache.torch.CachedDataset("feats", huge_pages=True)
column = ds._columns()[0]
version = shmcache.get_store().info("feats").version
pmd = 0
inside = False
for line in open("/proc/self/smaps"):
    first = line.split()[0]
    if not first.endswith(":") or "-" in first:
        inside = line.rstrip().endswith(f"/{version}/data.npy")
    elif inside and first in ("ShmemPmdMapped:", "FilePmdMapped:"):
        pmd += int(line.split()[1]) * 1024
refused = huge_map.collapse(column.data_ptr() - 128, column.numel() * 4)
rows = ds.__getitems__([4, 2, 8000]).columns.numpy()
print(json.dumps({"pmd": pmd, "reason": refused.reason, "collapsed": refused.collapsed,
                  "rows": rows.tolist()}))
"""


@needs_collapse
def test_a_kernel_refusal_falls_back_silently(store: shmcache.Store) -> None:
    """A process the kernel refuses huge pages (``prctl(PR_SET_THP_DISABLE)``, as a
    container runtime may set) still gets its dataset, on 4 KiB pages, without a word."""
    feats, _ = _two_columns(store)
    out = subprocess.run(
        [sys.executable, "-c", _REFUSED], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stderr == ""
    result = json.loads(out.stdout)
    assert result["pmd"] == 0 and result["collapsed"] == 0
    assert result["reason"].startswith("not supported by this kernel")
    assert np.array_equal(np.array(result["rows"], np.float32), feats[[4, 2, 8000]])


def test_doctor_offers_the_route_without_root(root: Path) -> None:
    report = json.loads(invoke("doctor", "--json", "--root", str(root)).stdout)
    check = {c["name"]: c for c in report["checks"]}["huge_pages"]
    assert check["details"]["madv_collapse"] is huge_map.supported()
    if check["details"]["huge"] == "never" and check["details"]["shmem_enabled"] not in ("force", "deny"):
        assert ("huge_pages=True" in check["fix"]) is huge_map.supported()
        assert "huge=within_size" in check["fix"]  # the administrator's way, for every reader


def _faulted_pmd(path: str) -> int:
    """Bytes of ``path`` mapped with huge page entries once an aligned shared mapping of it
    is read page by page, without any collapse by this process: what the page cache holds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        view = huge_map.map_aligned(fd, size, private=False)
    finally:
        os.close(fd)
    assert view is not None
    sum(view[i] for i in range(0, size, 4096))  # fault every page in
    pmd = _pmd_mapped(path)[1]
    del view
    return pmd


@needs_collapse
def test_store_huge_pages_collapses_an_entrys_files_for_every_reader(store: shmcache.Store) -> None:
    store.put_array("big", np.arange(3 * HUGE // 8, dtype=np.int64))  # 3 huge pages of data
    store.put_array("small", np.arange(10))
    path = f"{store.root}/objects{_data_file(store, 'big')}"
    assert _faulted_pmd(path) == 0  # written on 4 KiB pages (/dev/shm without huge=)
    done = store.huge_pages("big")
    assert 0 < done <= 3 * HUGE and done % HUGE == 0
    assert _faulted_pmd(path) >= done  # another mapping finds them made
    assert store.huge_pages("small") == 0  # under one huge page: nothing to do, no error
    assert store.verify("big")


@needs_collapse
@pytest.mark.integration
def test_a_daemon_with_huge_pages_collapses_what_it_loaded(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from service_helpers import Daemon, load

    np.save(tmp_path / "big.npy", np.arange(3 * HUGE // 8, dtype=np.int64))
    daemon = Daemon(root, "--huge-pages").wait_ready()
    try:
        with daemon.client() as client:
            assert load(client, "big", tmp_path / "big.npy")["state"] == "done"
        store = shmcache.Store(root)
        path = f"{store.root}/objects{_data_file(store, 'big')}"
        deadline = time.monotonic() + 60
        while _faulted_pmd(path) == 0:  # the daemon collapses in a thread after the load
            assert time.monotonic() < deadline, daemon.log
            time.sleep(0.1)
    finally:
        daemon.stop()
