"""Chunked Arrow columns (a ``save_to_disk`` folder's record batches, Parquet row groups)
stored from their chunks' own buffers: the files a put writes are byte for byte those of
the same table combined into one chunk first, for every column type, sliced chunks, empty
chunks and nulls (which take the combining path); and a Parquet file of several row groups
round-trips through ``put_file``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache._containers.table_arrow import arrow_column, encode_arrow, encode_arrow_parts
from shmcache._containers.table_encode import table_meta
from shmcache._disk.array_parts import ArrayParts, joined

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _batch(start: int, n: int) -> object:
    rows = np.arange(start, start + n)
    return pa.record_batch(
        {
            "i64": pa.array(rows, pa.int64()),
            "u8": pa.array(rows % 251, pa.uint8()),
            "f16": pa.array((rows / 7).astype(np.float16)),
            "f32": pa.array(rows * 0.5, pa.float32()),
            "s": pa.array([f"row {i} é" * (i % 3) for i in rows], pa.string()),
            "ls": pa.array([f"L{i}" for i in rows], pa.large_string()),
            "lst": pa.array([[float(i)] * (i % 4) for i in rows], pa.list_(pa.float32())),
            "llst": pa.array([list(range(i % 5)) for i in rows], pa.large_list(pa.int16())),
            "fixed": pa.array([[i, -i, 2 * i] for i in rows], pa.list_(pa.float64(), 3)),
            "flag": pa.array(rows % 2 == 0),
            "when": pa.array(rows.astype("datetime64[ms]")),
            "cat": pa.array([f"c{i % 3}" for i in rows]).dictionary_encode(),
            "holes": pa.array([None if i % 7 == 0 else int(i) for i in rows], pa.int32()),
        }
    )


def _chunked() -> object:
    """Batches of several sizes, some sliced (non-zero offsets into their buffers), one empty."""
    empty = _batch(40, 1).slice(0, 0)
    batches = [_batch(0, 10), _batch(10, 30).slice(5, 17), empty, _batch(40, 25).slice(3), _batch(90, 1)]
    return pa.Table.from_batches(batches)


def _combined(table: object) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """The files and meta of each column combined into one array, encoded whole."""
    files, descriptions = {}, []
    for i, column in enumerate(table.columns):
        found, desc = arrow_column(column.combine_chunks())
        files |= {f"c{i}.{part}": array for part, array in found.items()}
        descriptions.append(desc)
    return files, table_meta(table.column_names, descriptions, table.num_rows)


@pytest.mark.parametrize("chunks", ["several", "one"])
def test_chunked_columns_are_stored_as_the_combined_table_is(chunks: str) -> None:
    table = _chunked() if chunks == "several" else _chunked().combine_chunks()
    assert table.column("i64").num_chunks == (1 if chunks == "one" else 5)
    parts, meta = encode_arrow_parts(table, "t")
    whole, whole_meta = _combined(table)
    assert meta == whole_meta and parts.keys() == whole.keys()
    for name, array in parts.items():
        expected = whole[name]
        got = joined(array)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert got.tobytes() == expected.tobytes(), name
    names = table.column_names
    in_parts = {names[int(n[1:].partition(".")[0])] for n, a in parts.items() if isinstance(a, ArrayParts)}
    assert in_parts == {"i64", "u8", "f16", "f32", "s", "ls", "lst", "llst", "fixed"}


def test_a_parquet_file_of_many_row_groups_round_trips(store: shmcache.Store, tmp_path: Path) -> None:
    table = _chunked()
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=9)
    assert pq.ParquetFile(tmp_path / "t.parquet").num_row_groups > 3
    store.put_file("t", tmp_path / "t.parquet")
    back = store.open_table("t").to_arrow()
    assert back.equals(pq.read_table(tmp_path / "t.parquet").cast(back.schema).combine_chunks())
    assert list(store.open_table("t").column("s")) == table.column("s").to_pylist()


def test_a_table_file_put_does_not_import_pandas(root: Path, tmp_path: Path) -> None:
    """pyarrow's ``read_table``, ``Array.to_numpy`` and ``fill_null`` import pandas (1.1 s of
    a fresh process's put): a put of a Parquet file of every column type, nulls included,
    goes without them (a real fresh process)."""
    pytest.importorskip("pandas")
    pq.write_table(_chunked(), tmp_path / "t.parquet", row_group_size=9)
    code = (
        "import sys, shmcache\n"
        f"shmcache.Store({str(root)!r}).put_file('t', {str(tmp_path / 't.parquet')!r})\n"
        "print('pandas' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    table = shmcache.open_table("t", root=root)
    assert table.to_arrow().equals(pq.read_table(tmp_path / "t.parquet").cast(table.to_arrow().schema))


def test_string_chunks_past_2_gib_get_int64_offsets() -> None:
    """Each chunk's int32 offsets are shifted by what the earlier chunks hold: past 2 GiB
    that shift is computed in int64 (it overflowed int32). The 1.2 GB data buffer is
    numpy's lazily zeroed memory, shared by the three chunks: no page of it is touched."""
    from shmcache._containers.table_chunks import chunk_files

    data = pa.py_buffer(np.zeros(1_200_000_000, np.uint8))
    offsets = pa.py_buffer(np.array([0, 600_000_000, 1_200_000_000], np.int32))
    chunk = pa.Array.from_buffers(pa.string(), 2, [None, offsets, data])
    found = chunk_files(pa.chunked_array([chunk, chunk, chunk]))
    assert found is not None
    files, _ = found
    stored = files["offsets"]
    assert isinstance(stored, np.ndarray) and stored.dtype == np.int64
    np.testing.assert_array_equal(stored, np.arange(7, dtype=np.int64) * 600_000_000)


def test_a_column_of_only_missing_values_is_refused_by_name() -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match="column 'a' is of Arrow type null"):
        encode_arrow(pa.table({"a": pa.array([None, None]), "b": [1, 2]}), "table")
