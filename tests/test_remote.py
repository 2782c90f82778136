"""Remote sources (issue 13, items 1-2) against a real S3-compatible server on loopback: moto's
server mode in a subprocess, s3fs as the client. Each test gets its own bucket; the tests that
kill a server or check credentials get a server of their own."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import traceback
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from cli_helpers import cli
from s3_helpers import (
    KEY,
    Cancelled,
    MotoServer,
    cancel_once_started,
    moto_server,
    npy_bytes,
    put_object,
    unique_bucket,
)
from service_helpers import clean_env, load, scratch_dir, unique, wait_job

import shmcache
from shmcache._disk.layout import Layout
from shmcache._sources.urls import redact_url, url_allowed
from shmcache.errors import (
    CorruptSourceError,
    InvalidSourceError,
    SourceNotFoundError,
    UnsupportedDataError,
)


def _everything_under(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _staging(root: Path) -> list[Path]:
    return [p for p in Layout(root).tmp.iterdir() if p.is_dir()] if Layout(root).tmp.is_dir() else []


# ---------------------------------------------------------------------- loads


def test_a_prefix_of_npy_objects_round_trips(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    arrays = {
        "a": np.arange(1000, dtype=np.float32).reshape(100, 10),
        "sub/b": np.array([b"x", b"yz"], dtype="S2"),
        "sub/c": np.zeros((0, 3), dtype=np.int64),
        "f": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    }
    for name, array in arrays.items():
        put_object(s3, bucket, f"data/{name}.npy", npy_bytes(array))
    put_object(s3, bucket, "data/README.txt", b"not an array: skipped")
    secret = f"secret-{uuid.uuid4().hex}"
    options = s3.options(secret=secret)  # moto accepts any secret; it must never be recorded

    keys = store.put_file("ds", f"s3://{bucket}/data/", storage_options=options)

    assert sorted(keys) == sorted(f"ds/{name}" for name in arrays)
    for name, array in arrays.items():
        got = store.open_array(f"ds/{name}")
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
        assert store.verify(f"ds/{name}")  # the CRC recorded is that of the bytes published
    info = store.info("ds/a")
    assert info.source == f"s3://{bucket}/data/a.npy"
    assert info.source_fingerprint == {"size": len(npy_bytes(arrays["a"]))}
    assert secret.encode() not in _everything_under(root)
    assert dict(shmcache.open_group("ds", root=root)).keys() == set(arrays)


def test_one_object_becomes_one_entry_and_plan_file_reads_headers_only(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    array = np.arange(5000, dtype=np.uint16)
    put_object(s3, bucket, "one.npy", npy_bytes(array))
    url = f"s3://{bucket}/one.npy"

    planned = store.plan_file("one", url, storage_options=s3.options())
    assert [(p.key, p.source, p.size) for p in planned] == [("one", url, len(npy_bytes(array)))]
    assert not store.exists("one")
    assert store.put_file("one", url, storage_options=s3.options()) == ["one"]
    np.testing.assert_array_equal(store.open_array("one"), array)


def test_a_big_object_is_read_in_parallel_ranged_parts(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    array = np.random.default_rng(0).integers(0, 255, size=1 << 20, dtype=np.uint8)
    put_object(s3, bucket, "big.npy", npy_bytes(array))
    part = 64 << 10
    seen: list[tuple[int, int]] = []

    store.put_file(
        "big",
        f"s3://{bucket}/big.npy",
        storage_options=s3.options(),
        part_size=part,
        progress=lambda done, total: seen.append((done, total)),
    )

    np.testing.assert_array_equal(store.open_array("big"), array)
    size = len(npy_bytes(array))
    parts = -(-size // part)
    # One ranged GET per part (the header is validated from the first one before it is written).
    assert len(s3.requests("GET", f"/{bucket}/big.npy")) == parts
    assert seen[0] == (0, size) and seen[-1] == (size, size) and len(seen) == parts + 1
    assert store.verify("big")


def test_a_header_longer_than_a_part_is_read_whole_before_anything_is_written(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    dtype = np.dtype([(f"field_{i}", "<f4") for i in range(40)])  # a header of ~1.2 KiB
    array = np.zeros(10, dtype=dtype)
    array["field_3"] = np.arange(10)
    body = npy_bytes(array)
    put_object(s3, bucket, "wide.npy", body)
    store.put_file("wide", f"s3://{bucket}/wide.npy", storage_options=s3.options(), part_size=256)
    got = store.open_array("wide")
    assert got.dtype == dtype and np.array_equal(got["field_3"], np.arange(10))
    assert store.verify("wide")


def test_a_missing_object_is_source_not_found(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    with pytest.raises(SourceNotFoundError, match=f"s3://{bucket}/nope.npy does not exist"):
        store.put_file("k", f"s3://{bucket}/nope.npy", storage_options=s3.options())
    with pytest.raises(SourceNotFoundError):
        store.put_file("k", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x/", storage_options=s3.options())
    assert not store.exists("k") and not _staging(root)


def test_a_truncated_object_is_corrupt_and_nothing_is_published(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    good = npy_bytes(np.arange(100, dtype=np.int64))
    put_object(s3, bucket, "d/good.npy", good)
    put_object(s3, bucket, "d/short.npy", good[:-8])
    with pytest.raises(CorruptSourceError, match=rf"s3://{bucket}/d/short.npy: truncated \.npy file"):
        store.put_file("d", f"s3://{bucket}/d/", storage_options=s3.options())
    assert store.list() == [] and not _staging(root)


def test_object_dtypes_and_empty_npz_are_refused_before_anything_is_written(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    header = npy_bytes(np.zeros(3, dtype=np.float64)).replace(b"'<f8'", b"'|O' ")
    put_object(s3, bucket, "obj.npy", header)
    with pytest.raises(UnsupportedDataError, match="holds Python objects"):
        store.put_file("o", f"s3://{bucket}/obj.npy", storage_options=s3.options())
    put_object(s3, bucket, "z/a.npz", b"PK\x05\x06" + bytes(18))  # (.npz: test_remote_formats.py)
    with pytest.raises(InvalidSourceError, match=r"a\.npz: the \.npz archive holds no \.npy arrays"):
        store.put_file("z", f"s3://{bucket}/z/", storage_options=s3.options())
    assert store.list() == []


def test_an_object_changed_during_the_load_publishes_nothing(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    array = np.arange(1 << 16, dtype=np.uint32)
    put_object(s3, bucket, "x.npy", npy_bytes(array))
    rewritten: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not rewritten:  # same size, other bytes: only the ETag/MD5 can tell
            put_object(s3, bucket, "x.npy", npy_bytes(array[::-1].copy()))
            rewritten.append(True)

    with pytest.raises(CorruptSourceError, match="changed while loading"):
        store.put_file(
            "x",
            f"s3://{bucket}/x.npy",
            storage_options=s3.options(),
            part_size=16 << 10,
            progress=rewrite_once,
        )
    assert rewritten and not store.exists("x") and not _staging(root)


def test_a_ranged_read_that_comes_back_short_is_named(s3: MotoServer, bucket: str) -> None:
    """Every ranged read of a load (``remote_parts.read_range``) checks the bytes that came
    back: an object shorter than when it was listed is named with the bytes asked and got."""
    import fsspec

    from shmcache._sources.remote_parts import read_range
    from shmcache._sources.remote_plan import RemoteItem

    put_object(s3, bucket, "shrunk.bin", bytes(range(100)))
    fs = fsspec.filesystem("s3", **s3.options())
    url = f"s3://{bucket}/shrunk.bin"
    listed = RemoteItem("k", f"{bucket}/shrunk.bin", url, 200, "etag", None)  # 200 bytes when listed
    assert read_range(fs, listed, 10, 60, []) == bytes(range(10, 60))
    assert read_range(fs, listed, 60, 60, []) == b""
    short = r"bytes 50-150 came back as 50 \(it was truncated or changed while loading\); nothing was"
    with pytest.raises(CorruptSourceError, match=rf"^{re.escape(url)}: {short}"):
        read_range(fs, listed, 50, 150, [])
    with pytest.raises(CorruptSourceError, match=rf"^{re.escape(url)}#t: {short}"):
        read_range(fs, listed, 50, 150, [], where=f"{url}#t")
    gone = RemoteItem("k", f"{bucket}/gone.bin", f"s3://{bucket}/gone.bin", 200, "etag", None)
    with pytest.raises(SourceNotFoundError, match=rf"^s3://{bucket}/gone\.bin does not exist"):
        read_range(fs, gone, 0, 10, [])


def test_a_reput_over_a_link_to_another_entry_leaves_that_entry(
    store: shmcache.Store, s3: MotoServer, bucket: str
) -> None:
    """A remote directory re-put (one version per object, published together) over a link
    damaged to point at another key's version removes only what records its own keys."""
    for i in range(2):
        put_object(s3, bucket, f"d/f{i}.npy", npy_bytes(np.full(4, i)))
    assert store.put_file("d", f"s3://{bucket}/d/", storage_options=s3.options()) == ["d/f0", "d/f1"]
    store.put_array("b", np.arange(5))
    link, version = store.layout.entry_link("d/f0"), store.layout.entry_version("b")
    assert version is not None
    os.unlink(link)
    os.symlink(store.layout.link_target(version, "d/f0"), link)
    store.put_file("d", f"s3://{bucket}/d/", storage_options=s3.options(), overwrite=True)
    store.cleanup()
    assert [e.key for e in store.list()] == ["b", "d/f0", "d/f1"]
    assert all(store.verify(key) for key in ("b", "d/f0", "d/f1"))
    assert shmcache.Store(store.root).open_array("b").tolist() == list(range(5))
    assert store.open_array("d/f0").tolist() == [0] * 4


def test_a_load_cancelled_by_its_progress_callback_stops_and_publishes_nothing(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """What the daemon's cancel does: the callback raises in a fetching thread; the parts
    still queued are dropped, those running return, the error comes out of ``put_file``."""
    for i in range(24):
        put_object(s3, bucket, f"many/{i:02d}.npy", npy_bytes(np.full(4096, i, dtype=np.int64)))

    with pytest.raises(Cancelled):
        store.put_file("many", f"s3://{bucket}/many/", storage_options=s3.options(), part_size=8 << 10,
                       progress=cancel_once_started)  # fmt: skip
    assert store.list() == [] and not _staging(root)


def test_a_multipart_object_changed_during_the_load_is_caught_by_its_etag(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """A multipart upload's ETag is no MD5 of the content: the object is looked up again
    after the load, and a different ETag fails it."""
    body = npy_bytes(np.arange((5 << 20) // 8 + 1024, dtype=np.int64))  # just over S3's 5 MiB part minimum
    client = s3.boto()
    upload = client.create_multipart_upload(Bucket=bucket, Key="mp.npy")["UploadId"]
    parts = []
    for number, piece in enumerate((body[: 5 << 20], body[5 << 20 :]), start=1):
        etag = client.upload_part(Bucket=bucket, Key="mp.npy", UploadId=upload, PartNumber=number, Body=piece)
        parts.append({"ETag": etag["ETag"], "PartNumber": number})
    client.complete_multipart_upload(
        Bucket=bucket, Key="mp.npy", UploadId=upload, MultipartUpload={"Parts": parts}
    )
    assert "-" in client.head_object(Bucket=bucket, Key="mp.npy")["ETag"]
    rewritten: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not rewritten:
            put_object(s3, bucket, "mp.npy", body)  # the same bytes, uploaded again: a new ETag
            rewritten.append(True)

    with pytest.raises(CorruptSourceError, match="its size or ETag is not what it was"):
        store.put_file("mp", f"s3://{bucket}/mp.npy", storage_options=s3.options(), progress=rewrite_once)
    assert rewritten and not store.exists("mp") and not _staging(root)
    store.put_file("mp", f"s3://{bucket}/mp.npy", storage_options=s3.options())  # unchanged now: loads
    np.testing.assert_array_equal(store.open_array("mp"), np.load(io.BytesIO(body)))


def test_wrong_credentials_are_a_typed_error_that_never_shows_the_secret(store: shmcache.Store) -> None:
    secret = f"wrong-secret-{uuid.uuid4().hex}"
    checks_credentials = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}  # moto then refuses unknown keys
    with (
        scratch_dir("moto") as logs,
        moto_server(logs, checks_credentials) as checking,
        pytest.raises(InvalidSourceError, match="access denied") as caught,
    ):
        store.put_file("k", "s3://bucket/x.npy", storage_options=checking.options(secret=secret))
    text = "".join(traceback.format_exception(caught.value))
    assert "s3://bucket/x.npy" in text and secret not in text
    assert not store.exists("k")


def test_a_server_killed_mid_load_fails_typed_and_publishes_nothing(
    store: shmcache.Store, root: Path
) -> None:
    with scratch_dir("moto") as logs, moto_server(logs) as dying:
        bucket = unique_bucket(dying)
        array = np.arange(1 << 17, dtype=np.uint64)  # 1 MiB: 64 parts of 16 KiB
        dying.boto().put_object(Bucket=bucket, Key="x.npy", Body=npy_bytes(array))

        def kill_server(done: int, _total: int) -> None:
            if done:
                dying.kill()

        with pytest.raises(InvalidSourceError, match=f"s3://{bucket}/x.npy") as caught:
            store.put_file(
                "x",
                f"s3://{bucket}/x.npy",
                storage_options=dying.options(config_kwargs={"retries": {"max_attempts": 1}}),
                part_size=16 << 10,
                progress=kill_server,
            )
    assert dying.process.returncode == -signal.SIGKILL
    assert not isinstance(caught.value, CorruptSourceError)  # a connection failure, not bad data
    assert not store.exists("x") and not _staging(root)
    assert store.cleanup() == 0  # the failed load removed its own staging files


def test_cleanup_reclaims_what_a_killed_remote_load_left(root: Path, s3: MotoServer, bucket: str) -> None:
    array = np.arange(1 << 17, dtype=np.uint64)
    put_object(s3, bucket, "x.npy", npy_bytes(array))
    script = textwrap.dedent(
        f"""
        import os, signal, shmcache
        def die(done, total):
            if done:
                os.kill(os.getpid(), signal.SIGKILL)
        shmcache.Store({str(root)!r}).put_file(
            "x", "s3://{bucket}/x.npy", storage_options={s3.options()!r}, part_size=1 << 16, progress=die
        )
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _staging(root), "the killed load left no staging files to reclaim"
    store = shmcache.Store(root)
    assert store.cleanup() >= array.nbytes  # the whole object was preallocated
    assert not _staging(root) and not store.exists("x")


def test_a_missing_backend_names_its_extra(store: shmcache.Store) -> None:
    with pytest.raises(InvalidSourceError, match=r"fsspec knows no nosuch:// filesystem"):
        store.put_file("k", "nosuch://bucket/x.npy")
    if not _installed("gcsfs"):
        with pytest.raises(InvalidSourceError, match=r"pip install 'shmcache\[gcs\]'"):
            store.put_file("k", "gs://bucket/x.npy")
    if not _installed("adlfs"):
        with pytest.raises(InvalidSourceError, match=r"pip install 'shmcache\[azure\]'"):
            store.put_file("k", "az://container/x.npy")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_file_urls_are_local_paths(store: shmcache.Store, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(4))
    assert store.put_file("f", (tmp_path / "a.npy").as_uri()) == ["f"]
    np.testing.assert_array_equal(store.open_array("f"), np.arange(4))


def test_urls_are_redacted_and_prefixes_match_whole_segments() -> None:
    assert (
        redact_url("https://user:pw@host:8443/a/b.npy?X-Amz-Signature=abc#f") == "https://host:8443/a/b.npy"
    )
    assert redact_url("s3://bucket/a.npy") == "s3://bucket/a.npy"
    assert url_allowed("s3://b/data/x.npy", ["s3://b/data"])
    assert url_allowed("s3://b/data/x.npy", ["s3://b/data/"])
    assert not url_allowed("s3://b/data-private/x.npy", ["s3://b/data"])
    assert not url_allowed("s3://b/data/../secret/x.npy", ["s3://b/data"])
    assert not url_allowed("gs://b/data/x.npy", ["s3://b/data"])


def test_settings_take_url_prefixes_and_url_datasets(tmp_path: Path) -> None:
    from shmcache.service.settings import SettingsError, load_settings

    data = tmp_path / "data"
    data.mkdir()
    config = tmp_path / "preload.toml"
    config.write_text(
        'allow_source = ["data", "s3://bucket/datasets/"]\n\n'
        '[[datasets]]\nkey = "remote"\nsource = "s3://bucket/datasets/scannet/"\n\n'
        '[[datasets]]\nkey = "local"\nsource = "data"\n'
    )
    settings = load_settings({"root": tmp_path / "root"}, env={}, config_file=config)
    assert settings.allow_dirs == (data.resolve(),) and settings.allow_urls == ("s3://bucket/datasets",)
    assert [spec.source for spec in settings.datasets] == ["s3://bucket/datasets/scannet/", data.resolve()]
    flags = load_settings({"root": tmp_path / "root", "allow_source": [f"file://{data}", "gs://b/x"]}, env={})
    assert flags.allow_source == (data.resolve(), "gs://b/x")
    with pytest.raises(SettingsError, match="must not carry user information or a query"):
        load_settings({"root": tmp_path / "root", "allow_source": ["https://user:pw@host/data"]}, env={})


# ---------------------------------------------------------------------- CLI


def test_cli_put_takes_a_url_and_storage_options(root: Path, s3: MotoServer, bucket: str) -> None:
    put_object(s3, bucket, "p/a.npy", npy_bytes(np.arange(3)))
    secret = f"cli-secret-{uuid.uuid4().hex}"
    code, out, err = cli(
        "put", f"s3://{bucket}/p/", "--key", "c", "--local",
        "--storage-option", f"key={KEY}",
        "--storage-option", f"secret={secret}",
        "--storage-option", f"client_kwargs.endpoint_url={s3.endpoint}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
        "--storage-option", "skip_instance_cache=true",
    )  # fmt: skip
    assert code == 0, err
    assert out.split() == ["c/a"] and secret not in out + err
    code, out, err = cli("put", f"s3://{bucket}/p/nope.npy", "--key", "d", "--local",
                         "--storage-option", f"key={KEY}", "--storage-option", f"secret={secret}",
                         "--storage-option", f"client_kwargs.endpoint_url={s3.endpoint}")  # fmt: skip
    assert code == 1 and "does not exist" in err and secret not in out + err
    assert secret.encode() not in _everything_under(root)


# ---------------------------------------------------------------------- per-node cache


def test_cache_remote_loads_once_then_opens(root: Path, s3: MotoServer, bucket: str) -> None:
    put_object(s3, bucket, "c/a.npy", npy_bytes(np.arange(10)))
    put_object(s3, bucket, "one.npy", npy_bytes(np.ones(4)))
    url = f"s3://{bucket}/c/"
    group = shmcache.cache_remote("grp", url, storage_options=s3.options())
    np.testing.assert_array_equal(group["a"], np.arange(10))
    again = shmcache.cache_remote("grp", url, storage_options=s3.options())
    assert list(again) == ["a"]
    assert len(s3.requests("GET", f"/{bucket}/c/a.npy")) == 1  # one download, in one part
    array = shmcache.cache_remote("one", f"s3://{bucket}/one.npy", storage_options=s3.options())
    np.testing.assert_array_equal(array, np.ones(4))
    with pytest.raises(SourceNotFoundError):
        shmcache.cache_remote("gone", f"s3://{bucket}/gone.npy", storage_options=s3.options())


# ---------------------------------------------------------------------- daemon

DAEMON_SECRET = f"daemon-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def daemon_bucket(s3: MotoServer) -> str:
    name = unique_bucket(s3)
    client = s3.boto()
    client.put_object(Bucket=name, Key="allowed/feats/a.npy", Body=npy_bytes(np.arange(6.0)))
    client.put_object(Bucket=name, Key="allowed/pre/p.npy", Body=npy_bytes(np.arange(3)))
    client.put_object(Bucket=name, Key="other/x.npy", Body=npy_bytes(np.arange(2)))
    return name


@pytest.fixture(scope="module")
def daemon_args(data_dir: Path, daemon_bucket: str) -> tuple[str, ...]:
    config = data_dir / "preload.toml"
    config.write_text(f'[[datasets]]\nkey = "pre"\nsource = "s3://{daemon_bucket}/allowed/pre/"\n')
    return ("--allow-source", str(data_dir), "--allow-source", f"s3://{daemon_bucket}/allowed",
            "--config", str(config), "--log-level", "debug")  # fmt: skip


def daemon_env_of(s3: MotoServer, secret: str) -> dict[str, str]:
    """Credentials and endpoint as botocore reads them from the environment."""
    return {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@pytest.fixture(scope="module")
def daemon_env(s3: MotoServer) -> dict[str, str]:
    """The daemon's own credentials and endpoint, from its environment."""
    return daemon_env_of(s3, DAEMON_SECRET)


def test_the_daemon_loads_urls_under_its_allowed_prefixes(daemon, daemon_bucket: str) -> None:  # type: ignore[no-untyped-def]
    key = unique("remote")
    with daemon.client() as http:
        job = load(http, key, f"s3://{daemon_bucket}/allowed/feats/")
        assert job["state"] == "done", job
        assert job["keys"] == [f"{key}/a"] and job["source"] == f"s3://{daemon_bucket}/allowed/feats/"
        entry = http.get(f"/v1/entries/{key}/a").raise_for_status().json()
        assert entry["source"] == f"s3://{daemon_bucket}/allowed/feats/a.npy"

        refused = http.put(f"/v1/entries/{unique('x')}", json={"source": f"s3://{daemon_bucket}/other/x.npy"})
        assert refused.status_code == 400 and refused.json()["error"] == "SourceNotAllowedError"
        climbing = http.put(
            f"/v1/entries/{unique('x')}", json={"source": f"s3://{daemon_bucket}/allowed/../other/"}
        )
        assert climbing.json()["error"] == "SourceNotAllowedError"
        with_secret = http.put(
            f"/v1/entries/{unique('x')}",
            json={"source": f"s3://{daemon_bucket}/allowed/feats/a.npy?X-Amz-Signature={DAEMON_SECRET}"},
        )
        assert with_secret.status_code == 400 and DAEMON_SECRET not in with_secret.text
        missing = http.put(
            f"/v1/entries/{unique('x')}", json={"source": f"s3://{daemon_bucket}/allowed/none.npy"}
        )
        assert missing.status_code == 400 and missing.json()["error"] == "SourceNotFoundError"

        # shmcache put of a URL goes through the daemon (its credentials), without storage options.
        code, out, err = cli("put", f"s3://{daemon_bucket}/allowed/feats/a.npy", "--key", f"{key}-cli",
                             "--root", str(daemon.root))  # fmt: skip
        assert code == 0 and out.split() == [f"{key}-cli"], err
        code, _, err = cli("put", f"s3://{daemon_bucket}/allowed/feats/a.npy", "--key", f"{key}-opt",
                           "--root", str(daemon.root), "--storage-option", "anon=true")  # fmt: skip
        assert code == 1 and "--storage-option applies to loads in this process" in err

        # The [[datasets]] preload of a URL ran at start-up.
        wait_job(http, _job_of(http, "pre"))
        pre = http.get("/v1/entries/pre/p").raise_for_status().json()
        assert pre["source"] == f"s3://{daemon_bucket}/allowed/pre/p.npy"
        jobs = http.get("/v1/jobs").text
    np.testing.assert_array_equal(shmcache.Store(daemon.root).open_array(f"{key}/a"), np.arange(6.0))
    assert DAEMON_SECRET not in daemon.log + jobs
    assert DAEMON_SECRET.encode() not in _everything_under(daemon.root)


def test_a_url_preload_is_up_to_date_until_an_object_changes(
    store: shmcache.Store, s3: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What lets a restarted daemon skip a [[datasets]] URL: the same objects, sizes and ETags."""
    from shmcache.service.sources import is_up_to_date

    for name, value in daemon_env_of(s3, "testing").items():  # the daemon's way: its environment
        monkeypatch.setenv(name, value)
    put_object(s3, bucket, "pre/a.npy", npy_bytes(np.arange(3)))
    put_object(s3, bucket, "pre/b.npy", npy_bytes(np.arange(4)))
    url = f"s3://{bucket}/pre/"
    store.put_file("pre", url, storage_options=s3.options())
    assert is_up_to_date(store, "pre", url)
    put_object(s3, bucket, "pre/b.npy", npy_bytes(np.arange(4) + 1))  # same size, other bytes
    assert not is_up_to_date(store, "pre", url)
    store.put_file("pre", url, storage_options=s3.options(), overwrite=True)
    assert is_up_to_date(store, "pre", url)
    put_object(s3, bucket, "pre/c.npy", npy_bytes(np.arange(1)))  # one more object
    assert not is_up_to_date(store, "pre", url)


def _job_of(http, key: str) -> str:  # type: ignore[no-untyped-def]
    jobs = http.get("/v1/jobs").raise_for_status().json()
    return next(job["id"] for job in jobs if job["key"] == key)


def test_meta_json_of_a_remote_entry_names_the_redacted_url(store: shmcache.Store, root: Path, s3: MotoServer,
                                                             bucket: str) -> None:  # fmt: skip
    put_object(s3, bucket, "m.npy", npy_bytes(np.arange(2)))
    store.put_file("m", f"s3://{bucket}/m.npy", storage_options=s3.options())
    meta = json.loads((Layout(root).objects / store.info("m").version / "meta.json").read_text())
    assert meta["source"] == f"s3://{bucket}/m.npy" and meta["source_identity"].startswith("ETag=")
    assert os.stat(Layout(root).objects / store.info("m").version / "data.npy").st_size == meta["size"]


# ---------------------------------------------------------------------- torchrun: two simulated nodes

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_torchrun_on_two_simulated_nodes_downloads_once_per_node(s3: MotoServer, bucket: str) -> None:
    """``--nnodes 2 --nproc-per-node 2`` as two torchrun launches on this machine, each "node"
    with its own cache root: the server sees one download per node, every rank reads the
    same bytes, and DDP steps run over them."""
    pytest.importorskip("torch")
    import zlib

    array = np.random.default_rng(1).standard_normal((256, 9)).astype(np.float32)
    put_object(s3, bucket, "train/feats.npy", npy_bytes(array))
    port = _free_port()
    with scratch_dir("node0") as root0, scratch_dir("node1") as root1:
        launches = []
        for rank, root in enumerate((root0, root1)):
            env = {
                "SHMCACHE_ROOT": str(root / "cache"),
                "SHMCACHE_KEY": "train/feats",
                "SHMCACHE_URL": f"s3://{bucket}/train/feats.npy",
                "AWS_ENDPOINT_URL": s3.endpoint,
                "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": KEY,
                "AWS_DEFAULT_REGION": "us-east-1",
                "OMP_NUM_THREADS": "1",
            }
            command = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", bucket,
                "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}",
                str(REPO / "deploy" / "example_train.py"),
            ]  # fmt: skip
            launches.append(
                subprocess.Popen(
                    command, env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        outputs = [launch.communicate(timeout=540)[0] for launch in launches]
        assert [launch.returncode for launch in launches] == [0, 0], "\n".join(outputs)
        for root in (root0, root1):  # each node holds its own copy
            np.testing.assert_array_equal(shmcache.Store(root / "cache").open_array("train/feats"), array)
    lines = re.findall(
        r"rank (\d)/4 on \S+: train/feats \(256, 9\) crc32 ([0-9a-f]{8}), loss", "".join(outputs)
    )
    assert sorted(rank for rank, _ in lines) == ["0", "1", "2", "3"], outputs
    assert {crc for _, crc in lines} == {f"{zlib.crc32(array.data):08x}"}
    # One download per node (one GET each: the object fits in one part), and nothing else.
    assert len(s3.requests("GET", f"/{bucket}/train/feats.npy")) == 2


# ---------------------------------------------------------------------- http(s): a presigned-style URL


class _RangeServer:
    """A loopback HTTP server of a few objects with Range and ETag support that, like a
    presigned URL, wants ``?token=<token>`` (else 403)."""

    def __init__(self, objects: dict[str, bytes], token: str) -> None:
        import hashlib
        import http.server
        import threading
        from urllib.parse import parse_qs, urlsplit

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                parts = urlsplit(self.path)
                data = objects.get(parts.path)
                if parse_qs(parts.query).get("token") != [token]:
                    self.send_error(403, "bad token")
                    return
                if data is None:
                    self.send_error(404)
                    return
                start, end, status = 0, len(data), 200
                wanted = self.headers.get("Range")
                if wanted:
                    first, _, last = wanted.removeprefix("bytes=").partition("-")
                    start, end, status = int(first), min(int(last) + 1, len(data)), 206
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

            def do_GET(self) -> None:
                self._answer(True)

            def do_HEAD(self) -> None:
                self._answer(False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_http_url_with_a_token_loads_and_the_token_is_never_recorded(
    store: shmcache.Store, root: Path
) -> None:
    pytest.importorskip("aiohttp")
    token = f"tok{uuid.uuid4().hex}"
    array = np.arange(50_000, dtype=np.int32)
    server = _RangeServer({"/data/x.npy": npy_bytes(array)}, token)
    try:
        keys = store.put_file("h", f"{server.url}/data/x.npy?token={token}", part_size=64 << 10)
        assert keys == ["h"]
        np.testing.assert_array_equal(store.open_array("h"), array)
        assert store.info("h").source == f"{server.url}/data/x.npy"
        assert token.encode() not in _everything_under(root)

        wrong = f"tok{uuid.uuid4().hex}"
        with pytest.raises(InvalidSourceError) as caught:
            store.put_file("w", f"{server.url}/data/x.npy?token={wrong}")
        text = "".join(traceback.format_exception(caught.value))
        assert f"{server.url}/data/x.npy" in text and wrong not in text
        with pytest.raises(SourceNotFoundError):
            store.put_file("w", f"{server.url}/data/none.npy?token={token}")
    finally:
        server.close()
    assert not store.exists("w")
