"""A ``save_to_disk`` folder's table written a group of record batches at a time, the copy
on a second thread (``table_write``, ``write_behind``): the stored files are byte for byte
those of the whole encode for every column type, in groups of one batch or of many; a
column's offsets that go back in a later group, or a batch that claims more rows than its
buffers hold, fail the put with the typed error; the writer thread running out of space
is CacheFullError; and in each failure nothing is published, nothing is left in ``tmp/``
and no thread is left writing. Folders are written here with pyarrow (Arrow IPC streams,
``state.json``), as ``datasets`` writes them; real roots, a real small tmpfs."""

from __future__ import annotations

import io
import json
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import mounted_tmpfs

from shmcache import CacheFullError, CorruptSourceError, Store
from shmcache._containers import table_write
from shmcache._containers.table_arrow import encode_arrow
from shmcache._disk.layout import Layout
from shmcache._disk.write_behind import WriteBehind
from shmcache._store.putting import Putting

pa = pytest.importorskip("pyarrow")


def _batch(start: int, rows: int) -> Any:
    index = np.arange(start, start + rows)
    return pa.record_batch(
        {
            "i64": pa.array(index, pa.int64()),
            "u8": pa.array(index % 251, pa.uint8()),
            "f16": pa.array((index / 7).astype(np.float16)),
            "f32": pa.array(index * 0.5, pa.float32()),
            "s": pa.array([f"row {i} é" * (i % 3) for i in index], pa.string()),
            "ls": pa.array([f"L{i}" for i in index], pa.large_string()),
            "lst": pa.array([[float(i)] * (i % 4) for i in index], pa.list_(pa.float32())),
            "llst": pa.array([list(range(i % 5)) for i in index], pa.large_list(pa.int16())),
            "fixed": pa.array([[i, -i, 2 * i] for i in index], pa.list_(pa.float64(), 3)),
            "flag": pa.array(index % 2 == 0),
            "when": pa.array(index.astype("datetime64[ms]")),
            "cat": pa.array([f"c{i % 3}" for i in index]).dictionary_encode(),
            "holes": pa.array([None if i % 7 == 0 else int(i) for i in index], pa.int32()),
        }
    )


def _folder(path: Path, shards: list[list[Any]]) -> Path:
    """A ``Dataset.save_to_disk`` folder of one Arrow stream per shard."""
    path.mkdir()
    names = []
    for i, batches in enumerate(shards):
        names.append(f"data-{i:05d}-of-{len(shards):05d}.arrow")
        with pa.ipc.new_stream(path / names[-1], batches[0].schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (path / "dataset_info.json").write_text("{}")
    return path


def _stored(store: Store, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The entry's files as arrays, and its meta."""
    layout = Layout(store.root)
    version = layout.version_dir(os.readlink(layout.entry_link(key)).rpartition("/")[2])
    files = {p.name.removesuffix(".npy"): np.load(p) for p in version.iterdir() if p.suffix == ".npy"}
    return files, json.loads((version / "meta.json").read_text())


def _nothing_left(store: Store) -> None:
    assert store.list() == []
    assert os.listdir(Layout(store.root).tmp) == []
    assert not [t for t in threading.enumerate() if t.name == "shmcache-write-behind"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    yield Store(tmp_path / "root")


@pytest.fixture(autouse=True)
def threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables here are small: copied on the thread all the same (unless a test says)."""
    monkeypatch.setattr(table_write, "THREAD_BYTES", 0)


def _one_batch_a_group(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Groups of one record batch each; returns the count of hand-overs to the thread."""
    for name in ("GROUP_BYTES", "FIRST_GROUP_BYTES", "FILE_BYTES"):
        monkeypatch.setattr(table_write, name, 1)
    handed = [0]
    append = WriteBehind.append

    def counted(self: WriteBehind, appends: Any) -> None:
        handed[0] += 1
        append(self, appends)

    monkeypatch.setattr(WriteBehind, "append", counted)
    return handed


@pytest.mark.parametrize(("small", "thread"), [(True, True), (False, True), (True, False)])
def test_the_stored_files_are_those_of_the_whole_encode(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: bool, thread: bool
) -> None:
    """Groups of one batch each (offsets rebased across groups) or all batches in one; on
    the writer thread, or (a small table) on the calling thread alone."""
    if not thread:
        monkeypatch.setattr(table_write, "THREAD_BYTES", 1 << 40)
    handed = _one_batch_a_group(monkeypatch) if small else None
    shards = [[_batch(0, 700), _batch(700, 1), _batch(701, 300)], [_batch(1001, 999), _batch(2000, 5)]]
    folder = _folder(tmp_path / "ds", shards)
    store.put_file("hf", folder)
    if handed is not None:
        assert handed == [5 + 1]  # a group a batch, then the offsets' ends
    table = pa.Table.from_batches([b for shard in shards for b in shard])
    files, meta = encode_arrow(table, "the table")
    stored, stored_meta = _stored(store, "hf")
    assert sorted(stored) == sorted(files)
    for name, array in files.items():
        assert stored[name].dtype == array.dtype, name
        np.testing.assert_array_equal(stored[name], array, err_msg=name)
    assert stored_meta["columns"] == meta["columns"]
    assert stored_meta["length"] == table.num_rows == 2005
    store.verify("hf")


def _strings_going_back() -> Any:
    offsets = np.array([0, 3, 1, 4], np.int32)
    strings = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets), pa.py_buffer(b"abcd")])
    return pa.record_batch({"n": pa.array([1, 2, 3]), "s": strings})


def _good(start: int) -> Any:
    return pa.record_batch({"n": pa.array([start, start + 1, start + 2]), "s": pa.array(["ab", "c", ""])})


def test_offsets_going_back_in_a_later_group_fail_the_put(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier groups are already written when the bad one is encoded: the put fails
    with the typed error naming the column, and none of it is published."""
    handed = _one_batch_a_group(monkeypatch)
    folder = _folder(tmp_path / "ds", [[_good(0), _good(3)], [_good(6), _strings_going_back(), _good(9)]])
    with pytest.raises(CorruptSourceError, match=r"ds: column 's'.*go back"):
        store.put_file("hf", folder)
    assert handed == [3]  # three groups were written before
    _nothing_left(store)


@pytest.mark.parametrize("rows", [0, 40])
def test_tables_with_no_column_streamed(store: Store, tmp_path: Path, rows: int) -> None:
    """Every column written whole (nulls), or no row at all: as the whole encode."""
    batch = pa.record_batch({"holes": pa.array([None if i % 3 else i for i in range(rows)], pa.int32())})
    folder = _folder(tmp_path / "ds", [[batch]])
    store.put_file("hf", folder)
    files, meta = encode_arrow(pa.Table.from_batches([batch]), "the table")
    stored, stored_meta = _stored(store, "hf")
    assert sorted(stored) == sorted(files)
    for name, array in files.items():
        np.testing.assert_array_equal(stored[name], array, err_msg=name)
    assert stored_meta["columns"] == meta["columns"] and stored_meta["length"] == rows
    store.verify("hf")


def test_a_batch_claiming_more_rows_than_its_buffers_hold_is_refused(store: Store, tmp_path: Path) -> None:
    """pyarrow's stream reader lets the batch through; its offsets buffer is too short
    (a ValueError from numpy before; pyarrow's own kernels segfault on it)."""
    rows = 12345
    sink = io.BytesIO()
    batch = pa.record_batch({"s": pa.array(["ab"] * rows), "n": pa.array(np.arange(rows))})
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    claimed = sink.getvalue().replace(struct.pack("<q", rows), struct.pack("<q", 10_000_000))
    folder = _folder(tmp_path / "ds", [[batch]])
    (folder / "data-00000-of-00001.arrow").write_bytes(claimed)
    with pytest.raises(CorruptSourceError, match=r"ds: column 's'.*claims"):
        store.put_file("hf", folder)
    _nothing_left(store)


def test_the_writer_thread_running_out_of_space_is_cache_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The space is reserved, then taken by someone else before the copy: the writer
    thread's ENOSPC is raised in the caller as CacheFullError; nothing published."""
    streamed = ["i64", "f32", "s", "lst", "fixed"]  # no column written whole, by this thread
    batches = [_batch(i * 2000, 2000).select(streamed) for i in range(4)]
    folder = _folder(tmp_path / "ds", [batches[:2], batches[2:]])
    with mounted_tmpfs(tmp_path / "small", "size=16m") as mountpoint:
        store = Store(mountpoint / "root")
        store.put_array("first", np.arange(3))
        reserve = Putting._reserve

        def reserve_then_fill(self: Putting, *args: Any, **kwargs: Any) -> None:
            reserve(self, *args, **kwargs)
            with open(mountpoint / "filler", "wb") as filler:  # what another program writes
                try:
                    while True:
                        filler.write(bytes(1 << 20))
                        filler.flush()
                except OSError:
                    pass

        monkeypatch.setattr(Putting, "_reserve", reserve_then_fill)
        with pytest.raises(CacheFullError) as info:
            store.put_file("hf", folder)
        assert any(frame.name == "_run" for frame in info.traceback)  # raised on the thread
        assert [e.key for e in store.list()] == ["first"]
        assert os.listdir(Layout(store.root).tmp) == []
        assert not [t for t in threading.enumerate() if t.name == "shmcache-write-behind"]
        os.unlink(mountpoint / "filler")


def test_a_cancel_after_the_writes_publishes_nothing(store: Store, tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ds", [[_batch(0, 1000), _batch(1000, 1000)]])

    def progress(done: int, total: int) -> None:
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.put_file("hf", folder, progress=progress)
    _nothing_left(store)


# ---------------------------------------------------------------------- the thread alone


def test_a_write_error_is_raised_unchanged_by_the_next_call(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"")
    with WriteBehind() as behind:
        behind.append([(str(tmp_path / "a"), [b"xy", np.arange(3, dtype=np.uint8)])])
        behind.append([(str(tmp_path / "missing"), [b"z"])])
        with pytest.raises(FileNotFoundError):
            behind.finish()
        with pytest.raises(FileNotFoundError):
            behind.append([(str(tmp_path / "a"), [b"never"])])
    assert (tmp_path / "a").read_bytes() == b"xy\x00\x01\x02"
    assert not [t for t in threading.enumerate() if t.name == "shmcache-write-behind"]


def test_appends_are_written_in_order_across_many_buffers(tmp_path: Path) -> None:
    """More buffers than one ``writev`` takes (IOV_MAX), appended in order."""
    (tmp_path / "a").write_bytes(b"")
    pieces = [bytes([i % 256]) * (i % 7 + 1) for i in range(3000)]
    with WriteBehind() as behind:
        behind.append([(str(tmp_path / "a"), pieces[:2500])])
        behind.append([(str(tmp_path / "a"), pieces[2500:])])
        behind.finish()
    assert (tmp_path / "a").read_bytes() == b"".join(pieces)


def test_without_a_thread_the_caller_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    (tmp_path / "a").write_bytes(b"")
    with WriteBehind() as behind:
        behind.append([(str(tmp_path / "a"), [b"abc"])])
        behind.finish()
    assert (tmp_path / "a").read_bytes() == b"abc"


def test_after_its_first_error_the_thread_writes_nothing_more(tmp_path: Path) -> None:
    """A group handed over while the thread was failing the one before is not written, and
    the first error is the one raised (the thread stopped at it)."""
    big, later = tmp_path / "big", tmp_path / "later"
    big.write_bytes(b"")
    later.write_bytes(b"")
    writer = WriteBehind()
    try:
        writer.append([(str(big), [np.zeros(64 << 20, dtype=np.uint8)]), (str(tmp_path / "missing"), [b"x"])])
        writer.append([(str(later), [b"handed over before the thread failed"])])  # while it copies 64 MiB
        with pytest.raises(FileNotFoundError):
            writer.finish()
    finally:
        writer.close()
    assert later.read_bytes() == b""


def test_an_interrupt_while_the_thread_starts_leaves_no_thread(tmp_path: Path) -> None:
    """Ctrl+C can land in ``Thread.start()`` (it waits for the thread): the ``with`` never
    runs, so the constructor itself must stop the thread it started."""
    import _thread
    import random

    def alive() -> int:
        return sum(t.name == "shmcache-write-behind" for t in threading.enumerate())

    before = alive()
    interrupted = 0
    for _ in range(300):
        timer = threading.Timer(random.uniform(0, 0.0003), _thread.interrupt_main)
        try:
            timer.start()
            try:
                with WriteBehind():
                    pass
            finally:
                timer.join()
        except KeyboardInterrupt:
            interrupted += 1
            timer.join()
    assert interrupted
    for thread in [t for t in threading.enumerate() if t.name == "shmcache-write-behind"]:
        thread.join(5)
    assert alive() == before
