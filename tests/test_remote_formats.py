"""Every format a local path takes, from URLs (issue 21 item 5), against a real S3-compatible
server on loopback (moto's server mode; s3fs as the client): tables, safetensors, torch
checkpoints, ``.npz``, raw token files and a prefix mixing them, each checked as it is locally
(index first), streamed by ranged reads, and rechecked (size, ETag) before anything is published.
``hf://``, ``gs://``, ``az://`` and ``http(s)://`` go through the same fsspec code path."""

from __future__ import annotations

import io
import json
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pa = pytest.importorskip("pyarrow")

import pyarrow.feather as feather  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from s3_helpers import KEY, MotoServer, npy_bytes, put_object, unique_bucket  # noqa: E402
from service_helpers import load, unique  # noqa: E402

import shmcache  # noqa: E402
from shmcache._disk.layout import Layout  # noqa: E402
from shmcache.errors import CorruptSourceError, InvalidSourceError  # noqa: E402


def _staging(root: Path) -> list[Path]:
    return [p for p in Layout(root).tmp.iterdir() if p.is_dir()] if Layout(root).tmp.is_dir() else []


def _meta(store: shmcache.Store, root: Path, key: str) -> dict:  # type: ignore[type-arg]
    return json.loads((Layout(root).objects / store.info(key).version / "meta.json").read_text())  # type: ignore[no-any-return]


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return bytes(save(tensors))


def _table() -> object:
    return pa.table({"id": np.arange(50, dtype=np.int64), "text": [f"row {i}" for i in range(50)],
                     "score": np.linspace(0, 1, 50)})  # fmt: skip


def _check_table(store: shmcache.Store, key: str) -> None:
    table = store.open_table(key)
    np.testing.assert_array_equal(table.column("id"), np.arange(50))
    assert list(table.column("text")) == [f"row {i}" for i in range(50)]
    np.testing.assert_allclose(table.column("score"), np.linspace(0, 1, 50))


# ---------------------------------------------------------------------- one family each


def test_table_objects_load_as_tables(store: shmcache.Store, root: Path, s3: MotoServer, bucket: str) -> None:
    """Parquet, Feather, CSV and JSON lines objects, read by pyarrow from the remote file-like."""
    table = _table()
    parquet, arrow, csv = io.BytesIO(), io.BytesIO(), io.BytesIO()
    pq.write_table(table, parquet)
    feather.write_feather(table, arrow)
    import pyarrow.csv as pcsv

    pcsv.write_csv(table, csv)
    jsonl = "".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode()
    for name, body in {"t.parquet": parquet, "t.feather": arrow, "t.csv": csv}.items():
        put_object(s3, bucket, f"tables/{name}", body.getvalue())
    put_object(s3, bucket, "tables/t.jsonl", jsonl)
    for suffix in ("parquet", "feather", "csv", "jsonl"):
        url = f"s3://{bucket}/tables/t.{suffix}"
        [planned] = store.plan_file(suffix, url, storage_options=s3.options())
        assert planned.source == url and planned.size == s3.boto().head_object(
            Bucket=bucket, Key=f"tables/t.{suffix}")["ContentLength"]  # fmt: skip
        assert store.put_file(suffix, url, storage_options=s3.options()) == [suffix]
        _check_table(store, suffix)
        meta = _meta(store, root, suffix)
        assert meta["kind"] == "table" and meta["source"] == url
        assert meta["source_identity"].startswith("ETag=")


def test_a_table_object_is_fetched_in_one_get(store: shmcache.Store, s3: MotoServer, bucket: str) -> None:
    """A Parquet object over 8 MiB (of several row groups) is one GET, not a GET per part
    (moto copies the whole object for every ranged GET: the parts cost a copy each), unless
    ``part_size`` asks for parts; its rows come back whole."""
    rows = 400_000
    ids = np.arange(rows, dtype=np.int64)
    table = pa.table({"id": ids, "x": np.linspace(0, 1, rows), "y": np.sqrt(ids)})
    body = io.BytesIO()
    pq.write_table(table, body, compression="none", row_group_size=100_000)
    assert body.tell() > 9 << 20
    put_object(s3, bucket, "big/t.parquet", body.getvalue())
    store.put_file("big", f"s3://{bucket}/big/t.parquet", storage_options=s3.options())
    assert len(s3.requests("GET", f"/{bucket}/big/t.parquet")) == 1
    back = store.open_table("big")
    np.testing.assert_array_equal(back.column("id"), np.arange(rows))
    np.testing.assert_array_equal(back.column("x"), np.linspace(0, 1, rows))
    # part_size= asks for parallel ranged reads instead (a store that serves ranges cheaply)
    store.put_file("parts", f"s3://{bucket}/big/t.parquet", storage_options=s3.options(), part_size=4 << 20)
    assert len(s3.requests("GET", f"/{bucket}/big/t.parquet")) == 1 + -(-body.tell() // (4 << 20))
    assert store.open_table("parts").to_arrow().equals(back.to_arrow())


def test_a_prefix_of_parquet_shards_is_one_table(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """A Hub dataset's layout (``hf://datasets/ORG/NAME/data/train-0000N-of-0000M.parquet``, read
    through huggingface_hub's fsspec filesystem by this same code): the shards' rows in name order."""
    table = _table()
    for i, start in enumerate((0, 20, 35)):
        shard = io.BytesIO()
        pq.write_table(table.slice(start, {0: 20, 1: 15, 2: 15}[i]), shard)
        put_object(s3, bucket, f"ds/data/train-{i:05d}-of-00003.parquet", shard.getvalue())
    put_object(s3, bucket, "ds/README.md", b"a dataset card: skipped")
    url = f"s3://{bucket}/ds/data/"
    [planned] = store.plan_file("ds", url, storage_options=s3.options())
    assert planned.key == "ds" and planned.source == url
    assert store.put_file("ds", url, storage_options=s3.options()) == ["ds"]
    _check_table(store, "ds")
    assert _meta(store, root, "ds")["source"] == url
    other = io.BytesIO()
    pq.write_table(pa.table({"other": [1, 2]}), other)
    put_object(s3, bucket, "ds/data/train-00009-of-00003.parquet", other.getvalue())
    with pytest.raises(InvalidSourceError, match="do not share one schema"):
        store.put_file("ds2", url, storage_options=s3.options())
    put_object(s3, bucket, "mixed/a.parquet", other.getvalue())
    put_object(s3, bucket, "mixed/b.csv", b"other\n1\n")
    with pytest.raises(InvalidSourceError, match=r"several formats \(\.csv, \.parquet\)"):
        store.put_file("mixed", f"s3://{bucket}/mixed/", storage_options=s3.options())
    assert not store.exists("ds2") and not store.exists("mixed")


def test_safetensors_tensors_are_ranges_of_the_object(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    tensors = {
        "model.w": np.arange(40000, dtype=np.float32).reshape(200, 200),
        "model.b": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float16),
    }
    put_object(s3, bucket, "ckpt/model.safetensors", _safetensors(tensors))
    url = f"s3://{bucket}/ckpt/model.safetensors"
    planned = store.plan_file("m", url, storage_options=s3.options())
    assert sorted(p.key for p in planned) == ["m/empty", "m/model.b", "m/model.w"]
    keys = store.put_file("m", url, storage_options=s3.options(), part_size=16 << 10)  # many parts
    assert sorted(keys) == ["m/empty", "m/model.b", "m/model.w"]
    group = store.open_group("m")
    for name, array in tensors.items():
        np.testing.assert_array_equal(group[name], array)
        assert group[name].dtype == array.dtype
    assert _meta(store, root, "m/model.w")["source"] == f"{url}[model.w]"
    assert all(store.verify(key) for key in keys)  # the CRC-32 of the ranges written, recorded


def test_torch_checkpoints_load_their_contiguous_tensors(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    torch = pytest.importorskip("torch")
    state = {
        "w": torch.arange(600, dtype=torch.float32).reshape(20, 30),
        "b": torch.ones(5, dtype=torch.bfloat16),
    }
    body = io.BytesIO()
    torch.save(state, body)
    put_object(s3, bucket, "c.pt", body.getvalue())
    assert sorted(store.put_file("c", f"s3://{bucket}/c.pt", storage_options=s3.options())) == ["c/b", "c/w"]
    from shmcache.torch import as_tensor

    group = store.open_group("c")
    assert torch.equal(as_tensor(group["w"]), state["w"])
    assert torch.equal(as_tensor(group["b"]), state["b"]) and as_tensor(group["b"]).dtype == torch.bfloat16
    # strided views: tests/test_remote_entries.py::test_strided_torch_views_are_the_local_put_s_arrays


def test_npz_members_stored_are_ranges_and_compressed_ones_are_inflated_from_the_object(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    arrays = {"x": np.arange(300_000, dtype=np.int32), "y": np.eye(3)}
    plain, packed = io.BytesIO(), io.BytesIO()
    np.savez(plain, **arrays)  # type: ignore[arg-type]
    np.savez_compressed(packed, **arrays)  # type: ignore[arg-type]
    put_object(s3, bucket, "a.npz", plain.getvalue())
    put_object(s3, bucket, "z.npz", packed.getvalue())
    for name in ("a", "z"):
        keys = store.put_file(name, f"s3://{bucket}/{name}.npz", storage_options=s3.options())
        assert sorted(keys) == [f"{name}/x", f"{name}/y"]
        for member, array in arrays.items():
            np.testing.assert_array_equal(store.open_array(f"{name}/{member}"), array)
        assert all(store.verify(key) for key in keys)
    assert _meta(store, root, "z/x")["source"] == f"s3://{bucket}/z.npz[x.npy]"
    damaged = bytearray(packed.getvalue())
    damaged[len(damaged) // 3] ^= 0xFF  # inside x's deflate stream: a zlib error or a CRC mismatch
    put_object(s3, bucket, "bad.npz", bytes(damaged))
    with pytest.raises(CorruptSourceError, match=r"bad.npz\[x.npy\]"):
        store.put_file("bad", f"s3://{bucket}/bad.npz", storage_options=s3.options())
    assert not store.exists("bad/x") and not store.exists("bad/y") and not _staging(root)


def test_a_raw_token_file_loads_with_its_dtype(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, 100_001, dtype=np.uint16)
    put_object(s3, bucket, "tok/train.bin", tokens.tobytes())
    url = f"s3://{bucket}/tok/train.bin"
    [planned] = store.plan_file("t", url, storage_options=s3.options(), dtype="uint16")
    assert planned.size > tokens.nbytes
    assert store.put_file("t", url, storage_options=s3.options(), dtype="uint16", part_size=64 << 10) == ["t"]
    np.testing.assert_array_equal(store.open_array("t"), tokens)
    assert _meta(store, root, "t")["source"] == url
    with pytest.raises(CorruptSourceError, match="not a whole number of uint32 tokens"):
        store.put_file("t4", url, storage_options=s3.options(), dtype="uint32")
    with pytest.raises(InvalidSourceError, match="is a prefix"):
        store.put_file("tp", f"s3://{bucket}/tok/", storage_options=s3.options(), dtype="uint16")
    with pytest.raises(CorruptSourceError, match="a raw token file needs its dtype"):
        store.put_file("tn", url, storage_options=s3.options())
    assert not store.exists("t4") and not store.exists("tp") and not store.exists("tn")


def test_hdf5_datasets_are_decoded_from_the_remote_file(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, tmp_path: Path
) -> None:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "d.h5"
    rows = np.arange(200_000, dtype=np.float64).reshape(-1, 4)
    with h5py.File(path, "w") as h5:
        h5.create_dataset("grp/rows", data=rows, chunks=(1000, 4), compression="gzip")
        h5.create_dataset("scalar", data=np.int32(7))
    put_object(s3, bucket, "d.h5", path.read_bytes())
    keys = store.put_file("h", f"s3://{bucket}/d.h5", storage_options=s3.options())
    assert sorted(keys) == ["h/grp/rows", "h/scalar"]
    np.testing.assert_array_equal(store.open_array("h/grp/rows"), rows)
    assert store.open_array("h/scalar")[()] == 7 and all(store.verify(key) for key in keys)
    # string datasets: tests/test_remote_entries.py::test_hdf5_string_datasets_are_the_local_put_s_strings


# ---------------------------------------------------------------------- prefixes, changes, damage


def test_a_prefix_of_several_formats_loads_as_one_group(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    npz = io.BytesIO()
    np.savez(npz, m=np.arange(3))
    put_object(s3, bucket, "mix/a.npy", npy_bytes(np.arange(5)))
    put_object(s3, bucket, "mix/sub/w.safetensors", _safetensors({"k": np.ones(4, np.float32)}))
    put_object(s3, bucket, "mix/n.npz", npz.getvalue())
    put_object(s3, bucket, "mix/README.md", b"skipped")
    keys = store.put_file("mix", f"s3://{bucket}/mix/", storage_options=s3.options())
    assert sorted(keys) == ["mix/a", "mix/n/m", "mix/sub/w/k"]
    np.testing.assert_array_equal(store.open_array("mix/a"), np.arange(5))
    np.testing.assert_array_equal(store.open_array("mix/sub/w/k"), np.ones(4, np.float32))
    np.testing.assert_array_equal(store.open_array("mix/n/m"), np.arange(3))


def test_an_object_changed_during_the_load_publishes_nothing(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """Ranges of an object prove nothing by their MD5: its ETag is looked up again at the end."""
    before = {"w": np.arange(1 << 15, dtype=np.float32)}
    body = _safetensors(before)
    put_object(s3, bucket, "w.safetensors", body)
    rewritten: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not rewritten:  # the same size, other bytes: only the ETag can tell
            put_object(s3, bucket, "w.safetensors", _safetensors({"w": before["w"][::-1].copy()}))
            rewritten.append(True)

    with pytest.raises(CorruptSourceError, match="its size or ETag is not what it was"):
        store.put_file("w", f"s3://{bucket}/w.safetensors", storage_options=s3.options(), part_size=16 << 10,
                       progress=rewrite_once)  # fmt: skip
    assert rewritten and store.list() == [] and not _staging(root)
    store.put_file("w", f"s3://{bucket}/w.safetensors", storage_options=s3.options())  # unchanged now
    np.testing.assert_array_equal(store.open_array("w/w"), before["w"][::-1])


def test_truncated_objects_are_typed_errors_and_nothing_is_published(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    body = _safetensors({"a": np.arange(1000, dtype=np.int64)})
    put_object(s3, bucket, "short.safetensors", body[:-8])
    with pytest.raises(CorruptSourceError, match=r"short.safetensors"):
        store.put_file("s", f"s3://{bucket}/short.safetensors", storage_options=s3.options())
    parquet = io.BytesIO()
    pq.write_table(_table(), parquet)
    put_object(s3, bucket, "short.parquet", parquet.getvalue()[:-100])
    with pytest.raises(CorruptSourceError, match=r"short.parquet is not a readable parquet file"):
        store.put_file("p", f"s3://{bucket}/short.parquet", storage_options=s3.options())
    with pytest.raises(CorruptSourceError, match=r"short.parquet is not a readable parquet file"):
        store.plan_file("p", f"s3://{bucket}/short.parquet", storage_options=s3.options())
    assert store.list() == [] and not _staging(root)


def test_storage_option_secrets_never_reach_meta_errors_or_logs(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    options = s3.options(secret=secret)  # moto takes any secret; it must never be recorded
    parquet = io.BytesIO()
    pq.write_table(_table(), parquet)
    put_object(s3, bucket, "s/t.parquet", parquet.getvalue())
    put_object(s3, bucket, "s/m.safetensors", _safetensors({"a": np.arange(3)}))
    put_object(s3, bucket, "s/bad.safetensors", b"\xff" * 16)
    caplog.set_level(logging.DEBUG)
    store.put_file("t", f"s3://{bucket}/s/t.parquet", storage_options=options)
    store.put_file("m", f"s3://{bucket}/s/m.safetensors", storage_options=options)
    errors = []
    for url in (f"s3://{bucket}/s/bad.safetensors", f"s3://{bucket}/s/none.parquet"):
        with pytest.raises(shmcache.ShmCacheError) as raised:
            store.put_file("bad", url, storage_options=options)
        errors.append(str(raised.value))
    assert "not a .safetensors file" in errors[0] and "does not exist" in errors[1]
    recorded = b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    assert secret.encode() not in recorded
    assert secret not in "".join(errors) + caplog.text


def test_a_preload_of_tensors_is_up_to_date_until_its_object_changes(
    store: shmcache.Store, s3: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries of one object (``url[tensor]``) are current while the object's size and ETag are."""
    from shmcache.service.sources import is_up_to_date

    env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    for name, value in env.items():  # the daemon's way: its environment
        monkeypatch.setenv(name, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # one made from another module's server's environment
    put_object(s3, bucket, "pre/m.safetensors", _safetensors({"a": np.arange(3), "b": np.ones(2)}))
    url = f"s3://{bucket}/pre/m.safetensors"
    store.put_file("pre", url, storage_options=s3.options())
    assert is_up_to_date(store, "pre", url)
    put_object(s3, bucket, "pre/m.safetensors", _safetensors({"a": np.arange(3) + 1, "b": np.ones(2)}))
    assert not is_up_to_date(store, "pre", url)


def test_cache_remote_opens_what_each_format_became(root: Path, s3: MotoServer, bucket: str) -> None:
    parquet = io.BytesIO()
    pq.write_table(_table(), parquet)
    put_object(s3, bucket, "cr/t.parquet", parquet.getvalue())
    put_object(s3, bucket, "cr/m.safetensors", _safetensors({"a": np.arange(3)}))
    options = s3.options()
    url = f"s3://{bucket}/cr"
    for _ in range(2):  # loaded, then opened
        table = shmcache.cache_remote("cr-t", f"{url}/t.parquet", root=root, storage_options=options)
        group = shmcache.cache_remote("cr-m", f"{url}/m.safetensors", root=root, storage_options=options)
        assert isinstance(table, shmcache.SharedTable) and table.columns == ["id", "text", "score"]
        np.testing.assert_array_equal(group["a"], np.arange(3))  # type: ignore[index]
    assert len(s3.requests("GET", f"/{bucket}/cr/t.parquet")) == 1


# ---------------------------------------------------------------------- the daemon

DAEMON_SECRET = f"daemon-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def daemon_bucket(s3: MotoServer) -> str:
    name = unique_bucket(s3)
    parquet = io.BytesIO()
    pq.write_table(_table(), parquet)
    s3.boto().put_object(Bucket=name, Key="allowed/t.parquet", Body=parquet.getvalue())
    s3.boto().put_object(Bucket=name, Key="allowed/m.safetensors", Body=_safetensors({"a": np.arange(4)}))
    return name


@pytest.fixture(scope="module")
def daemon_args(data_dir: Path, daemon_bucket: str) -> tuple[str, ...]:
    return ("--allow-source", str(data_dir), "--allow-source", f"s3://{daemon_bucket}/allowed")


@pytest.fixture(scope="module")
def daemon_env(s3: MotoServer) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": DAEMON_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


def test_the_daemon_loads_a_parquet_and_a_safetensors_object(daemon, daemon_bucket: str) -> None:  # type: ignore[no-untyped-def]
    table_key, tensors_key = unique("table"), unique("tensors")
    with daemon.client() as http:
        job = load(http, table_key, f"s3://{daemon_bucket}/allowed/t.parquet")
        assert job["state"] == "done", job
        job = load(http, tensors_key, f"s3://{daemon_bucket}/allowed/m.safetensors")
        assert job["state"] == "done" and job["keys"] == [f"{tensors_key}/a"], job
        entry = http.get(f"/v1/entries/{tensors_key}/a").raise_for_status().json()
        assert entry["source"] == f"s3://{daemon_bucket}/allowed/m.safetensors[a]"
    store = shmcache.Store(daemon.root)
    _check_table(store, table_key)
    np.testing.assert_array_equal(store.open_array(f"{tensors_key}/a"), np.arange(4))
    assert DAEMON_SECRET not in daemon.log


# ---------------------------------------------------------------------- memory

_PEAK_SCRIPT = r"""
import json, resource, sys
import numpy as np
import shmcache
root, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
store = shmcache.Store(root)
store.put_file("warm", url, storage_options=options, part_size=1 << 20, dtype="uint8")  # imports, pools
store.evict("warm")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
store.put_file("big", url, storage_options=options, part_size=1 << 20, dtype="uint8")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": after - before, "size": int(store.open_array("big").size)}))
"""


def test_a_byte_range_load_holds_parts_not_the_object(root: Path, s3: MotoServer, bucket: str) -> None:
    """Memory stays flat: a 96 MiB token object is streamed in 1 MiB parts (16 in flight),
    so the loader's peak RSS grows by far less than the object (which lands in tmpfs)."""
    import subprocess
    import sys

    size = 96 << 20
    body = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    put_object(s3, bucket, "big.bin", body)
    del body
    options = s3.options()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(root), f"s3://{bucket}/big.bin", json.dumps(options)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["size"] == size
    assert measured["grew_kib"] * 1024 < size // 3, measured


def test_a_hub_file_is_known_by_its_blob_id() -> None:
    """What ``hf://`` (huggingface_hub's fsspec filesystem) lists for a file: no ETag, but the
    git blob hash, which changes with the content: what tells a changed object, and a preload
    still current. (The Hub is not reached in tests; the load path is the one s3 takes.)"""
    from shmcache._sources.remote import _identity

    listed = {"name": "datasets/org/name/data/train-00000-of-00001.parquet", "size": 10, "type": "file",
              "blob_id": "8f3c2a", "lfs": {"size": 10, "sha256": "ab" * 32}, "last_commit": None}  # fmt: skip
    assert _identity(listed) == "blob_id=8f3c2a"
