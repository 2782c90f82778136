"""Hugging Face ``datasets``: ``save_to_disk`` folders put as tables (a ``DatasetDict`` as
``key/<split>``), ``put_table(datasets.Dataset)`` with selections, and bad folders refused
with nothing published. Datasets are made in the test (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import CorruptSourceError, InvalidSourceError, Store, UnsupportedDataError
from tests.cli_helpers import cli
from tests.source_times import age

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")


def _dataset(n: int = 50) -> object:
    return datasets.Dataset.from_dict(
        {
            "label": list(range(n)),
            "text": [f"caption {i} é" for i in range(n)],
            "emb": [[float(i), -float(i)] for i in range(n)],
        }
    )


def _assert_table_equals(store: Store, key: str, ds: object) -> None:
    table = shmcache.open_table(key, root=store.root)
    expected = ds.with_format("numpy")  # type: ignore[attr-defined]
    assert len(table) == len(ds)  # type: ignore[arg-type]
    np.testing.assert_array_equal(table.column("label"), expected["label"])
    assert list(table.column("text")) == list(ds["text"])  # type: ignore[index]
    last = len(table) - 1
    assert table[last] == ds[last]  # type: ignore[index]


def test_a_saved_dataset_folder_becomes_one_table_not_blobs(store: Store, tmp_path: Path) -> None:
    ds = _dataset()
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)  # type: ignore[attr-defined]
    assert len(list((tmp_path / "ds").glob("data-*.arrow"))) == 3
    assert store.put_file("hf", tmp_path / "ds") == ["hf"]
    info = store.info("hf")
    assert info.kind == "table" and info.shape == (50,)
    assert info.source == str(tmp_path / "ds") and info.source_fingerprint["files"] == 3  # type: ignore[index]
    _assert_table_equals(store, "hf", ds)


def test_a_dataset_dict_folder_becomes_a_table_per_split(store: Store, tmp_path: Path) -> None:
    ds = _dataset()
    splits = datasets.DatasetDict({"train": ds, "test": ds.select(range(40, 50))})  # type: ignore[attr-defined]
    splits.save_to_disk(str(tmp_path / "dd"))
    (planned_train, planned_test) = store.plan_file("dd", tmp_path / "dd")
    assert (planned_train.key, planned_test.key) == ("dd/train", "dd/test") and not store.exists("dd/train")
    assert store.put_file("dd", tmp_path / "dd") == ["dd/train", "dd/test"]
    _assert_table_equals(store, "dd/train", splits["train"])
    _assert_table_equals(store, "dd/test", splits["test"])
    assert sorted(shmcache.open_group("dd", root=store.root)) == ["test", "train"]


def test_put_table_of_a_dataset_honours_select_and_shuffle(store: Store) -> None:
    ds = _dataset()
    chosen = ds.shuffle(seed=3).select([4, 0, 9])  # type: ignore[attr-defined]
    store.put_table("sel", chosen)
    _assert_table_equals(store, "sel", chosen)
    assert list(shmcache.open_table("sel").column("label")) == chosen["label"]
    store.put_table("whole", ds)
    _assert_table_equals(store, "whole", ds)


def test_dataset_dicts_and_unsupported_columns_are_refused_naming_them(store: Store, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedDataError, match="put each split"):
        store.put_table("k", datasets.DatasetDict({"train": _dataset(3)}))
    nested = datasets.Dataset.from_dict({"ok": [1, 2], "meta": [{"a": 1}, {"a": 2}]})
    with pytest.raises(UnsupportedDataError, match="meta"):
        store.put_table("k", nested)
    nested.save_to_disk(str(tmp_path / "nested"))
    with pytest.raises(UnsupportedDataError, match="meta"):
        store.put_file("k", tmp_path / "nested")
    assert store.list() == []


def _saved(tmp_path: Path) -> Path:
    _dataset(10).save_to_disk(str(tmp_path / "ds"))  # type: ignore[attr-defined]
    return tmp_path / "ds"


def _edit_state(folder: Path, filename: str) -> None:
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": filename}]
    (folder / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "error", "words"),
    [
        (lambda f: _edit_state(f, "../../etc/passwd"), InvalidSourceError, "not a file in its folder"),
        (lambda f: (f / "state.json").write_text("{not json"), CorruptSourceError, "not valid JSON"),
        (lambda f: _edit_state(f, "missing.arrow"), InvalidSourceError, "does not exist"),
        (
            lambda f: next(f.glob("data-*.arrow")).write_bytes(b"\xff" * 100),
            CorruptSourceError,
            "not a readable Arrow stream",
        ),
        (
            lambda f: (lambda p: p.write_bytes(p.read_bytes()[:-200]))(next(f.glob("data-*.arrow"))),
            CorruptSourceError,
            "Arrow stream",
        ),
    ],
    ids=["traversal", "bad json", "missing file", "garbage", "truncated"],
)
def test_damaged_folders_are_refused_and_nothing_is_published(
    store: Store, tmp_path: Path, damage: object, error: type[Exception], words: str
) -> None:
    folder = _saved(tmp_path)
    damage(folder)  # type: ignore[operator]
    with pytest.raises(error, match=words):
        store.put_file("k", folder)
    assert store.list() == []


def test_a_split_named_outside_its_folder_is_refused(store: Store, tmp_path: Path) -> None:
    datasets.DatasetDict({"train": _dataset(3)}).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../.."]}))
    with pytest.raises(InvalidSourceError, match="not a folder name"):
        store.put_file("k", tmp_path / "dd")
    assert store.list() == []


def test_cli_puts_a_saved_folder_and_a_preload_sees_it_current(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from shmcache.service.sources import is_up_to_date

    folder = _saved(tmp_path)
    age(folder)  # else racily clean (source_files.RACY_NS): never current
    code, out, err = cli("put", str(folder), "--key", "hfds", "--local")
    assert code == 0, err
    assert out.split() == ["hfds"]
    store = Store(root)
    assert store.info("hfds").kind == "table" and is_up_to_date(store, "hfds", folder)
    _dataset(12).save_to_disk(str(folder))  # type: ignore[attr-defined]
    assert not is_up_to_date(store, "hfds", folder)


def test_a_member_puts_a_folder_and_a_dataset_through_the_daemons_write_channel(tmp_path: Path) -> None:
    from shmcache._store.member_writes import MemberWriter
    from tests.service_helpers import running_daemon, temporary_root

    ds = _dataset(20)
    datasets.DatasetDict({"train": ds, "val": ds.select([1, 2])}).save_to_disk(str(tmp_path / "dd"))
    with temporary_root() as root, running_daemon(root):
        writer = MemberWriter(root)
        assert writer.put_file("dd", tmp_path / "dd") == ["dd/train", "dd/val"]
        writer.put_table("picked", ds.select([5, 1]))
        store = Store(root)
        _assert_table_equals(store, "dd/val", ds.select([1, 2]))
        assert list(shmcache.open_table("picked", root=root).column("label")) == [5, 1]



@pytest.mark.parametrize("confined", [True, False])
def test_a_confined_load_never_maps_its_sources(store: Store, tmp_path: Path, confined: bool) -> None:
    """A daemon's loads from its allowed directories are confined (``allowed_dirs``) and
    read the Arrow streams into memory: a client truncating a file that the daemon maps
    would kill it with SIGBUS. An unconfined put (in-process: the user's own files and
    process) maps them: no copy."""
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"label": list(range(200_000))}).save_to_disk(str(folder), num_shards=2)  # type: ignore[attr-defined]
    mapped_while_writing: list[bool] = []

    def look(done: int, total: int) -> None:  # the last call comes after the entry's bytes are written
        with open("/proc/self/maps") as maps:
            mapped_while_writing.append(str(folder) in maps.read())

    store.put_file("ds", folder, progress=look, allowed_dirs=[tmp_path] if confined else ())
    assert mapped_while_writing[-1] is not confined
    labels = shmcache.open_table("ds", root=store.root).column("label")
    np.testing.assert_array_equal(labels, np.arange(200_000))
