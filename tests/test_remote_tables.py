"""Table objects from URLs with flat memory (issue 21 item 7): each object is streamed into a
scratch file in the root's ``tmp/`` and decoded from there one row group / record batch /
block at a time (``_sources/remote_tables``). Against a real S3-compatible server on
loopback (moto's server mode): the tables read back as pyarrow reads the objects, a fresh
process's peak RSS grows by far less than the object, the scratch file is gone after a
success, a change of the object and a ``kill -9`` + ``cleanup``, and the budget counts the
scratch file with the table."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pa = pytest.importorskip("pyarrow")

import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.feather as feather  # noqa: E402
import pyarrow.json as pjson  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from s3_helpers import Cancelled, MotoServer, cancel_once_started, put_object  # noqa: E402
from service_helpers import mounted_tmpfs  # noqa: E402
from table_memory import BIG_ROWS, assert_flat, mixed_table, peak_growth, write_big_parquet  # noqa: E402

import shmcache  # noqa: E402
from shmcache._disk.layout import Layout  # noqa: E402
from shmcache._sources import remote_tables  # noqa: E402
from shmcache.errors import CacheFullError, CorruptSourceError, InvalidSourceError  # noqa: E402


def _tmp_items(root: Path) -> list[Path]:
    """What is left in the root's ``tmp/`` (scratch files live in version directories there)."""
    return list(Layout(root).tmp.iterdir()) if Layout(root).tmp.is_dir() else []


def _open_under(root: Path) -> list[str]:
    """Files in ``root``'s ``tmp/`` this process still holds open (removed ones too: none once
    a load returned; an open entry's files are under ``objects/``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(Layout(root).tmp)):
            found.append(target)
    return found


def _bodies(table: object) -> dict[str, tuple[bytes, object]]:
    """Each format's object and the table pyarrow reads back from it."""
    parquet, arrow_file, arrow_stream = io.BytesIO(), io.BytesIO(), io.BytesIO()
    pq.write_table(table, parquet, row_group_size=3_000)  # several row groups
    feather.write_feather(table, arrow_file, chunksize=2_500)  # several record batches
    with pa.ipc.new_stream(arrow_stream, table.schema) as stream:
        for batch in table.to_batches(max_chunksize=4_000):
            stream.write_batch(batch)
    flat = table.drop_columns(["lists"])  # CSV holds no lists
    csv = io.BytesIO()
    pcsv.write_csv(flat, csv)
    jsonl = "".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode()
    return {
        "t.parquet": (parquet.getvalue(), pq.read_table(io.BytesIO(parquet.getvalue()))),
        "t.feather": (arrow_file.getvalue(), feather.read_table(io.BytesIO(arrow_file.getvalue()))),
        "s.arrow": (arrow_stream.getvalue(), pa.ipc.open_stream(arrow_stream.getvalue()).read_all()),
        "t.csv": (csv.getvalue(), pcsv.read_csv(io.BytesIO(csv.getvalue()))),
        "t.jsonl": (jsonl, pjson.read_json(io.BytesIO(jsonl))),
    }


def test_table_objects_of_many_batches_read_back_as_pyarrow_reads_them(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """Numbers, strings, lists and bools with nulls that first appear after the first batch,
    in batches whose row counts are not multiples of 8; CSV and JSON lines over several of
    the streaming readers' 1 MiB blocks."""
    for name, (body, expected) in _bodies(mixed_table(60_003, categorical=False)).items():
        put_object(s3, bucket, name, body)
        key = name.replace(".", "-")
        assert store.put_file(key, f"s3://{bucket}/{name}", storage_options=s3.options()) == [key]
        back = store.open_table(key).to_arrow()
        assert back.num_rows == expected.num_rows and back.column_names == expected.column_names, name
        assert back.to_pylist() == expected.to_pylist(), name
        assert store.verify(key), name  # every file's CRC-32 is that of its bytes
        assert not _tmp_items(root), name  # the scratch file went with the load


def test_a_csv_whose_later_block_widens_a_type_is_read_whole(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """pyarrow's streaming CSV reader takes its types from the first block; a later block it
    cannot convert makes the load decode the file whole, as ``read_csv`` infers it."""
    body = ("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)) + "1.5,y\n").encode()
    put_object(s3, bucket, "wide.csv", body)
    store.put_file("wide", f"s3://{bucket}/wide.csv", storage_options=s3.options())
    back = store.open_table("wide").to_arrow()
    assert back.schema.field("a").type == pa.float64()
    assert back.to_pylist() == pcsv.read_csv(io.BytesIO(body)).to_pylist()
    assert not _tmp_items(root) and not _open_under(root)  # the streamed attempt's files closed


def test_a_column_with_no_value_in_the_first_block_is_typed_by_the_whole_file(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """A CSV or JSON lines column empty through the first 1 MiB block is of Arrow type null
    for the streaming reader (which a table cannot hold): the load reads the file whole, as
    a local path does, and gets the whole file's type."""
    jsonl = "".join(json.dumps({"a": i, "b": None}) + "\n" for i in range(100_000)) + '{"a": 1, "b": 5}\n'
    csv = "a,b\n" + "".join(f"{i},\n" for i in range(200_000)) + "1,hello\n"
    cases = (("n.jsonl", jsonl.encode(), pjson.read_json), ("n.csv", csv.encode(), pcsv.read_csv))
    for name, body, read in cases:
        put_object(s3, bucket, name, body)
        key = name.replace(".", "-")
        store.put_file(key, f"s3://{bucket}/{name}", storage_options=s3.options())
        expected = read(io.BytesIO(body))
        back = store.open_table(key).to_arrow()
        assert not pa.types.is_null(back.schema.field("b").type), name
        assert back.to_pylist() == expected.to_pylist(), name
        assert not _tmp_items(root) and not _open_under(root), name


def test_a_prefix_of_csv_objects_whose_types_differ_by_block_is_read_whole(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """The second object's first block says int64 where the first object's column is double:
    its whole-file type (double, from a later block) agrees, so the prefix is one table,
    read whole as before; objects that truly differ are still refused."""
    first = b"a,b\n0.5,x\n1,y\n"
    second = ("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)) + "1.5,y\n").encode()
    put_object(s3, bucket, "p/0.csv", first)
    put_object(s3, bucket, "p/1.csv", second)
    store.put_file("p", f"s3://{bucket}/p/", storage_options=s3.options())
    expected = pa.concat_tables([pcsv.read_csv(io.BytesIO(body)) for body in (first, second)])
    assert store.open_table("p").to_arrow().to_pylist() == expected.to_pylist()
    put_object(s3, bucket, "p/2.csv", b"a,c\n1,2\n")
    with pytest.raises(InvalidSourceError, match="do not share one schema"):
        store.put_file("p2", f"s3://{bucket}/p/", storage_options=s3.options())
    assert not store.exists("p2") and not _tmp_items(root)


def test_a_prefix_of_objects_whose_fields_differ_in_nullability_only_is_one_table(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """One writer declared a field (and a list's items) not nullable, another did not: a
    table entry records no nullability, so they are one table (refused as "do not share one
    schema" before), streamed and read whole alike; a field of another type still differs."""
    strict = pa.schema([pa.field("a", pa.int64(), nullable=False),
                        pa.field("l", pa.list_(pa.field("item", pa.float32(), nullable=False)))])
    first = pa.table({"a": [1, 2], "l": [[1.0], [2.0, 3.0]]}, schema=strict)
    loose = pa.schema([("a", pa.int64()), ("l", pa.list_(pa.float32()))])
    second = pa.table({"a": [3, None], "l": [None, [4.0]]}, schema=loose)
    for i, table in enumerate((first, second)):
        body = io.BytesIO()
        pq.write_table(table, body)
        put_object(s3, bucket, f"n/{i}.parquet", body.getvalue())
    url = f"s3://{bucket}/n/"
    expected = [{"a": 1, "l": [1.0]}, {"a": 2, "l": [2.0, 3.0]}, {"a": 3, "l": None}, {"a": None, "l": [4.0]}]
    store.put_file("n", url, storage_options=s3.options())
    assert store.open_table("n")[:] == expected
    with pytest.MonkeyPatch.context() as patch:  # the whole read (several objects: concatenated)
        patch.setattr(remote_tables, "has_pyarrow", lambda: False)
        store.put_file("w", url, storage_options=s3.options())
    assert store.open_table("w")[:] == expected
    body = io.BytesIO()
    pq.write_table(pa.table({"a": pa.array([5], pa.int32()), "l": [[5.0]]}), body)
    put_object(s3, bucket, "n/2.parquet", body.getvalue())
    with pytest.raises(InvalidSourceError, match="do not share one schema"):
        store.put_file("n2", url, storage_options=s3.options())
    assert not store.exists("n2") and not _tmp_items(root)


def test_a_damaged_row_group_fails_typed_after_the_first_ones_were_written(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    body, _ = _bodies(mixed_table(20_000, categorical=False))["t.parquet"]
    offset = pq.ParquetFile(io.BytesIO(body)).metadata.row_group(3).column(0).data_page_offset
    damaged = body[:offset] + b"\xff" * 16 + body[offset + 16 :]  # a page header of the 4th row group
    put_object(s3, bucket, "d.parquet", damaged)
    with pytest.raises(CorruptSourceError, match=r"d\.parquet is not a readable parquet file"):
        store.put_file("d", f"s3://{bucket}/d.parquet", storage_options=s3.options())
    assert not store.exists("d") and not _tmp_items(root) and not _open_under(root)


def test_a_changed_object_publishes_nothing_and_leaves_no_scratch_file(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    body, _ = _bodies(mixed_table(20_000, categorical=False))["t.parquet"]
    put_object(s3, bucket, "c.parquet", body)
    rewritten: list[bool] = []

    def rewrite_once(done: int, _total: int) -> None:
        if done and not rewritten:  # the object is in tmp/ now; same size, other bytes: the ETag tells
            put_object(s3, bucket, "c.parquet", body[:100] + bytes(reversed(body[100:200])) + body[200:])
            rewritten.append(True)

    with pytest.raises(CorruptSourceError, match="changed while loading"):
        store.put_file("c", f"s3://{bucket}/c.parquet", storage_options=s3.options(), progress=rewrite_once)
    assert rewritten and not store.exists("c") and not _tmp_items(root) and not _open_under(root)


def test_a_cancelled_load_leaves_no_scratch_file(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """The daemon's cancel (the progress callback raises) once the first object of a prefix
    is in its scratch file: the error comes out, nothing is published, ``tmp/`` is empty."""
    body, _ = _bodies(mixed_table(20_000, categorical=False))["t.parquet"]
    for name in ("a", "b"):
        put_object(s3, bucket, f"cancel/{name}.parquet", body)

    with pytest.raises(Cancelled):
        store.put_file(
            "c", f"s3://{bucket}/cancel/", storage_options=s3.options(), progress=cancel_once_started
        )
    assert store.list() == [] and not _tmp_items(root)


def test_cleanup_removes_the_scratch_file_of_a_killed_load(root: Path, s3: MotoServer, bucket: str) -> None:
    body, _ = _bodies(mixed_table(20_000, categorical=False))["t.parquet"]
    put_object(s3, bucket, "k.parquet", body)
    script = textwrap.dedent(
        f"""
        import os, signal, shmcache
        def die(done, total):
            if done:  # the object is in its scratch file: killed before it is decoded
                os.kill(os.getpid(), signal.SIGKILL)
        shmcache.Store({str(root)!r}).put_file(
            "k", "s3://{bucket}/k.parquet", storage_options={s3.options()!r}, progress=die
        )
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = [p for p in _tmp_items(root) if p.is_dir()]
    assert any(f.stat().st_size == len(body) for d in left for f in d.iterdir()), "no scratch file left"
    store = shmcache.Store(root)
    assert store.cleanup() >= len(body)
    assert not _tmp_items(root) and not store.exists("k")


def test_the_budget_counts_the_object_with_the_table(root: Path, s3: MotoServer, bucket: str) -> None:
    """The table alone fits the budget, the object beside it does not: refused, typed, and
    nothing changed (the entry already there stays, nothing left in tmp/)."""
    table = pa.table({"v": np.random.default_rng(0).random(1 << 17)})  # 1 MiB, incompressible
    body = io.BytesIO()
    pq.write_table(table, body, compression="none", row_group_size=1 << 15)
    put_object(s3, bucket, "b.parquet", body.getvalue())
    store = shmcache.Store(root, max_bytes=int(1.6 * (1 << 20)) + (64 << 10))
    store.put_array("other", np.arange(1 << 13, dtype=np.int64))  # 64 KiB, evictable
    with pytest.raises(CacheFullError, match="within the budget"):
        store.put_file("b", f"s3://{bucket}/b.parquet", storage_options=s3.options())
    assert not store.exists("b") and store.exists("other") and not _tmp_items(root)
    roomy = shmcache.Store(root, max_bytes=3 << 20)
    roomy.put_file("b", f"s3://{bucket}/b.parquet", storage_options=s3.options())
    assert np.array_equal(roomy.open_table("b").column("v"), table.column("v").to_numpy())


def test_a_load_that_fits_the_budget_evicts_nothing(root: Path, s3: MotoServer, bucket: str) -> None:
    """A 10 MiB budget, 9 MiB of entries, an object and its table of 0.3 MiB each: they fit
    beside the entries, so none goes (the reservation's slack and the Parquet estimate are
    taken only where they fit without evicting)."""
    store = shmcache.Store(root, max_bytes=10 << 20)
    for i in range(9):
        store.put_array(f"a{i}", np.zeros((1 << 20) // 8))
    table = pa.table({"x": np.random.default_rng(0).random((3 << 20) // 80)})
    body = io.BytesIO()
    pq.write_table(table, body, compression="none", row_group_size=1 << 13)
    put_object(s3, bucket, "t.parquet", body.getvalue())
    store.put_file("t", f"s3://{bucket}/t.parquet", storage_options=s3.options())
    assert sorted(e.key for e in store.list()) == [f"a{i}" for i in range(9)] + ["t"]
    assert np.array_equal(store.open_table("t").column("x"), table.column("x").to_numpy())


def test_a_table_that_fits_the_file_system_with_its_object_loads(
    tmp_path: Path, s3: MotoServer, bucket: str
) -> None:
    """On a 16 MiB tmpfs, a 5 MiB object whose table is 5 MiB: the scratch file and the column
    files (more than half the free space together) fit, and the load succeeds. (The check
    once counted what the load had written twice: free space lacks it, the reservation has it.)"""
    table = pa.table({"v": np.random.default_rng(0).random(5 << 17)})  # 5 MiB, incompressible
    body = io.BytesIO()
    pq.write_table(table, body, compression="none", row_group_size=1 << 15)
    put_object(s3, bucket, "f.parquet", body.getvalue())
    with mounted_tmpfs(tmp_path / "fs", "size=16m") as mountpoint:
        store = shmcache.Store(mountpoint / "root")
        store.put_file("f", f"s3://{bucket}/f.parquet", storage_options=s3.options())
        assert np.array_equal(store.open_table("f").column("v"), table.column("v").to_numpy())
        assert not _tmp_items(mountpoint / "root")
        big = pa.table({"v": np.random.default_rng(1).random(9 << 17)})  # 9 + 9 MiB: refused, typed
        body = io.BytesIO()
        pq.write_table(big, body, compression="none", row_group_size=1 << 15)
        put_object(s3, bucket, "g.parquet", body.getvalue())
        with pytest.raises(CacheFullError):
            store.put_file("g", f"s3://{bucket}/g.parquet", storage_options=s3.options())
        assert not store.exists("g") and store.exists("f") and not _tmp_items(mountpoint / "root")


def test_a_dictionary_column_is_checked_for_its_decoded_size(
    tmp_path: Path, s3: MotoServer, bucket: str
) -> None:
    """Parquet strings read back as a dictionary (a few KiB of indices and values) that
    decode to 24 MiB: on a 16 MiB tmpfs the load is refused by the room check before the
    strings are written, not by the file system midway; nothing is left."""
    rows = 120_000
    table = pa.table({"d": pa.array([f"c{i % 3}" + "x" * 200 for i in range(rows)]).dictionary_encode()})
    body = io.BytesIO()
    pq.write_table(table, body, row_group_size=rows)
    put_object(s3, bucket, "d.parquet", body.getvalue())
    with mounted_tmpfs(tmp_path / "fs", "size=16m") as mountpoint:
        store = shmcache.Store(mountpoint / "root")
        with pytest.raises(CacheFullError, match=r"has only .* free"):
            store.put_file("d", f"s3://{bucket}/d.parquet", storage_options=s3.options())
        assert not store.exists("d") and not _tmp_items(mountpoint / "root")


def test_a_wide_table_loads_under_the_usual_limit_of_descriptors(
    root: Path, s3: MotoServer, bucket: str
) -> None:
    """400 nullable string columns (1,200 column files) under ``ulimit -n 1024``, as a local
    put of the same file: no descriptor is held per column file across batches."""
    table = pa.table({f"c{i}": pa.array(["a", None, "bc"]) for i in range(400)})
    body = io.BytesIO()
    pq.write_table(table, body)
    put_object(s3, bucket, "wide.parquet", body.getvalue())
    script = textwrap.dedent(
        f"""
        import resource, shmcache
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        store = shmcache.Store({str(root)!r})
        store.put_file("w", "s3://{bucket}/wide.parquet", storage_options={s3.options()!r})
        print(store.open_table("w").to_arrow().num_columns)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["400"], done.stderr[-2000:]


def test_a_csv_that_does_not_parse_is_corrupt(
    store: shmcache.Store, root: Path, s3: MotoServer, bucket: str
) -> None:
    """A row with a column too many after the first block: CorruptSourceError naming the
    object, as the streamed read meets it."""
    body = ("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)) + "1,2,3\n").encode()
    put_object(s3, bucket, "bad.csv", body)
    with pytest.raises(CorruptSourceError, match=r"bad\.csv"):
        store.put_file("bad", f"s3://{bucket}/bad.csv", storage_options=s3.options())
    assert not store.exists("bad") and not _tmp_items(root) and not _open_under(root)


def test_a_fresh_process_loads_a_big_parquet_with_flat_memory(
    tmp_path: Path, root: Path, s3: MotoServer, bucket: str
) -> None:
    """Parquet objects of ~100 and ~200 MiB in row groups of the same size: the loader's
    peak RSS (VmHWM) is about the same for both (a few row groups' worth: the object's
    bytes in memory, as before, were 100% and more)."""
    small = io.BytesIO()
    growths = []
    for name, rows, groups in (("half", BIG_ROWS // 2, 13), ("big", BIG_ROWS, 25)):
        path = tmp_path / f"{name}.parquet"
        size = write_big_parquet(path, rows, groups)
        assert pq.ParquetFile(path).num_row_groups >= 8 and size > 75 << 20
        s3.boto().upload_file(str(path), bucket, f"{name}.parquet")
        if not small.tell():
            pq.write_table(pq.ParquetFile(path).read_row_group(0).slice(0, 1000), small)
            put_object(s3, bucket, "small.parquet", small.getvalue())
        path.unlink()
        warm_up = f"""
            import shmcache
            store = shmcache.Store({str(root)!r})
            options = {s3.options()!r}
            store.put_file("small", "s3://{bucket}/small.parquet", storage_options=options, overwrite=True)
            """  # every import done
        load = f'store.put_file("{name}", "s3://{bucket}/{name}.parquet", storage_options=options)'
        before, after = peak_growth(warm_up, load)
        growths.append((after - before, size))
        assert len(shmcache.Store(root).open_table(name)) == rows
    assert_flat(growths[0], growths[1], "an S3 Parquet object")
