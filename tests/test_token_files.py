"""Token files: raw 1-D memmaps (``put_file(..., dtype=)``, ``shmcache put --dtype``) and
Megatron ``.bin``/``.idx`` pairs (a ragged entry of documents), hostile indexes refused
before anything is copied."""

from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import Daemon, unique
from shmcache.client import Client
from token_datasets import write_megatron

import shmcache
from shmcache import Store
from shmcache.errors import CorruptSourceError, InvalidSourceError, UnsupportedDataError

# ---------------------------------------------------------------- raw token files


def test_raw_token_file_becomes_one_array(store: Store, tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, 10_001, dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)  # what nanoGPT's prepare.py writes
    assert store.put_file("train", path, dtype="uint16") == ["train"]
    array = store.open_array("train")
    assert array.dtype == np.uint16 and array.shape == (10_001,)
    np.testing.assert_array_equal(array, np.memmap(path, dtype=np.uint16, mode="r"))
    assert store.info("train").dtype == "uint16" and store.info("train").source == str(path)
    assert store.verify("train")
    planned = store.plan_file("train", path, dtype=np.uint16)
    assert [(p.key, p.size) for p in planned] == [("train", store.info("train").size)]
    tokens[:10_000].tofile(path)  # an even count of uint16 is a whole count of uint32
    shmcache.put_file("t32", path, dtype="uint32", root=store.root)  # any plain number dtype
    np.testing.assert_array_equal(store.open_array("t32"), tokens[:10_000].view(np.uint32))


def test_size_not_a_multiple_of_the_itemsize_is_refused(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(7))
    with pytest.raises(CorruptSourceError, match=r"odd\.bin holds 7 bytes, not a whole number of uint16"):
        store.put_file("odd", path, dtype="uint16")
    assert not store.exists("odd")


@pytest.mark.parametrize(
    ("dtype", "error", "message"),
    [
        (None, InvalidSourceError, "a raw token file needs its dtype"),
        ("object", UnsupportedDataError, "not a plain number type"),
        ("U4", UnsupportedDataError, "not a plain number type"),
        ("bool", UnsupportedDataError, "'bool' is not an integer type; a token file holds integer token ids"),
        ("f2", UnsupportedDataError, "'f2' is not an integer type; .* pass one of uint8, uint16"),
        ("float32", UnsupportedDataError, "'float32' is not an integer type"),
        ("c8", UnsupportedDataError, "'c8' is not an integer type"),
        ("nonsense", UnsupportedDataError, "is not a numpy dtype"),
    ],
)
def test_a_raw_token_file_needs_a_plain_dtype(
    store: Store, tmp_path: Path, dtype: str | None, error: type[Exception], message: str
) -> None:
    path = tmp_path / "train.bin"
    path.write_bytes(bytes(8))
    with pytest.raises(error, match=message):
        store.put_file("t", path, dtype=dtype)
    assert not store.exists("t")


def test_dtype_is_refused_where_the_source_says_its_own(store: Store, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(4))
    with pytest.raises(InvalidSourceError, match=r"a\.npy is a \.npy file, which says its own dtypes"):
        store.put_file("a", tmp_path / "a.npy", dtype="uint16")
    with pytest.raises(InvalidSourceError, match="is a directory"):
        store.put_file("a", tmp_path, dtype="uint16")
    with pytest.raises(InvalidSourceError, match=r"s3://bucket/a\.npy is a \.npy object, which says its own"):
        store.put_file("a", "s3://bucket/a.npy?X-Amz-Signature=s", dtype="uint16")  # tokens: remote_formats
    assert not store.exists("a")


def test_cli_put_with_dtype(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "val.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    code, out, err = cli("put", str(path), "-k", "val", "--dtype", "uint16", "--local", "--root", str(root))
    assert code == 0 and out.split() == ["val"], err
    np.testing.assert_array_equal(shmcache.open_array("val", root=root), np.arange(1000, dtype=np.uint16))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(3))
    code, out, err = cli("put", str(odd), "--key", "odd", "--dtype", "uint16", "--local", "--root", str(root))
    assert code != 0 and "not a whole number of uint16" in err


def _shard(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        member = tarfile.TarInfo("000000.txt")
        member.size = 5
        tar.addfile(member, io.BytesIO(b"hello"))
    return path


@pytest.mark.parametrize("shards", ["shard-000.tar", "shard-{000..000}.tar", "shard-*.tar", "list"])
def test_dtype_is_refused_for_tar_shards(store: Store, tmp_path: Path, shards: str) -> None:
    """An archive's bytes (headers, padding) were published as a 1-D "token" array."""
    _shard(tmp_path / "shard-000.tar")
    source: object = [tmp_path / "shard-000.tar"] if shards == "list" else tmp_path / shards
    with pytest.raises(InvalidSourceError, match="names tar shards, whose bytes are archive headers"):
        store.put_file("s", source, dtype="uint16")  # type: ignore[arg-type]
    with pytest.raises(InvalidSourceError, match="not tokens: put it without dtype"):
        store.plan_file("s", source, dtype="uint16")  # type: ignore[arg-type]
    assert not store.exists("s") and store.list() == []
    with pytest.raises(InvalidSourceError, match=r"s3://bucket/shards-\{0\.\.9\}\.tar names tar shards"):
        store.put_file("s", "s3://bucket/shards-{0..9}.tar", dtype="uint16")  # refused before any request


def test_dtype_is_refused_with_as_blobs(store: Store, tmp_path: Path) -> None:
    """as_="blobs" kept the file as bytes and dropped the dtype silently."""
    (tmp_path / "train.bin").write_bytes(bytes(8))
    with pytest.raises(InvalidSourceError, match="dtype= reads a raw token file as one array"):
        store.put_file("t", tmp_path / "train.bin", as_="blobs", dtype="uint16")
    assert not store.exists("t")


def test_cli_refuses_dtype_for_tar_shards_and_floats(root: Path, tmp_path: Path) -> None:
    shard = _shard(tmp_path / "shard-000.tar")
    code, out, err = cli("put", str(shard), "-k", "s", "--dtype", "uint16", "--local", "--root", str(root))
    assert code != 0 and out == "" and "names tar shards" in err and "Traceback" not in err
    (tmp_path / "train.bin").write_bytes(bytes(8))
    for dtype in ("bool", "f2"):
        code, out, err = cli(
            "put", str(tmp_path / "train.bin"), "-k", "t", "--dtype", dtype, "--local", "--root", str(root)
        )
        assert code != 0 and f"dtype {dtype!r} is not an integer type" in err, err
    assert shmcache.Store(root).list() == []


def test_cli_puts_a_glob_of_token_files_each_under_its_name(root: Path, tmp_path: Path) -> None:
    """Each match was put under ``key/<name>.bin`` (the suffix kept: .bin is no array
    suffix), a Megatron pair matched by ``*`` twice (its .bin and its .idx)."""
    data = tmp_path / "owt"
    data.mkdir()
    np.arange(100, dtype=np.uint16).tofile(data / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(data / "val.bin")
    code, out, err = cli(
        "put", str(data / "*.bin"), "-k", "owt", "--dtype", "uint16", "--local", "--root", str(root)
    )
    assert code == 0 and out.split() == ["owt/train", "owt/val"], err
    np.testing.assert_array_equal(shmcache.open_array("owt/val", root=root), np.arange(50, dtype=np.uint16))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_megatron(corpus / "books", [[[1, 2, 3]], [[4, 5]]])
    write_megatron(corpus / "web", [[[6, 7]]])
    code, out, err = cli("put", str(corpus / "*"), "-k", "c", "--local", "--root", str(root))
    assert code == 0 and out.split() == ["c/books", "c/web"], err
    assert [d.tolist() for d in shmcache.open_ragged("c/books", root=root)] == [[1, 2, 3], [4, 5]]
    _shard(data / "shard-000.tar")
    code, out, err = cli(
        "put", str(data / "*.tar"), "-k", "s", "--dtype", "uint16", "--local", "--root", str(root)
    )
    assert code == 1 and "names tar shards" in err and "does not exist" not in err, err
    assert sorted(e.key for e in shmcache.Store(root).list()) == ["c/books", "c/web", "owt/train", "owt/val"]


# ---------------------------------------------------------------- Megatron


@pytest.mark.parametrize("given", [".bin", ".idx", ""])  # "": the prefix, as Megatron names a dataset
def test_megatron_pair_becomes_a_ragged_entry_of_documents(store: Store, tmp_path: Path, given: str) -> None:
    documents = [[[1, 2, 3]], [[4], [5, 6]], [[7, 8, 9, 10]], [[]]]  # doc 1: two sequences
    bin_path, _ = write_megatron(tmp_path / "corpus_text_document", documents)
    assert store.put_file("corpus", tmp_path / f"corpus_text_document{given}") == ["corpus"]
    ragged = store.open_ragged("corpus")
    assert len(ragged) == 4
    assert [r.tolist() for r in ragged] == [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10], []]
    assert ragged.values.dtype == np.uint16
    info = store.info("corpus")
    assert info.kind == "ragged" and info.dtype == "uint16" and info.source == str(bin_path)
    assert store.verify("corpus")


def test_megatron_with_sequence_modes_and_int32(store: Store, tmp_path: Path) -> None:
    write_megatron(tmp_path / "m", [[[1, 2]], [[3]]], dtype="<i4", modes=True)
    store.put_file("m", tmp_path / "m.bin")
    assert [r.tolist() for r in store.open_ragged("m")] == [[1, 2], [3]]
    with pytest.raises(InvalidSourceError, match="says its tokens are int32, not uint16"):
        store.put_file("m", tmp_path / "m.idx", dtype="uint16", overwrite=True)


def _hostile_index(tmp_path: Path, damage: str) -> Path:
    bin_path, idx_path = write_megatron(tmp_path / "h", [[[1, 2, 3]], [[4, 5]]])
    raw = bytearray(idx_path.read_bytes())
    head = 9 + 8 + 1
    if damage == "magic":
        raw[:7] = b"NOTIDX!"
    elif damage == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif damage == "code":
        raw[17] = 42
    elif damage == "huge count":  # 2**60 sequences: refused by size, never allocated
        raw[head : head + 8] = struct.pack("<Q", 1 << 60)
    elif damage == "truncated":
        raw = raw[:-4]
    elif damage == "pointer":
        raw[head + 16 + 8 + 8 : head + 16 + 8 + 16] = struct.pack("<q", 2)  # sequence 1 overlaps 0
    elif damage == "bounds":
        raw[-8:] = struct.pack("<q", 1)  # the last boundary is not the sequence count
    elif damage == "negative":
        raw[head + 16 : head + 20] = struct.pack("<i", -3)
    elif damage == "short bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    idx_path.write_bytes(bytes(raw))
    return idx_path


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        ("magic", CorruptSourceError, "not a Megatron index"),
        ("version", UnsupportedDataError, "index version 2"),
        ("code", CorruptSourceError, "unknown Megatron dtype code 42"),
        ("huge count", CorruptSourceError, "counts 1152921504606846976 sequences"),
        ("truncated", CorruptSourceError, "truncated or corrupt"),
        ("pointer", CorruptSourceError, "sequence 1 starts at byte 2, not 6"),
        ("bounds", CorruptSourceError, "document boundaries must rise from 0"),
        ("negative", CorruptSourceError, "negative sequence length"),
        ("short bin", CorruptSourceError, "counts 5 uint16 tokens"),
    ],
)
def test_hostile_megatron_indexes_are_refused(
    store: Store, tmp_path: Path, damage: str, error: type[Exception], message: str
) -> None:
    idx_path = _hostile_index(tmp_path, damage)
    with pytest.raises(error, match=message):
        store.put_file("h", idx_path)
    with pytest.raises(error, match=message):
        store.plan_file("h", idx_path)
    assert not store.exists("h")


def test_an_idx_without_its_bin_is_refused(store: Store, tmp_path: Path) -> None:
    bin_path, idx_path = write_megatron(tmp_path / "lonely", [[[1]]])
    bin_path.unlink()
    with pytest.raises(FileNotFoundError):
        store.put_file("l", idx_path)
    assert not store.exists("l")


# ---------------------------------------------------------------- through the daemon


def test_dtype_through_the_daemon(daemon: Daemon, data_dir: Path) -> None:
    pytest.importorskip("fastapi")
    key = unique("tokens")
    path = data_dir / f"{key}.bin"
    np.arange(300, dtype=np.uint16).tofile(path)
    with Client(daemon.root) as client:
        assert client.load(key, path, dtype="uint16", wait=True).keys == (key,)
        assert client.info(key).dtype == "uint16"
        np.testing.assert_array_equal(
            shmcache.open_array(key, root=daemon.root), np.arange(300, dtype=np.uint16)
        )
        (data_dir / f"{key}-odd.bin").write_bytes(bytes(6))
        with pytest.raises(CorruptSourceError, match="not a whole number of uint32"):  # refused at once
            client.load(f"{key}-odd", data_dir / f"{key}-odd.bin", dtype="uint32")
        write_megatron(data_dir / f"{key}-m", [[[1, 2]], [[3]]])
        code, out, err = cli("put", str(data_dir / f"{key}-m"), "-k", f"{key}-p", "--root", str(daemon.root))
        assert code == 0 and out.split() == [f"{key}-p"], err  # the prefix, resolved by the CLI
        assert client.put_file(f"{key}-m", data_dir / f"{key}-m.idx") == [f"{key}-m"]
        assert [r.tolist() for r in shmcache.open_ragged(f"{key}-m", root=daemon.root)] == [[1, 2], [3]]
        with pytest.raises(shmcache.InvalidRequestError):
            client.load(f"{key}-bad", path, dtype="(2,)i4")  # the schema's pattern
    code, out, err = cli("put", str(path), "-k", f"{key}-c", "--dtype", "uint16", "--root", str(daemon.root))
    assert "loading in this process" not in err  # through the daemon
    assert code == 0 and out.split() == [f"{key}-c"], err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6))
def test_any_damaged_index_is_refused_with_a_typed_error_or_loads_whole(
    store: Store, tmp_path: Path, flips: list[tuple[int, int]]
) -> None:
    """Bytes of a valid index overwritten at random: a typed error, or an entry whose
    documents are exactly the ``.bin``'s tokens (never a crash, never a partial entry)."""
    bin_path, idx_path = write_megatron(tmp_path / "fuzz", [[[1, 2, 3]], [[4], [5, 6]], [[7]]])
    raw = bytearray(idx_path.read_bytes())
    for at, value in flips:
        raw[at % len(raw)] = value
    idx_path.write_bytes(bytes(raw))
    try:
        store.put_file("fuzz", idx_path, overwrite=True)
    except (InvalidSourceError, UnsupportedDataError):
        return
    ragged = store.open_ragged("fuzz")
    assert np.concatenate(list(ragged)).tolist() == np.fromfile(bin_path, "<u2").tolist()
