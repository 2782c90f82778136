"""A directory put is one batch version with one manifest (issue 22, item 1): entry ``n`` in
``objects/<batch>/<n>/`` (a ``.npy`` over ``PACK_MAX``; smaller ones are packed into the
manifest: ``test_batch_pack.py``), what each entry's ``meta.json`` said in
``objects/<batch>/manifest``.
Every per-key promise holds: its own info and checksums, its own eviction (which frees its
bytes; a process that maps it keeps reading), its own budget accounting, and ``cleanup``
removes an entry no link points at (an evict killed by SIGKILL halfway) without touching
the others. Real files on the tmpfs, real processes, real ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmcache import CorruptEntryError, KeyNotFoundError, Store
from shmcache._disk.entry_tree import CRASH_ENV

FILES = 6
ROWS = 1100  # 70,528-byte files: over PACK_MAX, each entry a directory of its own
WAIT_S = 120.0  # bound on every wait, so a broken build fails instead of hanging


def _sources(directory: Path, files: int = FILES, rows: int = ROWS) -> Path:
    """``files`` float32 arrays, file ``i`` filled with ``i`` (so a reader can tell)."""
    directory.mkdir(parents=True)
    for i in range(files):
        np.save(directory / f"f{i}.npy", np.full((rows, 16), i, dtype=np.float32))
    return directory


def _batch(root: Path) -> Path:
    (name,) = os.listdir(root / "objects")
    return root / "objects" / name


def test_a_directory_is_one_version_directory_and_one_manifest(
    store: Store, root: Path, tmp_path: Path
) -> None:
    keys = store.put_file("d", _sources(tmp_path / "src"))
    batch = _batch(root)
    assert sorted(os.listdir(batch)) == sorted([*map(str, range(FILES)), "manifest"])
    assert all(os.listdir(batch / str(i)) == ["data.npy"] for i in range(FILES))  # no meta.json
    for i, key in enumerate(keys):
        info = store.info(key)
        assert info.version == f"{batch.name}/{i}"
        assert os.readlink(store.layout.entry_link(key)) == f"../../objects/{batch.name}/{i}"
        assert (info.key, info.kind, info.dtype, info.shape) == (key, "array", "float32", (ROWS, 16))
        assert info.source == str(tmp_path / "src" / f"f{i}.npy") and info.size == ROWS * 16 * 4 + 128
        assert store.verify(key)  # the checksum the manifest recorded, against the file
        assert int(store.open_array(key)[0, 0]) == i
    assert [info.key for info in store.list("d")] == keys
    manifest = os.stat(batch / "manifest").st_blocks * 512  # its index: held while the batch is
    stats = store.stats()
    assert (stats.used, stats.packed_held) == (sum(store.info(k).size for k in keys) + manifest, manifest)


def test_evicting_one_key_frees_its_bytes_and_keeps_the_others(
    store: Store, root: Path, tmp_path: Path
) -> None:
    keys = store.put_file("d", _sources(tmp_path / "src"))
    batch = _batch(root)
    used = store.stats().used
    kept = store.open_array("d/f2")  # a process that maps it keeps reading it
    size = store.info("d/f2").size
    assert store.evict("d/f2") > 0
    assert not (batch / "2").exists() and (batch / "manifest").is_file()
    with pytest.raises(KeyNotFoundError):
        store.open_array("d/f2")
    assert int(kept[0, 0]) == 2
    assert store.stats().used == used - size  # per-key accounting
    assert [info.key for info in store.list("d")] == [k for k in keys if k != "d/f2"]
    assert all(int(store.open_array(k)[0, 0]) == int(k[-1]) for k in keys if k != "d/f2")
    for key in keys:  # the last entry takes the batch (and its manifest) with it
        if key != "d/f2":
            store.evict(key)
    assert os.listdir(root / "objects") == []


def test_replacing_one_key_of_a_directory_by_a_single_put(store: Store, root: Path, tmp_path: Path) -> None:
    store.put_file("d", _sources(tmp_path / "src"))
    batch = _batch(root)
    store.put_array("d/f1", np.arange(3), overwrite=True)
    assert not (batch / "1").exists()  # the replaced entry's directory went
    assert list(store.open_array("d/f1")) == [0, 1, 2] and int(store.open_array("d/f0")[0, 0]) == 0
    store.put_file("d", _sources(tmp_path / "again"), overwrite=True)
    assert len(os.listdir(root / "objects")) == 1  # the old batch went with its last entry
    assert int(store.open_array("d/f1")[0, 0]) == 1


def test_a_mapped_entry_of_a_batch_is_seen_mapped(store: Store, tmp_path: Path) -> None:
    store.put_file("d", _sources(tmp_path / "src"))
    mapped = store.open_array("d/f3")
    assert store.mapped_by("d/f3") == [os.getpid()]  # /proc maps: version "<batch>/<n>"
    assert store.mapped_by("d/f4") == []
    del mapped


def test_a_damaged_manifest_is_named(store: Store, root: Path, tmp_path: Path) -> None:
    store.put_file("d", _sources(tmp_path / "src"))
    manifest = _batch(root) / "manifest"
    manifest.write_bytes(manifest.read_bytes()[:40])  # truncated
    with pytest.raises(CorruptEntryError, match=r"'d/f1' is damaged: its manifest .* is damaged"):
        store.info("d/f1")
    manifest.unlink()
    with pytest.raises(CorruptEntryError, match="manifest of its directory put is missing"):
        store.verify("d/f1")
    assert int(store.open_array("d/f1")[0, 0]) == 1  # the open path reads no metadata


@pytest.mark.parametrize(
    ("where", "number"),
    [(8, 1 << 62), (16, 1 << 40), (16, 1 << 62), ("end of entry 1", 1 << 62), ("start of entry 1", 1 << 63)],
)
def test_a_manifest_with_a_huge_number_is_damaged_not_a_huge_read(
    store: Store, root: Path, tmp_path: Path, where: int | str, number: int
) -> None:
    """A count, common length or offset beyond the file is a CorruptEntryError (checked before
    any read, never an allocation of that size); the damaged key can still be evicted, and a
    put beside it under a budget (which counts every entry's bytes) still works."""
    store.put_file("d", _sources(tmp_path / "src"))
    manifest = _batch(root) / "manifest"
    data = bytearray(manifest.read_bytes())
    table = int.from_bytes(data[24:32], "little")  # format 2: where the offsets start
    offset = where if isinstance(where, int) else table + 8 * (1 if where.startswith("start") else 2)
    data[offset : offset + 8] = number.to_bytes(8, "little")
    manifest.write_bytes(bytes(data))
    key = "d/f1"
    with pytest.raises(CorruptEntryError, match=rf"'{key}' is damaged: its manifest .* is damaged"):
        store.info(key)
    store.set_budget(1 << 30)
    store.put_array("beside", np.arange(10))
    assert store.evict(key) > 0 and not store.exists(key)


def test_cleanup_removes_the_entry_of_an_evict_killed_halfway(root: Path, tmp_path: Path) -> None:
    """An evict killed by SIGKILL after unlinking the key's link, before removing its
    directory: ``cleanup`` removes that entry alone, the batch stays for the others."""
    store = Store(root)
    keys = store.put_file("d", _sources(tmp_path / "src"))
    batch = _batch(root)
    env = {**os.environ, CRASH_ENV: "evict-unlinked"}
    code = f"import shmcache; shmcache.Store({str(root)!r}).evict('d/f4')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL
    assert (batch / "4").is_dir()  # left behind, no link to it
    store.cleanup()
    assert not (batch / "4").exists()
    assert sorted(os.listdir(batch)) == sorted([*(str(i) for i in range(FILES) if i != 4), "manifest"])
    assert [info.key for info in store.list()] == [k for k in keys if k != "d/f4"]
    assert all(store.verify(k) for k in keys if k != "d/f4")


def test_cleanup_removes_a_batch_left_with_its_manifest_alone(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """A batch whose entries are all gone but whose manifest stayed (a file system that
    counts no directory links, or an evict killed between the two): no link points in."""
    store.put_file("d", _sources(tmp_path / "src", files=2))
    batch = _batch(root)
    os.mkdir(batch / "extra")  # keeps the last evict from seeing the batch empty
    for key in ("d/f0", "d/f1"):
        store.evict(key)
    os.rmdir(batch / "extra")
    assert os.listdir(batch) == ["manifest"]
    store.cleanup()
    assert os.listdir(root / "objects") == []


def test_a_budget_evicts_entries_of_a_directory_one_by_one(root: Path, tmp_path: Path) -> None:
    """Budget accounting is per key: a put that needs room evicts single entries of an
    older directory (least recently used first), not the whole directory."""
    entry = 256 * 1024 * 4 + 128
    store = Store(root, max_bytes=int(entry * 5.5))
    keys = store.put_file("d", _sources(tmp_path / "src", files=4, rows=16384))
    store.put_array("big", np.zeros(2 * 256 * 1024, dtype=np.float32))  # room for 2 more entries
    left = [info.key for info in store.list("d")]
    assert 1 <= len(left) < len(keys) and set(left) <= set(keys)
    stats = store.stats()  # and the batch's manifest, held while any of its entries is
    assert stats.used == sum(info.size for info in store.list()) + stats.packed_held > stats.packed_held > 0
    assert all(store.verify(key) for key in left)


def test_a_manifest_entry_says_what_the_meta_json_of_a_single_put_says(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """The manifest's formatted objects hold every field, of the same types, that
    ``meta.json`` holds for the same file put alone: readers cannot tell them apart."""
    from shmcache._disk.meta import read_entry_meta

    source = _sources(tmp_path / "src", files=2)
    np.save(source / "f1.npy", np.ones((3, 2), dtype=">i2", order="F"))  # big-endian, Fortran order
    store.put_file("alone", source / "f1.npy")
    store.put_file("d", source)
    single = read_entry_meta(store.layout, "alone", store.info("alone").version)
    batched = read_entry_meta(store.layout, "d/f1", store.info("d/f1").version)
    assert single is not None and batched is not None
    varying = {"key", "version", "created"}
    assert {k: v for k, v in batched.raw.items() if k not in varying} == {
        k: v for k, v in single.raw.items() if k not in varying
    }
    assert batched.key == "d/f1" and batched.version == store.info("d/f1").version
