"""Entries other than arrays and tables from URLs (issue 21 items 5 and 6), against a real
S3-compatible server on loopback (moto's server mode; s3fs as the client): Megatron
``.bin``/``.idx`` pairs, prefixes of other files as blobs and WebDataset ``.tar`` shards.
Each entry is compared file for file, byte for byte, with a local put of the same files;
damaged input gives the local path's typed error and publishes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3_helpers import MotoServer, moto_server, unique_bucket
from service_helpers import scratch_dir
from test_token_files import _hostile_index
from token_datasets import write_megatron

import shmcache
from shmcache._disk.layout import Layout
from shmcache.errors import CorruptSourceError, SourceNotFoundError, UnsupportedDataError

_DOCUMENTS = [[[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9, 10], [11]]]


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with scratch_dir("moto") as logs, moto_server(logs) as server:
        yield server


@pytest.fixture
def bucket(s3: MotoServer) -> str:
    return unique_bucket(s3)


def _upload(s3: MotoServer, bucket: str, prefix: str, files: list[Path]) -> None:
    for path in files:
        s3.boto().put_object(Bucket=bucket, Key=f"{prefix}{path.name}", Body=path.read_bytes())


def _staging(root: Path) -> list[Path]:
    tmp = Layout(root).tmp
    return [p for p in tmp.iterdir() if p.is_dir()] if tmp.is_dir() else []


def _entry_files(store: shmcache.Store, root: Path, key: str) -> tuple[dict[str, bytes], dict]:  # type: ignore[type-arg]
    """The entry's ``.npy`` files and its ``meta.json`` less what differs between two puts."""
    version = Layout(root).objects / store.info(key).version
    files = {p.name: p.read_bytes() for p in sorted(version.iterdir()) if p.name != "meta.json"}
    meta = json.loads((version / "meta.json").read_text())
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
