"""Blobs: a directory, a list of files or a mapping of bytes as one entry (``put_blobs``,
``open_blobs``, ``put_file`` of a directory of other files), on real tmpfs roots."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shmcache
from shmcache import (
    CacheFullError,
    CorruptSourceError,
    InvalidSourceError,
    SharedBlobs,
    SourceNotAllowedError,
    Store,
    UnsupportedDataError,
)
from shmcache._disk.mapped import MappedFile, mapped_base
from shmcache._sources import blobs as blobs_module
from tests.container_datasets import BlobsDataset
from tests.source_times import age

FILES = {
    "b.bin": bytes(range(256)) * 5,
    "a/c.jpg": b"\xff\xd8\xff\xe0 jpeg-ish \x00\x01",
    "a/deeper/empty": b"",
    "a/deeper/z.txt": "héllo\n".encode(),
    "zz": os.urandom(300_000),
}


def _tree(top: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, content in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(content)
    return top


def _nothing_published(store: Store, root: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub


def _same(blobs: SharedBlobs, expected: dict[str, bytes]) -> None:
    assert list(blobs.names) == list(expected)
    assert [bytes(b) for b in blobs] == list(expected.values())
    for name, content in expected.items():
        assert bytes(blobs[name]) == content


@pytest.mark.parametrize("threads", [1, 4])
def test_directory_round_trip(
    store: Store, tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs_module, "COPY_THREADS", threads)
    top = _tree(tmp_path / "src")
    info = store.put_blobs("imgs", top)
    assert (info.kind, info.dtype, info.shape, info.source) == ("blobs", "bytes", (5,), str(top))
    blobs = store.open_blobs("imgs")
    _same(blobs, dict(sorted(FILES.items())))  # sorted relative POSIX names
    assert len(blobs) == 5 and blobs.nbytes == sum(map(len, FILES.values()))
    assert blobs.sizes.tolist() == [len(FILES[n]) for n in sorted(FILES)]
    assert store.verify("imgs") is True  # the checksums recorded are those of the bytes written
    listed = store.list()[0]
    assert (listed.key, listed.dtype, listed.shape) == ("imgs", "bytes", (5,))


def test_items_are_zero_copy_read_only_uint8_views(store: Store, tmp_path: Path) -> None:
    store.put_blobs("imgs", _tree(tmp_path))
    blobs = shmcache.open_blobs("imgs", root=store.root)
    for item in (blobs[0], blobs["zz"], blobs[-1], *blobs[1:3]):
        assert item.dtype == np.uint8 and item.ndim == 1
        assert not item.flags.writeable
        assert isinstance(mapped_base(item), MappedFile)  # a view of the mapping, no copy
        with pytest.raises(ValueError, match="read-only"):
            item[:1] = 0
    assert blobs["a/deeper/empty"].shape == (0,)


def test_index_by_position_and_name(store: Store, tmp_path: Path) -> None:
    store.put_blobs("imgs", _tree(tmp_path))
    blobs = store.open_blobs("imgs")
    names = sorted(FILES)
    assert bytes(blobs[-1]) == FILES[names[-1]] and bytes(blobs[1]) == FILES[names[1]]
    assert [bytes(b) for b in blobs[::2]] == [FILES[n] for n in names[::2]]
    assert "a/c.jpg" in blobs and "c.jpg" not in blobs and b"zz" not in blobs
    assert blobs.index("zz") == names.index("zz")
    with pytest.raises(KeyError):
        blobs["missing.jpg"]
    with pytest.raises(IndexError):
        blobs[5]
    with pytest.raises(ValueError, match="not a name"):
        blobs.index("missing.jpg")


def test_open_any_kind_group_and_pickle_by_reference(store: Store, tmp_path: Path) -> None:
    store.put_blobs("set/imgs", _tree(tmp_path))
    store.put_array("set/labels", np.arange(5))
    opened = store.open("set/imgs")
    assert isinstance(opened, SharedBlobs)
    assert isinstance(store.open_group("set")["imgs"], SharedBlobs)
    data = pickle.dumps(opened)
    assert len(data) < 512  # a reference, not 300 KB of bytes
    again = pickle.loads(data)
    assert bytes(again["zz"]) == FILES["zz"]
    with pytest.raises(UnsupportedDataError, match="open_blobs"):
        store.open_array("set/imgs")


def test_list_of_paths_names(store: Store, tmp_path: Path) -> None:
    _tree(tmp_path)
    paths = [tmp_path / "zz", tmp_path / "a" / "c.jpg"]
    store.put_blobs("unique", paths)  # unique base names: the base names, in the order given
    _same(store.open_blobs("unique"), {"zz": FILES["zz"], "c.jpg": FILES["a/c.jpg"]})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c.jpg").write_bytes(b"other")
    store.put_blobs("clash", [str(tmp_path / "a" / "c.jpg"), tmp_path / "b" / "c.jpg"])
    _same(store.open_blobs("clash"), {"a/c.jpg": FILES["a/c.jpg"], "b/c.jpg": b"other"})
    with pytest.raises(InvalidSourceError, match="listed twice"):
        store.put_blobs("twice", [tmp_path / "zz", tmp_path / "zz"])


def test_mapping_of_bytes(store: Store) -> None:
    content = {
        "x/1.png": b"\x89PNG\r\n",
        "y": bytearray(b"\x00" * 10),
        "z": np.arange(7, dtype=np.uint8),
        "w": memoryview(b"abc"),
        "e": b"",
    }
    store.put_blobs("m", content)
    _same(store.open_blobs("m"), {k: bytes(v) for k, v in content.items()})
    assert store.verify("m") is True


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ({"a": "text"}, UnsupportedDataError, "not bytes-like"),
        ({"/abs": b""}, InvalidSourceError, "not a relative path"),
        ({"a/../b": b""}, InvalidSourceError, "not a relative path"),
        ({"a//b": b""}, InvalidSourceError, "not a relative path"),
        ({"nul\0": b""}, InvalidSourceError, "not a relative path"),
        ({"\udcff": b""}, InvalidSourceError, "not valid UTF-8"),
        ({1: b""}, UnsupportedDataError, "must be str"),
        ({}, InvalidSourceError, "empty"),
        ([], InvalidSourceError, "empty"),
        (b"bytes", UnsupportedDataError, "a directory, a list of paths or a mapping"),
    ],
)
def test_bad_mapping_or_list_publishes_nothing(
    store: Store, root: Path, source: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        store.put_blobs("bad", source)  # type: ignore[arg-type]
    _nothing_published(store, root)


def test_empty_directory_and_missing_source(store: Store, root: Path, tmp_path: Path) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(InvalidSourceError, match="holds no files") as info:
        store.put_blobs("k", tmp_path / "empty")
    assert str(tmp_path / "empty") in str(info.value)
    with pytest.raises(shmcache.SourceNotFoundError):
        store.put_blobs("k", tmp_path / "missing")
    _nothing_published(store, root)


def test_symlinks_to_files_are_followed_to_directories_refused(store: Store, tmp_path: Path) -> None:
    outside = _tree(tmp_path / "outside", {"real.bin": b"real bytes"})
    top = _tree(tmp_path / "top", {"own": b"own"})
    (top / "link.bin").symlink_to(outside / "real.bin")
    store.put_blobs("k", top)
    _same(store.open_blobs("k"), {"link.bin": b"real bytes", "own": b"own"})
    (top / "dirlink").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidSourceError, match="symlink to a directory") as info:
        store.put_blobs("k2", top)
    assert str(top / "dirlink") in str(info.value)
    assert [e.key for e in store.list()] == ["k"]
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "x.npy", np.arange(2))
    (arrays / "dirlink").symlink_to(outside, target_is_directory=True)
    assert store.put_file("arr", arrays) == ["arr/x"]  # deciding auto skips links, as arrays do


def test_allowed_dirs_refuse_links_out(store: Store, tmp_path: Path) -> None:
    outside = _tree(tmp_path / "outside", {"secret": b"no"})
    top = _tree(tmp_path / "top", {"own": b"own"})
    store.put_blobs("ok", top, allowed_dirs=[top])
    (top / "leak").symlink_to(outside / "secret")
    with pytest.raises(SourceNotAllowedError) as info:
        store.put_blobs("k", top, allowed_dirs=[top])
    assert str(top / "leak") in str(info.value)
    assert [e.key for e in store.list()] == ["ok"]


def test_special_file_and_undecodable_name(store: Store, root: Path, tmp_path: Path) -> None:
    top = _tree(tmp_path / "fifo", {"a": b"a"})
    os.mkfifo(top / "pipe")
    with pytest.raises(InvalidSourceError, match="not a regular file") as info:
        store.put_blobs("k", top)  # refused at once, never blocks on the FIFO
    assert str(top / "pipe") in str(info.value)
    odd = _tree(tmp_path / "odd", {"a": b"a"})
    os.close(os.open(os.fsencode(odd) + b"/\xff.jpg", os.O_CREAT | os.O_WRONLY, 0o600))
    with pytest.raises(InvalidSourceError, match="not valid UTF-8"):
        store.put_blobs("k", odd)
    _nothing_published(store, root)


@pytest.mark.parametrize("change", ["grows", "shrinks"])
@pytest.mark.parametrize("held", [True, False], ids=["held-descriptor", "reopened"])
def test_a_file_changed_after_its_check_fails_the_put(
    store: Store, root: Path, tmp_path: Path, change: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not held:  # past the descriptors kept open, files are opened (and checked) again
        monkeypatch.setattr(blobs_module, "_descriptors_to_hold", lambda: 0)
    top = _tree(tmp_path, {f"{i:02d}.bin": os.urandom(50_000) for i in range(20)})
    victim = top / "07.bin"

    def progress(done: int, total: int) -> None:
        if done == 0:  # after every file was checked, before any byte is copied
            with open(victim, "r+b") as fp:
                if change == "grows":
                    fp.seek(0, os.SEEK_END)
                    fp.write(b"more")
                else:
                    fp.truncate(1000)

    with pytest.raises(CorruptSourceError, match="changed") as info:
        store.put_blobs("k", top, progress=progress)
    assert str(victim) in str(info.value)
    _nothing_published(store, root)


def test_budget_exceeded_publishes_nothing(root: Path, tmp_path: Path) -> None:
    store = Store(root, max_bytes=100_000)
    with pytest.raises(CacheFullError):
        store.put_blobs("k", _tree(tmp_path))
    _nothing_published(store, root)


def test_put_file_auto_arrays_blobs_and_mixed(store: Store, root: Path, tmp_path: Path) -> None:
    images = _tree(tmp_path / "images")
    assert store.put_file("imgs", images) == ["imgs"]  # no array files: one blobs entry
    _same(store.open_blobs("imgs"), dict(sorted(FILES.items())))
    assert store.plan_file("imgs2", images)[0].size >= sum(map(len, FILES.values()))

    mixed = _tree(tmp_path / "mixed", {"notes.txt": b"n"})
    np.save(mixed / "x.npy", np.arange(3))
    with pytest.raises(InvalidSourceError, match="--as arrays") as info:
        store.put_file("mixed", mixed)
    assert str(mixed) in str(info.value) and "--as blobs" in str(info.value)
    with pytest.raises(InvalidSourceError, match="--as arrays"):
        store.plan_file("mixed", mixed)
    assert store.put_file("mixed", mixed, as_="arrays") == ["mixed/x"]
    assert store.put_file("raw", mixed, as_="blobs") == ["raw"]
    raw = store.open_blobs("raw")
    assert list(raw.names) == ["notes.txt", "x.npy"]
    assert bytes(raw["x.npy"]) == (mixed / "x.npy").read_bytes()
    assert store.put_file("one", mixed / "notes.txt", as_="blobs") == ["one"]
    assert list(store.open_blobs("one").names) == ["notes.txt"]
    with pytest.raises(ValueError, match="no kind put_file makes"):
        store.put_file("k", mixed, as_="images")


@pytest.mark.parametrize("method", ["spawn"])
def test_blobs_in_spawn_dataloader_workers(store: Store, tmp_path: Path, method: str) -> None:
    files = {f"{i:03d}.jpg": os.urandom(1000 + 37 * i) for i in range(40)}
    store.put_blobs("imgs", _tree(tmp_path, files))
    dataset = BlobsDataset(str(store.root))
    assert len(pickle.dumps(dataset)) < 1024
    loader = DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context=method, timeout=120)
    got: dict[int, bytes] = {}
    pids: set[int] = set()
    for batch in loader:
        indices, pid_list = batch["index"].tolist(), batch["pid"].tolist()
        got.update(zip(indices, batch["bytes"], strict=True))
        pids.update(pid_list)
    assert got == {i: files[name] for i, name in enumerate(sorted(files))}
    assert os.getpid() not in pids and len(pids) == 2
    assert isinstance(batch["index"], torch.Tensor)


def test_preload_sees_a_packed_directory_unchanged_until_a_file_changes(store: Store, tmp_path: Path) -> None:
    """A daemon restart skips the config preload of an image folder that did not change
    (it used to repack it at every start), and repacks it after any file changes."""
    pytest.importorskip("fastapi")
    from shmcache.service.sources import is_up_to_date

    top = _tree(tmp_path / "images")
    age(top)  # else racily clean (source_files.RACY_NS): never current
    store.put_file("imgs", top)
    assert store.info("imgs").kind == "blobs" and is_up_to_date(store, "imgs", top)
    (top / "b.bin").write_bytes(b"changed, and shorter")
    assert not is_up_to_date(store, "imgs", top)
    age(top)
    store.put_file("imgs", top, overwrite=True)
    assert is_up_to_date(store, "imgs", top)
    (top / "new.jpg").write_bytes(b"")
    assert not is_up_to_date(store, "imgs", top)
