"""Entries other than arrays and tables from URLs (issue 21 items 5 and 6), against a real
S3-compatible server on loopback (moto's server mode; s3fs as the client): Megatron
``.bin``/``.idx`` pairs, prefixes of other files as blobs and WebDataset ``.tar`` shards.
Each entry is compared file for file, byte for byte, with a local put of the same files;
damaged input gives the local path's typed error and publishes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3_helpers import MotoServer
from test_token_files import _hostile_index
from token_datasets import write_megatron

import shmcache
from shmcache._disk.layout import Layout, packed_range
from shmcache._disk.meta import read_meta
from shmcache.errors import (
    CorruptSourceError,
    InvalidSourceError,
    ShmCacheError,
    SourceNotFoundError,
    UnsupportedDataError,
)

_DOCUMENTS = [[[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9, 10], [11]]]


def _upload(s3: MotoServer, bucket: str, prefix: str, files: list[Path]) -> None:
    for path in files:
        s3.boto().put_object(Bucket=bucket, Key=f"{prefix}{path.name}", Body=path.read_bytes())


def _staging(root: Path) -> list[Path]:
    tmp = Layout(root).tmp
    return [p for p in tmp.iterdir() if p.is_dir()] if tmp.is_dir() else []


def _entry_files(store: shmcache.Store, root: Path, key: str) -> tuple[dict[str, bytes], dict]:  # type: ignore[type-arg]
    """The entry's ``.npy`` files and its ``meta.json`` less what differs between two puts."""
    layout = Layout(root)
    name = store.info(key).version  # "<batch>/<n>" for an entry of a directory put
    version = layout.objects / name
    packed = packed_range(name)  # a small entry packed into its batch's manifest
    if packed is not None:
        with open(layout.objects / packed[0] / "manifest", "rb") as fp:
            fp.seek(packed[2])
            files = {"data.npy": fp.read(packed[3])}
    else:
        files = {p.name: p.read_bytes() for p in sorted(version.iterdir()) if p.name != "meta.json"}
    record = read_meta(layout, name)  # meta.json, or the batch manifest's record
    assert record is not None
    meta = record.to_json()
    for name in ("version", "created", "source", "source_fingerprint", "source_identity", "key"):
        meta.pop(name, None)
    return files, meta


def _same_as_local(store: shmcache.Store, root: Path, remote: str, local: str) -> None:
    remote_files, remote_meta = _entry_files(store, root, remote)
    local_files, local_meta = _entry_files(store, root, local)
    assert remote_files == local_files and remote_meta == local_meta
    assert store.verify(remote)


# ---------------------------------------------------------------------- Megatron pairs


@pytest.mark.parametrize("given", [".idx", ".bin", ""])
def test_a_megatron_pair_is_the_ragged_entry_a_local_put_makes(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path, given: str
) -> None:
    files = write_megatron(tmp_path / "corpus_text_document", _DOCUMENTS)
    _upload(s3, bucket, "mg/", list(files))
    url = f"s3://{bucket}/mg/corpus_text_document{given}"
    [planned] = store.plan_file("r", url, storage_options=s3.options())
    assert planned.key == "r" and planned.source == f"s3://{bucket}/mg/corpus_text_document.bin"
    assert store.put_file("r", url, storage_options=s3.options(), part_size=8) == ["r"]
    store.put_file("l", files[0])
    _same_as_local(store, root, "r", "l")
    ragged = store.open_ragged("r")
    assert [list(ragged[i]) for i in range(len(ragged))] == [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    assert store.info("r").source == planned.source


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        ("magic", CorruptSourceError, "not a Megatron index"),
        ("version", UnsupportedDataError, "index version 2"),
        ("huge count", CorruptSourceError, "counts 1152921504606846976 sequences"),
        ("pointer", CorruptSourceError, "sequence 1 starts at byte 2, not 6"),
        ("bounds", CorruptSourceError, "document boundaries must rise from 0"),
        ("short bin", CorruptSourceError, "counts 5 uint16 tokens"),
    ],
)
def test_a_hostile_megatron_index_gives_the_local_error(
    store: shmcache.Store,
    root: Path,
    s3: MotoServer,
    bucket: str,
    tmp_path: Path,
    damage: str,
    error: type[Exception],
    message: str,
) -> None:
    idx_path = _hostile_index(tmp_path, damage)
    _upload(s3, bucket, "", [idx_path, idx_path.with_suffix(".bin")])
    url = f"s3://{bucket}/{idx_path.name}"
    for call in (store.plan_file, store.put_file):
        with pytest.raises(error, match=message):
            call("h", url, storage_options=s3.options())
    with pytest.raises(error, match=message):
        store.put_file("h", idx_path)
    assert store.list() == [] and not _staging(root)


def test_an_index_without_its_bin_or_a_bin_changed_meanwhile_publishes_nothing(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    bin_path, idx_path = write_megatron(tmp_path / "m", _DOCUMENTS)
    _upload(s3, bucket, "", [idx_path])
    with pytest.raises(SourceNotFoundError, match=r"m\.bin does not exist"):
        store.put_file("m", f"s3://{bucket}/m.idx", storage_options=s3.options())
    _upload(s3, bucket, "", [bin_path])
    changed: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not changed:  # the same size, other tokens: only the ETag tells
            s3.boto().put_object(Bucket=bucket, Key="m.bin", Body=bin_path.read_bytes()[::-1])
            changed.append(True)

    with pytest.raises(CorruptSourceError, match="its size or ETag is not what it was"):
        store.put_file("m", f"s3://{bucket}/m.idx", storage_options=s3.options(), part_size=4,
                       progress=rewrite_once)  # fmt: skip
    assert changed and store.list() == [] and not _staging(root)
    with pytest.raises(Exception, match="not uint32"):
        store.put_file("m", f"s3://{bucket}/m.bin", storage_options=s3.options(), dtype="uint32")
    assert store.put_file("m", f"s3://{bucket}/m.bin", storage_options=s3.options(), dtype="uint16") == ["m"]
    assert len(store.open_ragged("m")) == len(_DOCUMENTS)


# ---------------------------------------------------------------------- prefixes of other files: blobs


def _folder(top: Path) -> list[Path]:
    files = {"a.jpg": b"\xff\xd8" + bytes(range(256)) * 40, "b.txt": b"hello", "sub/c.json": b"{}",
             "sub/empty": b"", "z/big.bin": bytes(range(256)) * (1 << 14)}  # fmt: skip
    for name, body in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(body)
    return [top / name for name in files]


def test_a_prefix_of_other_files_is_the_blobs_entry_of_the_local_folder(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    for path in _folder(tmp_path / "imgs"):
        key = path.relative_to(tmp_path).as_posix()
        s3.boto().put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    url = f"s3://{bucket}/imgs/"
    [planned] = store.plan_file("r", url, storage_options=s3.options())
    assert planned.key == "r" and planned.source == url
    assert store.put_file("r", url, storage_options=s3.options()) == ["r"]
    store.put_file("l", tmp_path / "imgs")
    _same_as_local(store, root, "r", "l")
    assert bytes(store.open_blobs("r")["sub/c.json"]) == b"{}" and store.info("r").source == url
    s3.boto().put_object(Bucket=bucket, Key="imgs/w.npy", Body=b"not an array")  # now it holds an array
    assert store.put_file("ab", url, storage_options=s3.options(), as_="blobs") == ["ab"]
    assert sorted(store.open_blobs("ab").names) == sorted([*store.open_blobs("l").names, "w.npy"])  # type: ignore[attr-defined]
    assert store.put_file("one", f"s3://{bucket}/imgs/b.txt", storage_options=s3.options(), as_="blobs")
    store.put_file("one-l", tmp_path / "imgs" / "b.txt", as_="blobs")
    _same_as_local(store, root, "one", "one-l")
    with pytest.raises(ValueError, match="no kind put_file makes"):
        store.put_file("x", url, storage_options=s3.options(), as_="nope")


# ---------------------------------------------------------------------- tar shards


def test_tar_shards_at_a_url_are_the_blobs_entry_of_the_local_shards(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    from test_tar_shards import LONG, make_shards, write_shard

    everything = make_shards(tmp_path / "sh", count=3, per=5)
    write_shard(tmp_path / "sh" / "shard-003.tar", {LONG: b"long name", "big.bin": os.urandom(9 << 20)})
    _upload(s3, bucket, "sh/", sorted((tmp_path / "sh").iterdir()))
    for i, given in enumerate(("shard-{000..003}.tar", "shard-00*.tar")):
        url = f"s3://{bucket}/sh/{given}"
        [planned] = store.plan_file(f"r{i}", url, storage_options=s3.options())
        assert planned.key == f"r{i}" and planned.size > sum(len(b) for b in everything.values())
        assert store.put_file(f"r{i}", url, storage_options=s3.options()) == [f"r{i}"]
    store.put_file("l", str(tmp_path / "sh" / "shard-{000..003}.tar"))
    _same_as_local(store, root, "r0", "l")
    _same_as_local(store, root, "r1", "l")
    blobs = store.open_blobs("r0")
    assert bytes(blobs[LONG]) == b"long name" and bytes(blobs["000007.jpg"]) == everything["000007.jpg"]
    assert store.put_file("one", f"s3://{bucket}/sh/shard-001.tar", storage_options=s3.options())
    store.put_file("one-l", tmp_path / "sh" / "shard-001.tar")
    _same_as_local(store, root, "one", "one-l")


@pytest.mark.parametrize(
    "damage", ["truncated", "twice", "link", "dotdot", "gzip", "missing", "no end block", "list"]
)
def test_a_damaged_shard_at_a_url_gives_the_local_error(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path, damage: str
) -> None:
    import gzip
    import tarfile

    from test_tar_shards import _info, write_shard

    good = write_shard(tmp_path / "a.tar", {"x.jpg": b"x" * 3000})
    bad = tmp_path / ("b.tar.gz" if damage == "gzip" else "b.tar")
    if damage == "truncated":
        bad.write_bytes(write_shard(bad, {"y.jpg": os.urandom(5000)}).read_bytes()[:2048])
    elif damage == "twice":
        write_shard(bad, {"x.jpg": b"again"})
    elif damage == "link":
        with tarfile.open(bad, "w") as tar:
            tar.addfile(_info("l.jpg", 0, tarfile.SYMTYPE, "/etc/passwd"))
    elif damage == "dotdot":
        write_shard(bad, {"../evil": b"e"})
    elif damage == "gzip":
        bad.write_bytes(gzip.compress(good.read_bytes()))
    elif damage == "no end block":
        bad.write_bytes(write_shard(bad, {"y.jpg": b"y" * 512}).read_bytes()[:1024])
    elif damage == "list":
        write_shard(bad, {"y.jpg": b"y"})
    _upload(s3, bucket, "", [good] + ([] if damage == "missing" else [bad]))
    url = f"s3://{bucket}/{{a,b}}.tar" if damage != "gzip" else f"s3://{bucket}/b.tar.gz"
    if damage == "list":
        with pytest.raises(InvalidSourceError, match="one brace pattern"):
            store.put_file("s", [f"s3://{bucket}/{n}.tar" for n in "ab"], storage_options=s3.options())
        return
    local_source = str(bad if damage == "gzip" else tmp_path / "{a,b}.tar")
    with pytest.raises(ShmCacheError) as local:
        store.put_file("s", local_source)
    for call in (store.plan_file, store.put_file):
        with pytest.raises(type(local.value)) as remote:
            call("s", url, storage_options=s3.options())
        if damage != "missing":  # the same words; only where it is differs (a path, a URL)
            assert str(local.value).replace(f"{tmp_path}/", f"s3://{bucket}/") == str(remote.value)
    assert store.list() == [] and not _staging(root)


def test_a_shard_changed_during_the_load_publishes_nothing(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    from test_tar_shards import write_shard

    shard = write_shard(tmp_path / "c.tar", {f"{i}.bin": os.urandom(100_000) for i in range(100)})
    _upload(s3, bucket, "", [shard])
    changed: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not changed:
            body = bytearray(shard.read_bytes())
            body[600:700] = bytes(100)  # the same size: only the ETag tells
            s3.boto().put_object(Bucket=bucket, Key="c.tar", Body=bytes(body))
            changed.append(True)

    with pytest.raises(CorruptSourceError, match="its size or ETag is not what it was"):
        store.put_file("c", f"s3://{bucket}/c.tar", storage_options=s3.options(), progress=rewrite_once)
    assert changed and store.list() == [] and not _staging(root)


# ---------------------------------------------------------------------- strided torch views, HDF5 strings


def test_strided_torch_views_are_the_local_put_s_arrays(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """A non-contiguous view (a transpose, every other row) and several tensors over one
    storage: gathered from ranged reads as the local path gathers them from ``pread``."""
    torch = pytest.importorskip("torch")
    base = torch.arange(40_000, dtype=torch.float32).reshape(200, 200)
    state = {
        "t": base.t(),
        "rows": base[::2],
        "shared": base[10:20],
        "bf16": torch.arange(600, dtype=torch.bfloat16).reshape(20, 30).t(),
        "plain": torch.ones(7),
    }
    path = tmp_path / "s.pt"
    torch.save(state, path)
    _upload(s3, bucket, "", [path])
    keys = sorted(store.put_file("r", f"s3://{bucket}/s.pt", storage_options=s3.options(), part_size=4096))
    assert keys == sorted(f"r/{name}" for name in state)
    store.put_file("l", path)
    for name in state:
        _same_as_local(store, root, f"r/{name}", f"l/{name}")
    from shmcache.torch import as_tensor

    assert torch.equal(as_tensor(store.open_array("r/t")), base.t().contiguous())
    assert torch.equal(as_tensor(store.open_array("r/bf16")), state["bf16"].contiguous())


def test_hdf5_string_datasets_are_the_local_put_s_strings(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "s.h5"
    names = [f"name {i} é" for i in range(1000)] + [""]
    with h5py.File(path, "w") as h5:
        h5.create_dataset("names", data=names, dtype=h5py.string_dtype())
        h5.create_dataset("ids", data=np.arange(5))
        h5.create_dataset("grid", data=[["a", "b"], ["c", "d"]], dtype=h5py.string_dtype())
    _upload(s3, bucket, "", [path])
    url = f"s3://{bucket}/s.h5"
    with pytest.raises(UnsupportedDataError, match=r"s.h5\[grid\] is a 2-d dataset of variable-length"):
        store.put_file("r", url, storage_options=s3.options())
    assert store.list() == [] and not _staging(root)
    with h5py.File(path, "a") as h5:
        del h5["grid"]
    _upload(s3, bucket, "", [path])
    assert sorted(store.put_file("r", url, storage_options=s3.options())) == ["r/ids", "r/names"]
    store.put_file("l", path)
    _same_as_local(store, root, "r/names", "l/names")
    _same_as_local(store, root, "r/ids", "l/ids")
    assert list(store.open_strings("r/names")) == names


# ---------------------------------------------------------------------- requests


def test_the_tensors_of_a_checkpoint_are_read_in_parts_of_the_object_not_one_request_each(
    store: shmcache.Store, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """Neighbouring byte ranges of one object are read together: 200 small tensors cost a
    ranged GET per part of the object (and the index's), not one each."""
    from safetensors.numpy import save_file

    tensors = {f"t{i:03d}": np.full(100 + i, i, np.float32) for i in range(200)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    _upload(s3, bucket, "", [path])
    keys = store.put_file("m", f"s3://{bucket}/many.safetensors", storage_options=s3.options())
    assert len(keys) == 200 and all(store.verify(key) for key in keys)
    for name, array in tensors.items():
        np.testing.assert_array_equal(store.open_array(f"m/{name}"), array)
    assert len(s3.requests("GET", f"/{bucket}/many.safetensors")) <= 3  # the header, then one part
