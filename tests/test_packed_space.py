"""What packed entries hold after eviction counts against the budget and in ``stats``:
evicting a packed entry clears its live byte but frees no memory (the manifest's pages
return with its batch's last entry), so ``stats().used``, ``packed_held`` and every put
under a budget count the manifest's allocated bytes. Real files on the tmpfs, real puts
and evictions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, invoke
from service_helpers import running_daemon

from shmcache import CacheFullError, Store
from shmcache._disk.layout import packed_range

COUNT = 200
ENTRY = 64 * 200 * 4 + 128  # a 64 x 200 float32 .npy: 51,328 bytes, packed (<= 64 KiB)


def _put_small_dir(store: Store, folder: Path) -> Path:
    """A directory put of ``COUNT`` packed entries; the path of its batch's manifest."""
    folder.mkdir()
    for i in range(COUNT):
        np.save(folder / f"f{i}.npy", np.full((64, 200), i, np.float32))
    store.put_file("d", folder)
    packed = packed_range(store.info("d/f0").version)
    assert packed is not None
    return store.root / "objects" / packed[0] / "manifest"


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def _objects_allocated(root: Path) -> int:
    """What the root's published objects really take on the tmpfs."""
    return sum(
        _allocated(Path(folder) / name) for folder, _, names in os.walk(root / "objects") for name in names
    )


def _evict_all_but_f0(store: Store) -> None:
    for i in range(1, COUNT):
        store.evict(f"d/f{i}")


def test_stats_count_what_evicted_packed_entries_still_hold(store: Store, tmp_path: Path) -> None:
    manifest = _put_small_dir(store, tmp_path / "src")
    full = store.stats()
    assert full.used - full.packed_held == COUNT * ENTRY and full.used >= _allocated(manifest)
    _evict_all_but_f0(store)
    stats = store.stats()
    assert stats.entries == 1 and manifest.exists()
    assert stats.used >= _allocated(manifest) > 100 * ENTRY  # not just the one entry left
    assert stats.packed_held == stats.used - ENTRY
    store.evict("d/f0")  # the batch's last entry: the manifest goes, its pages return
    assert not manifest.exists()
    assert (store.stats().used, store.stats().packed_held) == (0, 0)


def test_a_put_frees_the_batch_it_needs_or_is_refused(store: Store, tmp_path: Path) -> None:
    """The reviewer's case: 199 of 200 packed entries evicted, a 2 MB budget, a 1.8 MB put.
    It must not fit beside the ~10 MB the manifest still holds: with the last entry
    evictable, evicting it frees the whole batch; mapped here, the put is refused."""
    manifest = _put_small_dir(store, tmp_path / "src")
    _evict_all_but_f0(store)
    store.set_budget(2_000_000)
    mapped = store.open_array("d/f0")
    with pytest.raises(CacheFullError, match="within the budget"):
        store.put_array("x", np.zeros(1_800_000 // 8))
    assert not store.exists("x") and store.exists("d/f0") and manifest.exists()  # changed nothing
    assert int(mapped[0, 0]) == 0
    del mapped
    store.put_array("x", np.zeros(1_800_000 // 8))
    assert not store.exists("d/f0") and not manifest.exists()  # the batch went, with its pages
    assert store.stats().used <= 2_000_000 and _objects_allocated(store.root) <= 2_000_000 + 64 * 1024


def test_stats_cli_doctor_and_daemon_say_what_is_held(store: Store, root: Path, tmp_path: Path) -> None:
    """``shmcache stats`` (text and JSON), ``doctor``'s budget check and the daemon's
    ``GET /v1/stats`` report the held bytes, and say what frees them."""
    manifest = _put_small_dir(store, tmp_path / "src")
    _evict_all_but_f0(store)
    code, out, err = cli("stats", "--root", str(root), "--json", "--local")
    assert code == 0, err
    report = json.loads(out)
    assert report["used"] >= _allocated(manifest) and report["packed_held"] == report["used"] - ENTRY
    code, out, err = cli("stats", "--root", str(root), "--local")
    assert code == 0 and "packed:" in out and "freed with the rest of that put" in out, (out, err)
    result = invoke("doctor", "--root", str(root), "--json")
    budget = {check["name"]: check for check in json.loads(result.stdout)["checks"]}["budget"]
    assert budget["details"]["packed_held"] == report["packed_held"]
    assert "evicting the rest of that directory put" in budget["summary"]
    with running_daemon(root) as daemon, daemon.client() as client:
        served = client.get("/v1/stats").json()
    assert (served["used"], served["packed_held"]) == (report["used"], report["packed_held"])


def test_a_mixed_batch_frees_its_manifest_only_with_its_last_entry(store: Store, tmp_path: Path) -> None:
    """A batch with an entry directory beside its packed entries keeps its manifest while
    that directory's key is linked: evicting its last packed entry frees nothing, so a put
    that needs those bytes (the directory's key mapped here) is refused, not let overshoot."""
    manifest = _mixed_batch(store, tmp_path / "src")
    for i in range(1, 100):
        store.evict(f"d/f{i}")
    used = store.stats().used
    assert used >= _allocated(manifest)
    store.set_budget(used + 100_000)
    mapped = store.open_array("d/big")
    with pytest.raises(CacheFullError, match="within the budget"):
        store.put_array("x", np.zeros(1_000_000, np.uint8))
    assert store.exists("d/f0") and not store.exists("x") and manifest.exists()
    del mapped


def _mixed_batch(store: Store, folder: Path) -> Path:
    """A directory put of 100 packed entries and one entry directory (``d/big``); the
    path of its batch's manifest."""
    folder.mkdir()
    for i in range(100):
        np.save(folder / f"f{i}.npy", np.full((64, 200), i, np.float32))
    np.save(folder / "big.npy", np.zeros(200_000, np.uint8))  # over 64 KiB: a directory of its own
    store.put_file("d", folder)
    packed = packed_range(store.info("d/f0").version)
    assert packed is not None and packed_range(store.info("d/big").version) is None
    return store.root / "objects" / packed[0] / "manifest"


def test_a_batch_whose_packed_entries_are_all_evicted_still_counts_its_manifest(
    store: Store, tmp_path: Path
) -> None:
    """Evicting every packed entry of a mixed batch leaves its manifest (and its pages)
    while ``d/big`` is linked: ``used`` counts it, as the tmpfs does, until ``d/big`` goes."""
    manifest = _mixed_batch(store, tmp_path / "src")
    for i in range(100):
        store.evict(f"d/f{i}")
    stats = store.stats()
    big = store.info("d/big").size
    assert stats.entries == 1 and manifest.exists()
    assert stats.packed_held == _allocated(manifest) > 100 * ENTRY
    assert stats.used == big + stats.packed_held
    assert stats.used >= _objects_allocated(store.root) - 64 * 1024  # all but the headers' pages
    store.evict("d/big")
    assert not manifest.exists() and (store.stats().used, store.stats().packed_held) == (0, 0)


def test_evicting_the_entry_directory_of_such_a_batch_frees_room_for_its_manifest_too(
    store: Store, tmp_path: Path
) -> None:
    """Budget eviction credits the manifest when the batch's last entry (an entry
    directory) goes: a put that needs those bytes evicts ``d/big`` and fits, and the
    tmpfs then holds no more than the budget."""
    manifest = _mixed_batch(store, tmp_path / "src")
    for i in range(100):
        store.evict(f"d/f{i}")
    held = _objects_allocated(store.root)  # d/big and the manifest, as the tmpfs counts them
    store.set_budget(held + 100_000)
    store.put_array("x", np.zeros(held - 300_000, np.uint8))  # fits only once the manifest goes
    assert not store.exists("d/big") and not manifest.exists() and store.exists("x")
    assert store.stats().used <= held + 100_000
    assert _objects_allocated(store.root) <= held + 100_000
