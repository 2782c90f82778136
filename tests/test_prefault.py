"""Issue 22 item 3: a ``CachedDataset`` maps its columns' pages in up front (no page fault
per 64 KiB of random rows), on huge pages where the tmpfs holds them, and copy-on-write
still keeps every write out of the cache; ``doctor`` says which pages entries get."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from service_helpers import mounted_tmpfs

import shmcache
from shmcache._disk.attach import prefault

pytest.importorskip("torch")

MiB = 1 << 20

# Run in a fresh process: its only mappings of the entry are the ones the code makes.
_MAPPED = """
import json, sys, numpy as np, shmcache, shmcache.torch
from shmcache._disk.attach import prefault
key, mode = sys.argv[1], sys.argv[2]
if mode == "dataset":
    ds = shmcache.torch.CachedDataset(key)
    ds[0]
elif mode == "limit":
    prefault(shmcache.open_array(key), limit=1)
    shmcache.open_array(key)[0]
version = shmcache.get_store().info(key).version
rss = pmd = 0
inside = False
for line in open("/proc/self/smaps"):
    first = line.split()[0]
    if not first.endswith(":") or "-" in first:  # a mapping's first line
        inside = line.rstrip().endswith(f"/{version}/data.npy")
    elif inside and first == "Rss:":
        rss = max(rss, int(line.split()[1]) * 1024)
    elif inside and first in ("FilePmdMapped:", "ShmemPmdMapped:"):
        pmd = max(pmd, int(line.split()[1]) * 1024)
print(json.dumps({"rss": rss, "pmd": pmd}))
"""


def _mapped(key: str, mode: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _MAPPED, key, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_dataset_maps_its_columns_pages_in_up_front(root: Path) -> None:
    shmcache.put_array("feats", np.ones((8 * MiB // 1024, 256), np.float32))
    # One row read: without prefaulting, the kernel maps only the 64 KiB around it.
    assert _mapped("feats", "dataset")["rss"] >= 8 * MiB


def test_prefault_leaves_an_entry_over_its_limit_to_page_faults(root: Path) -> None:
    shmcache.put_array("feats", np.ones((8 * MiB // 1024, 256), np.float32))
    assert _mapped("feats", "limit")["rss"] < MiB
    assert prefault(np.ones(3)) is False  # not an entry: nothing to map


def test_prefaulted_columns_stay_copy_on_write(root: Path) -> None:
    import shmcache.torch

    shmcache.put_array("feats", np.zeros((4096, 16), np.float32))
    ds = shmcache.torch.CachedDataset("feats")
    row = ds[5]
    row += 7  # in place, through the tensor's own private mapping
    assert float(ds[5][0]) == 7.0
    check = "import shmcache; print(float(shmcache.open_array('feats')[5].max()))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert float(out.stdout) == 0.0  # the cache (and every other process) keeps the original


def test_a_huge_page_tmpfs_gives_entries_huge_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted_tmpfs(tmp_path / "huge", "size=64m,huge=within_size,mode=0700") as mount:
        cache = mount / "cache"
        monkeypatch.setenv("SHMCACHE_ROOT", str(cache))
        shmcache.put_array("feats", np.ones((8 * MiB // 1024, 256), np.float32))
        mapped = _mapped("feats", "dataset")
        assert mapped["rss"] >= 8 * MiB and mapped["pmd"] >= 2 * MiB
        report = json.loads(invoke("doctor", "--json", "--root", str(cache)).stdout)
        check = {c["name"]: c for c in report["checks"]}["huge_pages"]
        assert check["details"]["huge"] == "within_size" and "2 MiB pages" in check["summary"]


def test_doctor_says_which_pages_entries_get(root: Path) -> None:
    report = json.loads(invoke("doctor", "--json", "--root", str(root)).stdout)
    check = {c["name"]: c for c in report["checks"]}["huge_pages"]
    assert check["status"] == "ok" and check["details"]["fs_type"] == "tmpfs"
    if check["details"]["huge"] == "never" and check["details"]["shmem_enabled"] != "force":
        assert "4 KiB pages" in check["summary"] and "huge=within_size" in check["fix"]
