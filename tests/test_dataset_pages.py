"""Issue 22 item 3: which pages a ``CachedDataset`` reads (huge ones where the tmpfs holds
them), its columns mapped again after a fork and copy-on-write still keeping every write
out of the cache; ``doctor`` says which pages entries get."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from service_helpers import mounted_tmpfs

import shmcache

torch = pytest.importorskip("torch")
import shmcache.torch  # noqa: E402

MiB = 1 << 20

# Run in a fresh process: its only mapping of the entry is the dataset's.
_MAPPED = """
import json, sys, shmcache, shmcache.torch
key = sys.argv[1]
ds = shmcache.torch.CachedDataset(key)
float(ds[len(ds) // 2].sum())  # a row read (a view alone touches nothing)
version = shmcache.get_store().info(key).version
rss = pmd = 0
inside = False
for line in open("/proc/self/smaps"):
    first = line.split()[0]
    if not first.endswith(":") or "-" in first:  # a mapping's first line
        inside = line.rstrip().endswith(f"/{version}/data.npy")
    elif inside and first == "Rss:":
        rss += int(line.split()[1]) * 1024
    elif inside and first in ("FilePmdMapped:", "ShmemPmdMapped:"):
        pmd += int(line.split()[1]) * 1024
print(json.dumps({"rss": rss, "pmd": pmd}))
"""


def test_a_huge_page_tmpfs_gives_a_dataset_huge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with mounted_tmpfs(tmp_path / "huge", "size=64m,huge=within_size,mode=0700") as mount:
        cache = mount / "cache"
        monkeypatch.setenv("SHMCACHE_ROOT", str(cache))
        shmcache.put_array("feats", np.ones((8 * MiB // 1024, 256), np.float32))
        out = subprocess.run(
            [sys.executable, "-c", _MAPPED, "feats"], capture_output=True, text=True, check=True, timeout=120
        )
        assert json.loads(out.stdout)["pmd"] >= 2 * MiB  # one row read maps a whole 2 MiB page
        report = json.loads(invoke("doctor", "--json", "--root", str(cache)).stdout)
        check = {c["name"]: c for c in report["checks"]}["huge_pages"]
        assert check["details"]["huge"] == "within_size" and "2 MiB pages" in check["summary"]


def test_doctor_says_which_pages_entries_get(root: Path) -> None:
    report = json.loads(invoke("doctor", "--json", "--root", str(root)).stdout)
    check = {c["name"]: c for c in report["checks"]}["huge_pages"]
    assert check["status"] == "ok" and check["details"]["fs_type"] == "tmpfs"
    if check["details"]["huge"] == "never" and check["details"]["shmem_enabled"] != "force":
        assert "4 KiB pages" in check["summary"] and "huge=within_size" in check["fix"]


def test_a_forked_child_maps_the_columns_again(root: Path) -> None:
    """The per-process check is a fork count (no getpid per row): a child still gets
    columns of its own, so its writes stay out of the parent's tensors."""
    shmcache.put_array("feats", np.zeros((1024, 16), np.float32))
    ds = shmcache.torch.CachedDataset("feats")
    parent = ds[3]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            row = ds[3]
            row += 5
            mine = ds[3].data_ptr() != parent.data_ptr() and float(ds[3][0]) == 5.0
            os.write(write, b"1" if mine else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.read(read, 1) == b"1" and status == 0
    assert float(ds[3][0]) == 0.0 and ds[3].data_ptr() == parent.data_ptr()


def test_dataset_columns_stay_copy_on_write(root: Path) -> None:
    shmcache.put_array("feats", np.zeros((4096, 16), np.float32))
    ds = shmcache.torch.CachedDataset("feats")
    row = ds[5]
    row += 7  # in place, through the tensor's own private mapping
    assert float(ds[5][0]) == 7.0
    check = "import shmcache; print(float(shmcache.open_array('feats')[5].max()))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert float(out.stdout) == 0.0  # the cache (and every other process) keeps the original


def test_batches_convert_a_list_of_indices_without_torch_parsing_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DataLoader's list of ints becomes the index tensor through ``array("q")``
    (``torch.as_tensor`` parsed it element by element: a third of a batch's time); what
    ``array`` refuses, and what is not a list, still take ``torch.as_tensor``."""
    feats = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    shmcache.put_array("feats", feats)
    shmcache.put_array("labels", np.arange(64) * 10)
    ds = shmcache.torch.CachedDataset("feats", "labels")
    parsed: list[Any] = []
    real = torch.as_tensor

    def recording(data: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(data)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "as_tensor", recording)
    x, y = ds.__getitems__([5, 0, 63, 5]).columns
    assert np.array_equal(x.numpy(), feats[[5, 0, 63, 5]]) and y.tolist() == [50, 0, 630, 50]
    assert parsed == []
    for other in ([], [1.0, 2.0], np.array([2, 3]), torch.tensor([2, 3])):
        parsed.clear()
        expected = [int(i) * 10 for i in real(other, dtype=torch.long)]
        assert ds.__getitems__(other).columns[1].tolist() == expected
        assert parsed and parsed[0] is other
    with pytest.raises((ValueError, OverflowError)):
        ds.__getitems__([2**64])
