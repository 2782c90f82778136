"""A table written batch by batch (``table_stream.TableAppender`` over ``npy_append``) gives
the very files ``encode_arrow`` gives for the whole table: values, rebased offsets, validity
bitmaps packed across batches whose row counts are not multiples of 8, and each file's
CRC-32 (its header written last, chained with ``crc32_combine``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from shmcache._containers.table_arrow import encode_arrow  # noqa: E402
from shmcache._containers.table_stream import ChangedLayout, TableAppender  # noqa: E402
from shmcache._disk.checksum import crc32_combine  # noqa: E402
from shmcache._disk.npy_append import NpyAppender  # noqa: E402
from shmcache.errors import UnsupportedDataError  # noqa: E402


def _table(rows: int, start: int, nulls: bool) -> object:
    ids = np.arange(start, start + rows)
    texts = [None if nulls and i % 7 == 3 else f"row {i}" * (i % 4) for i in ids]
    lists = [None if nulls and i % 5 == 1 else list(range(i % 3)) for i in ids]
    flags = [None if nulls and i % 6 == 2 else bool(i % 2) for i in ids]
    stamps = [datetime.datetime(2024, 1, 1) + datetime.timedelta(seconds=int(i)) for i in ids]
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "x": pa.array(ids / 3, pa.float32()),
            "text": pa.array(texts, pa.string()),
            "cat": pa.array([f"c{i % 3}" for i in ids], pa.string()).dictionary_encode(),
            "lists": pa.array(lists, pa.list_(pa.int32())),
            "flag": pa.array(flags, pa.bool_()),
            "when": pa.array(stamps, pa.timestamp("ms")),
            "pair": pa.array([[i, -i] for i in ids], pa.list_(pa.int16(), 2)),
        }
    )


def _written(tmp_path: Path, batches: list, schema: object) -> tuple[dict, dict, dict]:  # type: ignore[type-arg]
    paths: dict[str, Path] = {}

    def create(name: str) -> tuple[int, str]:
        paths[name] = tmp_path / f"{name}.npy"
        return os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL), str(paths[name])

    appender = TableAppender(schema, create, "t")
    for batch in batches:
        appender.add(batch)
    headers, crcs, meta = appender.finish()
    for name, path in paths.items():  # every CRC is that of the whole file, header first
        assert crcs[name] == zlib.crc32(path.read_bytes()), name
    return {name: np.load(path) for name, path in paths.items()}, headers, meta


def test_batches_appended_make_the_files_of_the_whole_table(tmp_path: Path) -> None:
    # nulls only from the third batch on (validity begun late, all valid before); odd row counts
    parts = [_table(13, 0, False), _table(0, 13, False), _table(21, 13, True), _table(5, 34, False)]
    whole = pa.concat_tables(parts)
    files, headers, meta = _written(tmp_path, parts, whole.schema)
    expected, expected_meta = encode_arrow(whole.combine_chunks(), "t")
    assert meta == expected_meta
    assert sorted(files) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(files[name], array, err_msg=name)
        assert files[name].dtype == array.dtype and headers[name].shape == array.shape, name


def test_record_batches_and_an_empty_table(tmp_path: Path) -> None:
    table = _table(40, 0, True)
    (tmp_path / "a").mkdir()
    files, _, meta = _written(tmp_path / "a", [], table.schema)
    assert meta["length"] == 0 and files["c0.values"].shape == (0,) and files["c2.offsets"].tolist() == [0]
    (tmp_path / "b").mkdir()
    files, _, meta = _written(tmp_path / "b", table.to_batches(max_chunksize=9), table.schema)
    expected, expected_meta = encode_arrow(table, "t")
    assert meta == expected_meta
    for name, array in expected.items():
        np.testing.assert_array_equal(files[name], array, err_msg=name)


def test_a_batch_that_needs_another_layout_asks_for_the_whole_table(tmp_path: Path) -> None:
    kind = pa.list_(pa.int16(), 2)
    schema = pa.schema([("pair", kind)])
    null = pa.FixedSizeListArray.from_arrays(pa.array([5, 6], pa.int16()), 2, mask=pa.array([True]))
    batches = [pa.table({"pair": pa.array([[1, 2]], kind)}), pa.table({"pair": null})]
    with pytest.raises(ChangedLayout):
        _written(tmp_path, batches, schema)
    bad = pa.table({"o": pa.array([{"a": 1}])})
    with pytest.raises(UnsupportedDataError, match=r"column 'o' is of Arrow type struct"):
        _written(tmp_path, [bad], bad.schema)


def _create_in(folder: Path) -> object:
    def create(name: str) -> tuple[int, str]:
        path = folder / f"{name}.npy"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), str(path)

    return create


def _data_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def test_the_bytes_announced_before_a_write_cover_it(tmp_path: Path) -> None:
    """``add(batch, before_write)`` announces what each column chunk adds once encoded: a
    dictionary column's decoded strings (far more than the batch's Arrow size), bools (a
    byte each here, a bit in Arrow), a bitmap begun late; so a caller reserves enough."""
    rows = 20_000
    cats = pa.array([f"c{i % 3}" + "x" * 200 for i in range(rows)]).dictionary_encode()
    flags = pa.array([None if i > rows // 2 and i % 9 == 0 else bool(i % 2) for i in range(rows)])
    table = pa.table({"cat": cats, "flag": flags})
    appender = TableAppender(table.schema, _create_in(tmp_path), "t")  # type: ignore[arg-type]
    announced = []
    for batch in table.to_batches(max_chunksize=7_001):
        appender.add(batch, announced.append)
        assert sum(announced) >= _data_bytes(tmp_path)  # never written beyond what was announced
    assert _data_bytes(tmp_path) >= rows * 201  # the strings, decoded
    assert sum(announced) >= _data_bytes(tmp_path)


def test_no_descriptor_is_held_between_batches(tmp_path: Path) -> None:
    """400 nullable string columns are 1,200 files: none stays open between batches (a wide
    table loads under the usual limit of 1,024 descriptors)."""
    table = pa.table({f"c{i}": pa.array(["a", None, "bc"]) for i in range(400)})
    appender = TableAppender(table.schema, _create_in(tmp_path), "t")  # type: ignore[arg-type]
    appender.add(table)
    appender.add(table)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed since)
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert appender.file_count == 1_200 and not [p for p in held if p.startswith(str(tmp_path))]
    appender.finish()
    assert len(list(tmp_path.iterdir())) == 1_200


def test_an_unfinished_npy_file_does_not_load(tmp_path: Path) -> None:
    """Until ``finish`` writes its header, the file has no ``.npy`` magic: a file left
    unfinished fails to load instead of reading as an empty array."""
    path = tmp_path / "a.npy"
    appender = NpyAppender(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), str(path), np.dtype(np.int64))
    appender.append(np.arange(10))
    with pytest.raises(ValueError):
        np.load(path)
    appender.finish()
    assert np.load(path).tolist() == list(range(10))


def test_crc32_combine_is_zlibs() -> None:
    rng = np.random.default_rng(0)
    for first, second in [(0, 1), (5, 0), (100, 12345), (3, 1 << 20)]:
        a, b = rng.bytes(first), rng.bytes(second)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
