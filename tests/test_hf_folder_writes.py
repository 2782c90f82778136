"""A ``save_to_disk`` folder's columns written from the record batches' own buffers (views
of the mapped stream files, ``ArrayParts``): what is stored is what
``datasets.load_from_disk`` reads (numbers, strings, lists, missing values, a
``DatasetDict``); a data file changed while its columns are written fails the put with
nothing published; and the CRC recorded is that of the stored bytes (``verify`` passes, a
flipped byte is caught). Datasets are made in the test (no network)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import CorruptEntryError, CorruptSourceError, Store
from shmcache._disk.array_parts import ArrayParts
from shmcache._disk.checksum import parse_checksums
from shmcache._disk.meta import read_meta
from shmcache._disk.writer import VersionWriter
from shmcache._sources.hf_datasets import open_hf_split, plan_hf_folder

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

ROWS = 5_300  # datasets writes 1,000-row record batches: several chunks a shard


def _dataset(rows: int = ROWS, start: int = 0) -> object:
    index = np.arange(start, start + rows)
    return datasets.Dataset.from_dict(
        {
            "label": index,
            "score": (index * 0.25).astype(np.float32),
            "text": [f"caption {i} é" * (i % 3) for i in index],
            "emb": [[float(i)] * (i % 4) for i in index],
            "maybe": [None if i % 7 == 0 else int(i) for i in index],
            "flag": index % 2 == 0,
        }
    )


def _save(ds: object, folder: Path) -> Path:
    ds.save_to_disk(str(folder), num_shards=2)  # type: ignore[attr-defined]
    return folder


def _assert_stored_as_loaded(store: Store, key: str, folder: Path) -> None:
    loaded = datasets.load_from_disk(str(folder))
    table = shmcache.open_table(key, root=store.root)
    assert len(table) == len(loaded)
    numbers = loaded.with_format("numpy")
    for name in ("label", "score", "flag"):
        np.testing.assert_array_equal(table.column(name), numbers[name])
    assert list(table.column("text")) == list(loaded["text"])
    rows = sorted({0, 1, 6, 7, 999, 1000, 1001, len(loaded) // 2, len(loaded) - 1})
    for row in rows:  # lists and missing values, row by row as Python objects
        assert table[row] == loaded[row]


def _version_dir(store: Store, key: str) -> Path:
    return store.layout.version_dir(os.readlink(store.layout.entry_link(key)).rpartition("/")[2])


def test_the_chunked_path_is_taken(tmp_path: Path) -> None:
    """The columns below are written from the batches' buffers, not combined first (else
    the other tests here would not test that path)."""
    folder = _save(_dataset(), tmp_path / "ds")
    (split,) = plan_hf_folder("k", folder)
    with open_hf_split(split) as (files, _):
        chunked = {name for name, array in files.items() if isinstance(array, ArrayParts)}
    # label, score, text's bytes, emb's values; maybe (nulls) and flag (bools) are combined
    assert chunked == {"c0.values", "c1.values", "c2.bytes", "c3.values"}


def test_stored_columns_are_what_load_from_disk_reads(store: Store, tmp_path: Path) -> None:
    folder = _save(_dataset(), tmp_path / "ds")
    assert store.put_file("hf", folder) == ["hf"]
    _assert_stored_as_loaded(store, "hf", folder)


def test_a_dataset_dicts_splits_are_what_load_from_disk_reads(store: Store, tmp_path: Path) -> None:
    dd = datasets.DatasetDict({"train": _dataset(), "test": _dataset(2_100, start=40)})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": 2, "test": 3})
    assert store.put_file("dd", tmp_path / "dd") == ["dd/train", "dd/test"]
    _assert_stored_as_loaded(store, "dd/train", tmp_path / "dd" / "train")
    _assert_stored_as_loaded(store, "dd/test", tmp_path / "dd" / "test")


def test_a_data_file_changed_while_written_fails_and_nothing_is_published(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The columns are read from the mapped files until they are written: a file changed
    meanwhile (here: appended to while the first split's first column is written) fails the
    whole put, the other split included."""
    dd = datasets.DatasetDict({"train": _dataset(), "test": _dataset(1_200)})
    dd.save_to_disk(str(tmp_path / "dd"))
    victim = next((tmp_path / "dd" / "train").glob("data-*.arrow"))
    write_array = VersionWriter.write_array

    def write_then_change(self: VersionWriter, version: str, filename: str, array: object) -> object:
        with open(victim, "ab") as fp:  # a real change, mid-put
            fp.write(b"more")
        return write_array(self, version, filename, array)  # type: ignore[arg-type]

    monkeypatch.setattr(VersionWriter, "write_array", write_then_change)
    with pytest.raises(CorruptSourceError, match="changed while loading"):
        store.put_file("dd", tmp_path / "dd")
    assert store.list() == []
    assert not store.exists("dd/train") and not store.exists("dd/test")


def test_the_recorded_crcs_are_of_the_stored_bytes_and_a_flipped_byte_is_caught(
    store: Store, tmp_path: Path
) -> None:
    big = datasets.Dataset.from_dict(  # 8 MiB of embeddings: the CRC runs on a helper thread
        {
            "emb": np.random.default_rng(0).standard_normal((32_768, 64), dtype=np.float32),
            "label": np.arange(32_768),
        }
    )
    folder = _save(big, tmp_path / "big")
    store.put_file("hf", folder)
    assert store.verify("hf") is True
    meta = read_meta(store.layout, store.info("hf").version)
    assert meta is not None and meta.checksum is not None
    recorded = parse_checksums(meta.checksum)
    directory = _version_dir(store, "hf")
    assert sorted(recorded) == sorted(p.stem for p in directory.glob("*.npy"))
    for name, value in recorded.items():
        assert value == zlib.crc32((directory / f"{name}.npy").read_bytes()), name
    values = directory / "c0.values.npy"
    values.chmod(0o600)
    with open(values, "r+b") as fp:
        fp.seek(values.stat().st_size // 2)
        byte = fp.read(1)
        fp.seek(-1, os.SEEK_CUR)
        fp.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptEntryError, match=r"c0\.values\.npy has checksum"):
        store.verify("hf")
