"""Local table files put with flat memory (issue 21): ``put_file``/``put_table`` of a
``.parquet``, ``.feather``/``.arrow``, ``.csv`` or ``.jsonl`` read the user's file in place
one row group / record batch / block at a time (``_sources/table_batches``), as remote table
objects are. Real files, real tmpfs roots: the entries are byte for byte those of the whole
decode (column files, CRCs, ``meta.json``); a fresh process's peak RSS grows by far less
than the table; a source changed mid-load, a budget exceeded mid-stream and a corrupt file
publish nothing and leave nothing in ``tmp/``."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.feather as feather  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from table_memory import BIG_ROWS, assert_flat, mixed_table, peak_growth, write_big_parquet  # noqa: E402

import shmcache  # noqa: E402
from shmcache._containers import table_stream  # noqa: E402
from shmcache._disk.layout import Layout  # noqa: E402
from shmcache._sources import table_batches, tables  # noqa: E402
from shmcache._sources.tables import read_table_source  # noqa: E402
from shmcache._units import size_in_bytes  # noqa: E402
from shmcache.errors import CacheFullError, CorruptSourceError, NoRoomError  # noqa: E402

_VOLATILE = ("key", "version", "created")  # what differs between any two puts
_JSON_BLOCK = table_batches._JSON_BLOCK  # the default (the fixture below lowers it)


@pytest.fixture(autouse=True)
def _batches_unjoined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch written alone (small batches are joined up to 8 MiB): these tests' small
    tables cross batch boundaries as big ones do."""
    monkeypatch.setattr(table_batches, "_GROUP", 1)
    monkeypatch.setattr(table_batches, "_JSON_BLOCK", 1 << 20)  # several blocks of JSON lines too


def _tmp_items(root: Path) -> list[Path]:
    return list(Layout(root).tmp.iterdir()) if Layout(root).tmp.is_dir() else []


def _decoding_threads() -> list[str]:
    """Threads still decoding a table's next batch (none once a put returned or raised)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("shmcache-table")]


def _write_files(directory: Path, table: Any) -> list[Path]:
    """The table as each format, in several row groups / batches / 1 MiB blocks."""
    paths = {name: directory / name for name in ("t.parquet", "t.feather", "s.arrow", "t.csv", "t.jsonl")}
    pq.write_table(table, paths["t.parquet"], row_group_size=3_000)
    feather.write_feather(table, paths["t.feather"], chunksize=2_500)
    with pa.ipc.new_stream(paths["s.arrow"], table.schema) as stream:
        for batch in table.to_batches(max_chunksize=4_000):
            stream.write_batch(batch)
    flat = table.drop_columns(["lists", "cat"])  # CSV holds no lists; a dictionary reads back as strings
    pcsv.write_csv(flat, paths["t.csv"])
    rows = table.drop_columns(["when"]).to_pylist()  # JSON has no timestamps
    paths["t.jsonl"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [_settled(path) for path in paths.values()]


def _settled(path: Path) -> Path:
    """``path`` dated a minute ago: no put sees it as just written (a "racy" fingerprint,
    recorded by one put and not by a later one)."""
    old = path.stat().st_mtime_ns - 60 * 10**9
    os.utime(path, ns=(old, old))
    return path


def _entry(root: Path, key: str) -> dict[str, Any]:
    """Every file of ``key``'s version, ``meta.json`` parsed without what differs by put."""
    layout = Layout(root)
    version = layout.entry_version(key)
    assert version is not None, key
    found: dict[str, Any] = {}
    for path in sorted(layout.version_dir(version).iterdir()):
        if path.name == "meta.json":
            meta = json.loads(path.read_text())
            found[path.name] = {k: v for k, v in meta.items() if k not in _VOLATILE}
        else:
            found[path.name] = path.read_bytes()
    return found


def _put_whole(store: shmcache.Store, key: str, path: Path) -> None:
    """The put as it was before streaming: the file decoded whole, then written."""
    files, meta = read_table_source(path)
    store._put_entry(key, "table", files, meta, overwrite=False, pin=False)


@contextmanager
def _counted_batches() -> Iterator[list[int]]:
    """The rows of each batch the table appender writes (the real appender, watched)."""
    seen: list[int] = []
    real = table_stream.TableAppender.add

    def add(self: Any, batch: Any, before_write: Any = None) -> None:
        seen.append(batch.num_rows)
        real(self, batch, before_write)

    table_stream.TableAppender.add = add  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        table_stream.TableAppender.add = real  # type: ignore[method-assign]


def test_streamed_entries_are_byte_for_byte_those_of_the_whole_decode(
    store: shmcache.Store, root: Path, tmp_path: Path
) -> None:
    """Each format, several batches each (nulls first met after the first, row counts not
    multiples of 8): the same column files, CRCs and ``meta.json`` as decoding whole, by
    ``put_file`` and by ``put_table``; nothing left in ``tmp/``."""
    for path in _write_files(tmp_path, mixed_table(60_003)):
        key = path.name.replace(".", "-")
        with _counted_batches() as batches:
            assert store.put_file(key, path) == [key]
        assert len(batches) > 1 and sum(batches) == 60_003, (path.name, batches)  # streamed
        store.put_table(f"{key}-t", path)
        _put_whole(store, f"{key}-whole", path)
        whole = _entry(root, f"{key}-whole")
        assert _entry(root, key) == whole, path.name
        assert _entry(root, f"{key}-t") == whole, path.name
        assert store.verify(key), path.name
        assert not _tmp_items(root), path.name


def test_a_csv_whose_types_change_after_the_first_block_is_decoded_whole_as_before(
    store: shmcache.Store, root: Path, tmp_path: Path
) -> None:
    """Ints for 200,000 rows (several blocks), then a float; a column empty in the first
    block: the streamed read gives way to the whole one, with the same entry as before."""
    widened = tmp_path / "widened.csv"
    widened.write_text("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)) + "1.5,y\n")
    late = tmp_path / "late.jsonl"
    rows = ({"a": i, "b": None if i < 100_000 else "s"} for i in range(120_000))
    late.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for path in (_settled(widened), _settled(late)):
        key = path.stem
        store.put_file(key, path)
        _put_whole(store, f"{key}-whole", path)
        assert _entry(root, key) == _entry(root, f"{key}-whole"), path.name
        assert not _tmp_items(root)
    assert store.open_table("widened").column("a").dtype == np.float64


def test_a_fresh_process_puts_a_big_local_parquet_with_flat_memory(root: Path, tmp_path: Path) -> None:
    """Uncompressed Parquet files of ~95 and ~190 MiB in row groups of the same size: the
    putting process's peak RSS (VmHWM) is about the same for both (decoding whole held all
    of the table and more)."""
    growths = []
    for name, rows, groups in (("half", BIG_ROWS // 2, 13), ("big", BIG_ROWS, 25)):
        growth = _put_growth(root, tmp_path, name, rows, groups)
        decoded = shmcache.Store(root).info(name).nbytes
        assert decoded > 75 << 20 and len(shmcache.Store(root).open_table(name)) == rows
        growths.append((growth, decoded))
    assert_flat(growths[0], growths[1], "a local Parquet file")


def _put_growth(root: Path, tmp_path: Path, key: str, rows: int, groups: int) -> int:
    """The peak RSS a fresh process gains putting a big Parquet file of ``rows`` rows in
    ``groups`` row groups as ``key`` (its imports done first, on a small file)."""
    path = tmp_path / f"{key}.parquet"
    write_big_parquet(path, rows, groups)
    small = tmp_path / "small.parquet"
    pq.write_table(pq.ParquetFile(path).read_row_group(0).slice(0, 1000), small)
    warm_up = f"""
        import shmcache
        store = shmcache.Store({str(root)!r})
        store.put_file("small", {str(small)!r}, overwrite=True)  # every import done
        """
    before, after = peak_growth(warm_up, f"store.put_file({key!r}, {str(path)!r})")
    path.unlink()
    return after - before


def test_one_big_row_group_is_read_in_batches_with_the_memory_of_many_small_ones(
    root: Path, tmp_path: Path
) -> None:
    """~95 MiB of Parquet as ONE row group (as writers with a large row_group_size make):
    read in ~8 MiB batches, the put grows the process about as much as for the same table
    in 13 row groups (read whole, one row group grew it by more than the table: +631 MiB
    for a 244 MiB row group before)."""
    growths = {groups: _put_growth(root, tmp_path, f"g{groups}", BIG_ROWS // 2, groups) for groups in (13, 1)}
    decoded = shmcache.Store(root).info("g1").nbytes
    assert len(shmcache.Store(root).open_table("g1")) == BIG_ROWS // 2 and decoded > 75 << 20
    report = f"one row group: +{growths[1] >> 20} MiB, 13: +{growths[13] >> 20} MiB ({decoded >> 20} MiB)"
    assert growths[1] < growths[13] + decoded // 4, report
    print(report)


@pytest.mark.parametrize("chunks", [1, 25])
def test_put_table_of_an_arrow_table_or_dataset_makes_no_copy_of_it(root: Path, chunks: int) -> None:
    """A ~190 MiB pyarrow Table (one chunk, or 25 as Parquet row groups and datasets' Arrow
    files give) and a ``datasets.Dataset`` over it: the put's peak RSS grows by under 40% of
    the table (the offsets of its strings), not by a copy of it (joining the chunks, or
    casting one chunk's strings to large strings, copied it whole)."""
    warm_up = f"""
        import numpy as np, pyarrow as pa, shmcache
        rows = {BIG_ROWS}
        rng = np.random.default_rng(1)
        letters = pa.py_buffer(rng.integers(97, 123, rows * 20, dtype=np.uint8))
        offsets = pa.py_buffer(np.arange(0, rows * 20 + 1, 20, dtype=np.int32))
        strings = pa.StringArray.from_buffers(rows, offsets, letters)
        table = pa.table({{"x": rng.random(rows), "n": rng.integers(0, 1 << 60, rows), "s": strings}})
        table = pa.Table.from_batches(table.to_batches(max_chunksize=-(-rows // {chunks})))
        store = shmcache.Store({str(root)!r})
        store.put_table("small", table.slice(0, 1000), overwrite=True)  # every import done
        """
    before, after = peak_growth(warm_up, "store.put_table('big', table)")
    decoded = shmcache.Store(root).info("big").nbytes
    assert decoded > 150 << 20
    assert after - before < 0.4 * decoded, f"peak RSS grew {(after - before) >> 20} MiB, {decoded >> 20} MiB"
    if chunks > 1 and importlib.util.find_spec("datasets") is not None:
        dataset = textwrap.dedent(warm_up) + "import datasets\ndata = datasets.Dataset(table)\n"
        before, after = peak_growth(dataset, "store.put_table('big', data, overwrite=True)")
        assert after - before < 0.4 * decoded, f"a Dataset's put grew {(after - before) >> 20} MiB"


def _parquet(path: Path, rows: int = 1 << 17, groups: int = 8) -> Any:
    """1 MiB of incompressible float64 in ``groups`` row groups."""
    table = pa.table({"v": np.random.default_rng(0).random(rows)})
    pq.write_table(table, path, compression="none", row_group_size=rows // groups)
    return table


def _after_first_batch(change: Callable[[], None]) -> Any:
    """An appender ``add`` that runs ``change`` once, after the first batch is written."""
    real = table_stream.TableAppender.add
    done = []

    def add(self: Any, batch: Any, before_write: Any = None) -> None:
        real(self, batch, before_write)
        if not done:
            done.append(1)
            change()

    return add


@pytest.mark.parametrize("how", ["rewritten", "truncated"])
def test_a_source_changed_mid_load_publishes_nothing(
    store: shmcache.Store, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The file rewritten (same size, other bytes) or truncated after its first row group
    was written: CorruptSourceError saying it changed, nothing published (the entry there
    stays), nothing left in ``tmp/``."""
    path = tmp_path / "t.parquet"
    _parquet(path)
    store.put_array("t", np.arange(3))
    body = path.read_bytes()

    def change() -> None:
        if how == "truncated":
            os.truncate(path, len(body) // 2)
        else:
            with open(path, "r+b") as fp:  # a byte of the last row group's values
                fp.seek(len(body) // 2)
                fp.write(bytes([body[len(body) // 2] ^ 0xFF]))

    monkeypatch.setattr(table_stream.TableAppender, "add", _after_first_batch(change))
    with pytest.raises(CorruptSourceError, match=r"t\.parquet.*changed"):
        store.put_file("t", path, overwrite=True)
    assert np.array_equal(store.open_array("t"), np.arange(3))
    assert not _tmp_items(root)


def test_a_budget_exceeded_mid_stream_publishes_nothing(root: Path, tmp_path: Path) -> None:
    """1.8 MiB of strings in 8 row groups, dictionary-encoded (22 KiB by the row groups'
    sizes: too small an estimate to refuse it ahead), under a budget that holds about a
    third of it: the first row groups are written, then CacheFullError saying the table
    needs more than what was asked for; nothing published, nothing in ``tmp/``, the entry
    already there stays; under a roomier budget the same file loads."""
    path = tmp_path / "b.parquet"
    table = pa.table({"s": [f"value-{i % 10:04d}-" + "x" * 40 for i in range(1 << 15)]})
    pq.write_table(table, path, row_group_size=4096, compression="none")
    store = shmcache.Store(root, max_bytes=(1 << 19) + (64 << 10))
    store.put_array("other", np.arange(1 << 10, dtype=np.int64))
    with _counted_batches() as batches, pytest.raises(CacheFullError) as refused:
        store.put_file("b", path)
    assert not store.exists("b") and store.exists("other") and not _tmp_items(root)
    with _counted_batches() as all_batches:
        shmcache.Store(root, max_bytes=4 << 20).put_file("whole", path)
    assert 1 <= len(batches) < len(all_batches), batches  # refused mid-stream, not before the first
    assert not _decoding_threads()
    assert re.search(r"b\.parquet: its table needs more than [\d.]+ KiB", str(refused.value)), refused.value
    roomy = shmcache.Store(root, max_bytes=4 << 20)
    roomy.put_table("b", path)
    assert roomy.open_table("b").to_arrow().column("s").to_pylist() == table.column("s").to_pylist()


def test_a_table_known_too_big_is_refused_before_anything_is_evicted(root: Path, tmp_path: Path) -> None:
    """A 1 MiB Parquet (its row groups' sizes say so) under a 576 KiB budget holding two
    entries: NoRoomError before the first row group, saying what the table needs, with
    both entries still there (evicting them could not have made room); a Parquet that
    fits once they go evicts them as before."""
    path = tmp_path / "b.parquet"
    _parquet(path)
    store = shmcache.Store(root, max_bytes=(1 << 19) + (64 << 10))
    store.put_array("one", np.arange(1 << 14, dtype=np.int64))
    store.put_array("two", np.arange(1 << 14, dtype=np.int64))
    with _counted_batches() as batches, pytest.raises(NoRoomError) as refused:
        store.put_file("b", path)
    assert batches == [] and store.exists("one") and store.exists("two") and not _tmp_items(root)
    said = re.search(r"b\.parquet: its table needs about ([\d.]+ [KMG]iB)", str(refused.value))
    assert said is not None, str(refused.value)
    roomy = shmcache.Store(root, max_bytes=4 << 20)
    roomy.put_table("b", path)
    assert 0.9 < size_in_bytes(said.group(1).replace(" ", "")) / roomy.info("b").nbytes < 1.4, said.group(1)
    roomy.evict("b")
    _parquet(path, rows=1 << 16)  # 512 KiB: fits once both go
    store.put_file("b", path)
    assert store.exists("b") and not store.exists("one")


def test_a_budget_exceeded_mid_csv_says_the_table_needs_more(root: Path, tmp_path: Path) -> None:
    """A CSV's whole size is not known mid-stream: the refusal says the table needs more
    than what was asked for when it came, and nothing is published."""
    path = tmp_path / "b.csv"
    pcsv.write_csv(_parquet(tmp_path / "b.parquet"), path)
    store = shmcache.Store(root, max_bytes=1 << 19)
    with pytest.raises(CacheFullError, match=r"b\.csv: its table needs more than [\d.]+ [KM]iB") as refused:
        store.put_file("b", path)
    assert "within the budget" in str(refused.value)  # the budget's own words follow
    assert not store.exists("b") and not _tmp_items(root) and not _decoding_threads()


def test_a_csv_row_that_does_not_parse_fails_without_a_whole_decode(
    store: shmcache.Store, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row with a column too many after the first 1 MiB block: CorruptSourceError naming
    the file as soon as its block is read (the whole read would fail on it alike, so the
    file is not decoded whole to find that out); nothing published, nothing in tmp/."""
    path = tmp_path / "bad.csv"
    path.write_bytes(("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)) + "1,2,3\n").encode())
    whole: list[object] = []
    read_whole = tables.read_table_file
    monkeypatch.setattr(tables, "read_table_file", lambda *a: whole.append(a) or read_whole(*a))
    with pytest.raises(CorruptSourceError, match=r"bad\.csv.*Expected 2 columns, got 3"):
        store.put_file("bad", path)
    assert not whole and not store.exists("bad") and not _tmp_items(root) and not _decoding_threads()


def test_lines_longer_than_a_block_load(
    store: shmcache.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON lines of 2 MiB (documents of a language-model corpus) stream in 16 MiB blocks;
    a 20 MiB line and a 3 MiB CSV field, longer than a block, load too (where the stream
    meets one, the file is read whole in one block); they were refused: pyarrow's
    "straddling object ... (try to increase block size?)"."""
    monkeypatch.setattr(table_batches, "_JSON_BLOCK", _JSON_BLOCK)
    whole: list[object] = []
    read_whole = tables.read_table_file
    monkeypatch.setattr(tables, "read_table_file", lambda *a: whole.append(a) or read_whole(*a))
    texts = ["short", "x" * (2 << 20), "y" * 100]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    store.put_file("docs", docs)
    assert store.open_table("docs").to_arrow().column("text").to_pylist() == texts and not whole
    texts.append("z" * (20 << 20))
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    store.put_file("long", docs)
    assert store.open_table("long").to_arrow().column("text").to_pylist() == texts
    rows = tmp_path / "rows.csv"
    rows.write_text("a,b\n1,short\n2," + "x" * (3 << 20) + "\n3,z\n")
    store.put_file("rows", rows)
    assert store.open_table("rows").to_arrow().column("b").to_pylist() == ["short", "x" * (3 << 20), "z"]


def test_a_corrupt_parquet_is_a_typed_error_naming_the_file(
    store: shmcache.Store, root: Path, tmp_path: Path
) -> None:
    """A truncated footer, and a row group damaged after the first ones were written:
    CorruptSourceError naming the file; nothing published or left in ``tmp/``."""
    good = tmp_path / "good.parquet"
    _parquet(good)
    body = good.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(body[:-100])
    damaged = tmp_path / "damaged.parquet"
    metadata = pq.ParquetFile(good).metadata
    last = metadata.row_group(metadata.num_row_groups - 1).column(0)
    start = last.data_page_offset
    damaged.write_bytes(body[:start] + b"\xff" * 64 + body[start + 64 :])  # the last group's page header
    for path in (truncated, damaged):
        with pytest.raises(CorruptSourceError, match=path.name):
            store.put_file("bad", path)
        with pytest.raises(CorruptSourceError, match=path.name):
            store.put_table("bad", path)
        assert not store.exists("bad") and not _tmp_items(root) and not _decoding_threads()
    buffer = io.BytesIO(body)
    assert pq.read_table(buffer).num_rows == 1 << 17  # the good file was good


def test_small_batches_are_written_in_joined_groups_byte_for_byte(
    store: shmcache.Store, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consecutive small batches are joined before they are written (the per-batch cost of
    writing paid per group): fewer appends than batches, the same entry as the whole
    decode (dictionaries of different batches unified, nulls across joins)."""
    monkeypatch.setattr(table_batches, "_GROUP", 1_000_000)  # batches of 130-220 kB
    for path in _write_files(tmp_path, mixed_table(60_003)):
        key = path.name.replace(".", "-")
        with _counted_batches() as batches:
            store.put_file(key, path)
        unjoined = {"t.parquet": 21, "t.feather": 25, "s.arrow": 16}.get(path.name)
        assert sum(batches) == 60_003 and len(batches) > 1, (path.name, batches)
        if unjoined is not None:  # (CSV/JSONL blocks are 1 MiB: joined in pairs at most)
            assert len(batches) < unjoined, (path.name, batches)
        _put_whole(store, f"{key}-whole", path)
        assert _entry(root, key) == _entry(root, f"{key}-whole"), path.name
    assert not _tmp_items(root) and not _decoding_threads()


def test_a_feather_v1_file_is_decoded_whole(store: shmcache.Store, tmp_path: Path) -> None:
    """Feather V1 has no record batches to stream (it is not Arrow IPC): read whole, as
    before streaming."""
    path = tmp_path / "v1.feather"
    table = pa.table({"a": np.arange(10), "s": [str(i) for i in range(10)]})
    with pytest.warns(DeprecationWarning):
        feather.write_feather(table, path, version=1)
    store.put_file("k", _settled(path))
    assert list(store.open_table("k").column("s")[:3]) == ["0", "1", "2"]
    assert list(store.open_table("k").column("a")[:]) == list(range(10))


def test_jsonl_is_decoded_whole_where_pyarrow_cannot_stream_it(
    store: shmcache.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow.json.open_json is new in pyarrow 20 (pyproject allows 14): without it, a
    JSON lines file is decoded whole (the attribute removed: what such a pyarrow lacks)."""
    import pyarrow.json as pjson

    monkeypatch.delattr(pjson, "open_json")
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"a": i}) + "\n" for i in range(100)))
    store.put_file("k", _settled(path))
    assert list(store.open_table("k").column("a")[:]) == list(range(100))


def test_a_put_from_a_thread_that_outlives_the_main_thread_streams(root: Path, tmp_path: Path) -> None:
    """The decode-ahead thread is a plain thread: ``concurrent.futures`` refuses work once
    the main thread has exited, and a put may run in a thread that outlives it."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"v": np.arange(100_000)}), path, row_group_size=10_000)
    _settled(path)
    script = textwrap.dedent(f"""
        import threading, time, shmcache
        store = shmcache.Store({str(root)!r})
        def load():
            time.sleep(0.3)  # the main thread has exited by then
            store.put_file("k", {str(path)!r})
            print(len(store.open_table("k")), flush=True)
        threading.Thread(target=load).start()
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "100000", done.stderr[-2000:]


def test_an_interrupt_right_after_an_append_opens_its_file_leaks_no_descriptor(tmp_path: Path) -> None:
    """KeyboardInterrupt raised at the first line after ``os.open`` in an append (a tracer
    raises it there, as a signal could): the descriptor is closed all the same."""
    from shmcache._disk.npy_append import NpyAppender

    path = tmp_path / "a.npy"
    appender = NpyAppender(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), str(path), np.dtype(np.int64))
    raised: list[int] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not NpyAppender.append.__code__:
            return None
        if event == "line" and not raised and frame.f_locals.get("fd", -1) >= 0:
            raised.append(frame.f_locals["fd"])
            raise KeyboardInterrupt
        return trace

    before = len(os.listdir("/proc/self/fd"))
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            appender.append(np.arange(10))
    finally:
        sys.settrace(None)
    assert raised, "the tracer never saw the file opened"
    assert len(os.listdir("/proc/self/fd")) == before


class _Cancelled(Exception):
    pass


def test_progress_is_reported_per_batch_and_a_cancel_mid_stream_publishes_nothing(
    store: shmcache.Store, root: Path, tmp_path: Path
) -> None:
    """``put_file``'s progress comes after each batch written, the file's bytes read so far
    (a daemon job's progress and cancel work mid-stream); a callback that raises there
    stops the put: nothing published, nothing left in ``tmp/``, no decode thread."""
    for path in _write_files(tmp_path, mixed_table(60_003)):
        key = path.name.replace(".", "-")
        seen: list[tuple[int, int]] = []
        store.put_file(key, path, progress=lambda done, total, seen=seen: seen.append((done, total)))
        size = path.stat().st_size
        middle = [done for done, total in seen if 0 < done < size]
        assert len(middle) > 1 and middle == sorted(middle) and seen[-1] == (size, size), (path.name, seen)

        def cancel(done: int, total: int) -> None:
            if 0 < done < total:
                raise _Cancelled

        with _counted_batches() as batches, pytest.raises(_Cancelled):
            store.put_file(f"{key}-c", path, progress=cancel)
        assert len(batches) == 1, (path.name, batches)  # stopped after the first batch
        assert not store.exists(f"{key}-c") and not _tmp_items(root) and not _decoding_threads()


def test_a_progress_error_at_the_last_call_publishes_nothing(
    store: shmcache.Store, root: Path, tmp_path: Path
) -> None:
    """The last ``progress(size, size)`` of a table file came after the entry was published:
    a callback that raised there made the put fail though its entry was there (a caller
    retried, or distrusted it). It now comes before the publish, as every kind's: the error
    cancels the put, and nothing is published."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"a": list(range(100))}), path)

    def fail_at_the_end(done: int, total: int) -> None:
        if done == total:
            raise _Cancelled

    with pytest.raises(_Cancelled):
        store.put_file("k", path, progress=fail_at_the_end)
    assert not store.exists("k") and not _tmp_items(root)
