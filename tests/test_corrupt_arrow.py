"""Arrow data that pyarrow's readers let through but that does not hold together: string
or list offsets past their data or going back, a dictionary index out of range. An IPC
file's buffers are not checked by ``pyarrow.ipc`` (nor by the cheap ``validate()``): such
offsets, published, made readers of the column read past the end of its file (SIGBUS) or
the wrong strings. Each is a CorruptSourceError naming the file (or the key) and the
column, through a local put (streamed), ``put_table`` of the table in memory, and the
whole decode; nothing is published, nothing is left in ``tmp/``. Real files, real roots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

import shmcache  # noqa: E402
from shmcache._disk.layout import Layout  # noqa: E402
from shmcache._sources import tables  # noqa: E402
from shmcache.errors import CorruptSourceError  # noqa: E402


def _strings_going_far_back() -> Any:
    """The probe's: an offset 512 MiB past the data, the last one back within it."""
    offsets = np.array([0, 1, 2, 1 << 29, 4], np.int32)
    return pa.Array.from_buffers(pa.string(), 4, [None, pa.py_buffer(offsets), pa.py_buffer(b"abcd")])


def _strings_going_back() -> Any:
    offsets = np.array([0, 3, 1, 4], np.int32)
    return pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets), pa.py_buffer(b"abcd")])


def _list_going_back() -> Any:
    offsets = np.array([0, 3, 1, 4], np.int32)
    child = pa.array([1, 2, 3, 4], pa.int64())
    return pa.Array.from_buffers(pa.list_(pa.int64()), 3, [None, pa.py_buffer(offsets)], children=[child])


def _dictionary_index_out_of_range() -> Any:
    return pa.DictionaryArray.from_arrays(pa.array([0, 1, 7], pa.int32()), pa.array(["a", "b"]), safe=False)


BAD_COLUMNS: dict[str, Callable[[], Any]] = {
    "strings going far back": _strings_going_far_back,
    "strings going back": _strings_going_back,
    "a list going back": _list_going_back,
    "a dictionary index out of range": _dictionary_index_out_of_range,
}


def _tmp_items(root: Path) -> list[Path]:
    return list(Layout(root).tmp.iterdir()) if Layout(root).tmp.is_dir() else []


def _ipc_file(path: Path, column: Any, batches: int = 1) -> None:
    """An Arrow IPC file whose last batch holds ``column`` (good batches before it)."""
    good = pa.array(["x", "yz", "w"]) if column.type in (pa.string(),) else None
    with pa.ipc.new_file(path, pa.schema([("c", column.type), ("n", pa.int64())])) as writer:
        for _ in range(batches - 1):
            ok = good if good is not None else column.slice(0, 0)
            writer.write_batch(pa.record_batch([ok, pa.array(np.arange(len(ok)))], names=["c", "n"]))
        writer.write_batch(pa.record_batch([column, pa.array(np.arange(len(column)))], names=["c", "n"]))


@pytest.mark.parametrize("case", sorted(BAD_COLUMNS))
def test_a_corrupt_column_in_an_arrow_file_is_refused_and_nothing_is_published(
    root: Path, tmp_path: Path, case: str
) -> None:
    path = tmp_path / "bad.arrow"
    _ipc_file(path, BAD_COLUMNS[case](), batches=3)
    store = shmcache.Store(root)
    store.put_array("other", np.arange(3))
    with pytest.raises(CorruptSourceError, match=r"bad\.arrow: column 'c'"):
        store.put_file("k", path)
    assert not store.exists("k") and store.exists("other") and not _tmp_items(root)


@pytest.mark.parametrize("case", sorted(BAD_COLUMNS))
def test_a_corrupt_column_of_a_table_in_memory_is_refused(root: Path, case: str) -> None:
    store = shmcache.Store(root)
    table = pa.table({"c": BAD_COLUMNS[case](), "n": pa.array(np.arange(len(BAD_COLUMNS[case]())))})
    with pytest.raises(CorruptSourceError, match=r"key 'k'.*column 'c'"):
        store.put_table("k", table)
    assert not store.exists("k") and not _tmp_items(root)


def test_offsets_past_the_data_of_a_written_file_are_refused(root: Path, tmp_path: Path) -> None:
    """A file whose last string offset was changed on disk to point 512 MiB past its data
    (pyarrow builds no such array itself; a damaged file holds one): refused, streamed and
    decoded whole alike (``has_pyarrow`` made False takes the whole read, as a Feather V1
    file does)."""
    path = tmp_path / "bad.arrow"
    table = pa.table({"c": pa.array(["ab", "cd", "ef"]), "n": pa.array([7, 8, 9])})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    good = np.array([0, 2, 4, 6], np.int32).tobytes()
    data = path.read_bytes()
    assert data.count(good) == 1
    path.write_bytes(data.replace(good, np.array([0, 2, 4, 1 << 29], np.int32).tobytes()))
    store = shmcache.Store(root)
    with pytest.raises(CorruptSourceError, match=r"bad\.arrow: column 'c'"):
        store.put_file("k", path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tables, "has_pyarrow", lambda: False)
        with pytest.raises(CorruptSourceError, match=r"bad\.arrow"):
            store.put_file("k", path)
    assert not store.exists("k") and not _tmp_items(root)


def test_good_offsets_from_sliced_and_chunked_arrays_still_load(root: Path) -> None:
    """Offsets that start past 0 (a slice) and chunks of one column: not refused, stored
    as they read."""
    strings = pa.array([f"s{i}" * (i % 4) for i in range(100)])
    lists = pa.array([list(range(i % 5)) for i in range(100)], pa.list_(pa.int64()))
    table = pa.Table.from_batches(
        [pa.record_batch([strings.slice(a, 25), lists.slice(a, 25)], names=["s", "l"]) for a in (10, 40, 70)]
    )
    store = shmcache.Store(root)
    store.put_table("k", table)
    stored = store.open_table("k").to_arrow()
    assert stored.column("s").to_pylist() == table.column("s").to_pylist()
    assert stored.column("l").to_pylist() == table.column("l").to_pylist()


@pytest.mark.parametrize(
    "offsets",
    [[0, 20, 4, 24], [1 << 20, (1 << 20) + 8, (1 << 20) + 16, (1 << 20) + 24], [0, 8, 16, 1 << 20]],
    ids=["going back", "all past the data", "last past the data"],
)
def test_a_damaged_dictionary_is_refused_before_it_is_decoded(
    root: Path, tmp_path: Path, offsets: list[int]
) -> None:
    """A dictionary column whose dictionary's string offsets were damaged on disk: the
    decode (or a join of batches) read them blindly: a segfault of the putting process, or
    bytes from outside the file published. Refused whole, streamed and from memory, by the
    one check (``table_arrow.check_dictionaries``), naming the column (streamed, the
    message named the file only)."""
    path = tmp_path / "d.arrow"
    words = pa.array(["abcdefgh", "ijklmnop", "qrstuvwx"]).dictionary_encode()
    table = pa.table({"c": words, "n": [1, 2, 3]})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    good = np.array([0, 8, 16, 24], np.int32).tobytes()
    data = path.read_bytes()
    assert data.count(good) == 1
    path.write_bytes(data.replace(good, np.array(offsets, np.int32).tobytes()))
    store = shmcache.Store(root)
    with pytest.raises(CorruptSourceError, match=r"d\.arrow: column 'c'.*offset"):
        store.put_file("k", path)
    with pytest.raises(CorruptSourceError, match=r"key 'k'.*column 'c'"):
        store.put_table("k", pa.ipc.open_file(path).read_all())
    assert not store.exists("k") and not _tmp_items(root)


def _not_utf8(kind: Any = None, nulls: bool = False) -> Any:
    """Three strings, the second two bytes that are not UTF-8 (``kind``: string or
    large_string; ``nulls``: the third one null)."""
    kind = kind or pa.string()
    width = np.int64 if kind == pa.large_string() else np.int32
    valid = pa.py_buffer(np.packbits([1, 1, 0], bitorder="little")) if nulls else None
    offsets = pa.py_buffer(np.array([0, 2, 4, 4], width))
    return pa.Array.from_buffers(kind, 3, [valid, offsets, pa.py_buffer(b"ok\xff\xfe")])


NOT_UTF8: dict[str, Callable[[], Any]] = {
    "string": _not_utf8,
    "large_string": lambda: _not_utf8(pa.large_string()),
    "with nulls": lambda: _not_utf8(nulls=True),
    "a character split by an offset": lambda: pa.Array.from_buffers(
        pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 2], np.int32)), pa.py_buffer("é".encode())]
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_UTF8))
def test_strings_that_are_not_utf8_are_refused_at_put(root: Path, tmp_path: Path, case: str) -> None:
    """pyarrow's IPC and Parquet readers pass a string column's bytes unchecked: published,
    every read of the row raised UnicodeDecodeError. Refused at put, naming the file (or
    key) and the column: streamed, decoded whole, from memory in one chunk or several."""
    column = NOT_UTF8[case]()
    good = pa.array(["a", "b", "c"], column.type)
    table = pa.Table.from_batches(
        [pa.record_batch([c, pa.array(np.arange(len(c)))], names=["c", "n"]) for c in (good, column)]
    )
    arrow, parquet = tmp_path / "bad.arrow", tmp_path / "bad.parquet"
    with pa.ipc.new_file(arrow, table.schema) as writer:
        writer.write_table(table)
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(table, parquet)
    store = shmcache.Store(root)
    store.put_array("other", np.arange(3))
    for path in (arrow, parquet):
        with pytest.raises(CorruptSourceError, match=rf"{path.name}: column 'c'.*not UTF-8"):
            store.put_file("k", path)
        with pytest.MonkeyPatch.context() as patch:  # the whole decode
            patch.setattr(tables, "has_pyarrow", lambda: False)
            with pytest.raises(CorruptSourceError, match=rf"{path.name}: column 'c'.*not UTF-8"):
                store.put_file("k", path)
    for data in (table, table.combine_chunks(), pa.table({"c": column})):
        with pytest.raises(CorruptSourceError, match=r"key 'k'.*column 'c'.*not UTF-8"):
            store.put_table("k", data)
    assert not store.exists("k") and store.exists("other") and not _tmp_items(root)


def test_binary_columns_are_not_checked_as_text(root: Path) -> None:
    """Bytes that are not UTF-8 in a binary column are not corrupt: the column is refused
    as a type a table cannot hold (UnsupportedDataError), not as a damaged source; valid
    multi-byte strings still load."""
    store = shmcache.Store(root)
    for kind in (pa.binary(), pa.large_binary()):
        with pytest.raises(shmcache.UnsupportedDataError, match="binary"):
            store.put_table("k", pa.table({"b": pa.array([b"\xff", b"x"], kind)}))
    words = pa.array(["é", "日本", None, "ok"])
    store.put_table("k", pa.table({"s": words}))
    assert [row["s"] for row in store.open_table("k")] == ["é", "日本", None, "ok"]
