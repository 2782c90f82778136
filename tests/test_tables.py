"""Tables (issue 11 items 2 and 3): put_table/open_table from every source, zero-copy
columns and Arrow, typed refusals, put_file and `shmcache put` of table files (locally and
through a real daemon), and share() of a list of dicts with one schema."""

from __future__ import annotations

import datetime
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import Daemon, load, unique

import shmcache
from shmcache._disk.mapped import MappedFile, mapped_base

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.feather as feather  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

ROWS = [
    {"id": "ann-0", "label": 3, "score": 0.5, "ok": True, "bbox": [1.0, 2.0, 3.0, 4.0], "tags": [1, 2]},
    {"id": "ünï 🐈", "label": None, "score": None, "ok": None, "bbox": [5.0, 6.5, 7.0, 8.0], "tags": None},
    {"id": None, "label": -7, "score": 1e300, "ok": False, "bbox": [0.0, 0.0, 0.0, 0.0], "tags": []},
]


def arrow_table() -> Any:
    stamps = pa.array([datetime.datetime(2024, 5, 1, 12, 30), None, datetime.datetime(1970, 1, 1)],
                      pa.timestamp("us", tz="UTC"))
    return pa.Table.from_pylist(ROWS).append_column("when", stamps).append_column(
        "cat", pa.array(["a", "b", "a"]).dictionary_encode()
    )


def _in_mapping(address: int, array: np.ndarray) -> bool:
    base = mapped_base(array)
    assert isinstance(base, MappedFile)
    return base.start_address() <= address < base.start_address() + len(base)


def _expected_rows() -> list[dict[str, Any]]:
    when = [datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc), None,
            datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)]
    return [row | {"when": w, "cat": c} for row, w, c in zip(ROWS, when, ["a", "b", "a"], strict=True)]


# ---------------------------------------------------------------------- sources


def test_arrow_table_round_trip_with_nulls_unicode_datetimes(store: shmcache.Store) -> None:
    store.put_table("t", arrow_table())
    table = store.open_table("t")
    assert len(table) == 3 and table.columns == [*ROWS[0], "when", "cat"]
    assert list(table) == _expected_rows()
    assert table[-1] == _expected_rows()[-1] and table[1:] == _expected_rows()[1:]
    assert table.to_arrow().equals(arrow_table().cast(table.to_arrow().schema))
    label = table.column("label")
    assert label.dtype == np.int64 and not label.flags.writeable
    np.testing.assert_array_equal(table.valid("label"), [True, False, True])
    np.testing.assert_array_equal(label[table.valid("label")], [3, -7])
    assert list(table.column("id")) == ["ann-0", "ünï 🐈", ""]  # a null string reads as ""
    assert table.column("bbox").values.shape == (12,)  # Arrow's list<double>: a ragged column
    assert [list(x) for x in table.column("tags")] == [[1, 2], [], []]
    assert table.column("when").dtype == np.dtype("datetime64[us]")
    assert table.schema["when"] == "timestamp[us, tz=UTC]" and table.schema["id"] == "large_string"
    assert isinstance(shmcache.open("t", root=store.root), shmcache.SharedTable)
    with pytest.raises(shmcache.KeyNotFoundError, match="no column 'nope'"):
        table.column("nope")


def test_dataframe_dict_of_columns_and_list_of_dicts(store: shmcache.Store) -> None:
    frame = pd.DataFrame({"x": [1.5, np.nan, 3.0], "n": [1, 2, 3], "s": ["a", None, "ç"],
                          "c": pd.Categorical(["u", "v", "u"])})
    store.put_table("df", frame)
    assert store.open_table("df")[1] == {"x": None, "n": 2, "s": None, "c": "v"}
    store.put_table("cols", {"a": np.arange(3, dtype=np.int16), "b": ["x", "y", None],
                             "m": np.eye(3, dtype=np.float32), "d": [1, 2.5, None],
                             "big_endian": np.arange(6, dtype=">f8").reshape(3, 2)})
    cols = store.open_table("cols")
    assert cols[2] == {"a": 2, "b": None, "m": [0.0, 0.0, 1.0], "d": None, "big_endian": [4.0, 5.0]}
    assert cols.to_arrow().column("big_endian").to_pylist()[2] == [4.0, 5.0]
    assert cols.column("a").dtype == np.int16 and cols.column("m").dtype == np.float32
    store.put_table("rows", ROWS)
    assert list(store.open_table("rows")) == ROWS


def test_empty_tables(store: shmcache.Store) -> None:
    store.put_table("none", [])
    assert len(store.open_table("none")) == 0 and store.open_table("none").columns == []
    schema = pa.schema([("s", pa.string()), ("v", pa.list_(pa.float32())), ("t", pa.timestamp("ns"))])
    store.put_table("typed", schema.empty_table())
    typed = store.open_table("typed")
    assert len(typed) == 0 and list(typed) == [] and typed.columns == ["s", "v", "t"]
    assert typed.to_arrow().num_rows == 0 and typed.column("t").dtype == np.dtype("datetime64[ns]")


def test_a_table_of_rows_but_no_column_keeps_its_rows(store: shmcache.Store, tmp_path: Path) -> None:
    """A table with rows and no column (columns dropped, JSON lines of ``{}``): ``len``,
    rows and ``to_arrow`` all say its rows (``to_arrow`` said 0)."""
    rowless = pa.table({"a": [1, 2, 3]}).drop(["a"])
    assert (rowless.num_rows, rowless.num_columns) == (3, 0)
    (tmp_path / "e.jsonl").write_text("{}\n" * 3)
    feather.write_feather(rowless, tmp_path / "e.arrow")
    store.put_table("t", rowless)
    store.put_table("d", [{}, {}, {}])
    store.put_file("j", tmp_path / "e.jsonl")
    store.put_file("a", tmp_path / "e.arrow")
    for key in ("t", "d", "j", "a"):
        table = store.open_table(key)
        assert (len(table), table.columns, list(table)) == (3, [], [{}, {}, {}]), key
        assert (table.to_arrow().num_rows, table.to_arrow().num_columns) == (3, 0), key


def test_table_files_of_no_row_are_empty_tables(store: shmcache.Store, tmp_path: Path) -> None:
    """A header-only CSV was refused as holding a column of "every value missing" (Arrow's
    null type): it is an empty table of its columns as strings, as a Parquet file of no row
    is one of its columns. An empty JSON lines file (or blank lines) was "not a readable
    jsonl file" with pyarrow (an empty table without it): an empty table. put_file and
    put_table of the path alike."""
    (tmp_path / "h.csv").write_text("a,b\n")
    (tmp_path / "n.csv").write_text("a,b")  # no newline: pyarrow finds no line at all
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("\n\n")
    pq.write_table(pa.table({"a": pa.array([], pa.int64())}), tmp_path / "e.parquet")
    expected = {"h.csv": ["a", "b"], "n.csv": ["a", "b"], "e.jsonl": [], "b.jsonl": [], "e.parquet": ["a"]}
    for name, columns in expected.items():
        for key, put in (("f", store.put_file), ("t", store.put_table)):
            put(key, tmp_path / name, overwrite=True)
            table = store.open_table(key)
            assert (len(table), table.columns, table.to_arrow().num_rows) == (0, columns, 0), name
    assert store.open_table("f").schema == {"a": "int64"}
    store.put_file("h", tmp_path / "h.csv")
    strings = pa.schema([("a", pa.large_string()), ("b", pa.large_string())])
    assert store.open_table("h").to_arrow().schema == strings


@pytest.mark.parametrize("suffix", [".parquet", ".feather", ".arrow", ".csv", ".jsonl"])
def test_table_files_through_put_file_and_put_table(
    store: shmcache.Store, tmp_path: Path, suffix: str
) -> None:
    data = pa.Table.from_pylist([{"id": "é", "v": 1.5, "n": 1}, {"id": "b", "v": None, "n": 2}])
    path = tmp_path / f"data{suffix}"
    if suffix == ".parquet":
        pq.write_table(data, path)
    elif suffix == ".feather":
        feather.write_feather(data, path)
    elif suffix == ".arrow":  # an IPC stream, not a file: read as well
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, data.schema) as writer:
            writer.write_table(data)
    elif suffix == ".csv":
        pcsv.write_csv(data, path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in data.to_pylist()))
    assert store.put_file("f", path) == ["f"]
    assert store.open_table("f")[:] == data.to_pylist()
    info = store.info("f")
    assert info.kind == "table" and info.source == str(path) and info.source_fingerprint is not None
    assert [p.key for p in store.plan_file("g", path)] == ["g"]
    store.put_table("g", path)
    assert list(store.open_table("g")) == data.to_pylist()


# ---------------------------------------------------------------------- zero copy, fresh rows, pickling


def test_columns_and_arrow_buffers_are_the_mapping(store: shmcache.Store) -> None:
    store.put_table("t", arrow_table())
    table = store.open_table("t")
    label = table.column("label")
    assert _in_mapping(label.ctypes.data, label)
    mapped = list(table._files.values())  # every file of the entry, each its own mapping

    def inside(address: int) -> bool:
        return any(array.size and _in_mapping(address, array) for array in mapped)

    arrow = table.to_arrow()
    checked = 0
    for name in ("label", "score", "id", "bbox", "tags", "when", "cat"):
        chunk = arrow.column(name).chunk(0)
        children = [chunk.values] if hasattr(chunk, "values") and name in ("bbox", "tags") else []
        for buffer in [b for array in (chunk, *children) for b in array.buffers()[:3]]:
            if buffer is not None and buffer.size:
                assert inside(buffer.address), name
                checked += 1
    assert checked >= 12
    assert not inside(arrow.column("ok").chunk(0).buffers()[1].address)  # bools are packed: a copy


def test_every_access_is_a_fresh_object(store: shmcache.Store) -> None:
    store.put_table("t", ROWS)
    table = store.open_table("t")
    row = table[0]
    row["bbox"].append(99.0)
    row["label"] = "changed"
    assert table[0] == ROWS[0] and table[0] is not table[0]
    assert table.valid("label") is not table.valid("label")
    assert table.column("score") is not table.column("score")  # a fresh view of the same memory
    with pytest.raises(ValueError, match="read-only"):
        table.column("score")[0] = 1.0


def test_pickles_by_reference_into_spawn_dataloader_workers(store: shmcache.Store) -> None:
    torch = pytest.importorskip("torch")
    from table_datasets import TableDataset

    anns = [{"bbox": [float(i)] * 4, "label": i, "id": f"a{i}"} for i in range(64)]
    table = store.share("anns", anns)
    assert isinstance(table, shmcache.SharedTable) and len(pickle.dumps(table)) < 500
    loader = torch.utils.data.DataLoader(TableDataset(table), batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn")
    items = list(loader)
    assert [item["again"] for item in items] == anns  # each worker's mutation stayed in its copy
    assert {item["kind"] for item in items} == {"SharedTable"}
    assert len({item["pid"] for item in items}) >= 1 and list(table) == anns


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("data", "column"),
    [
        (pa.table({"ok": [1], "s": pa.array([{"a": 1}])}), "s"),
        (pa.table({"d": pa.array([1], pa.decimal128(5, 2))}), "d"),
        (pa.table({"b": pa.array([b"x"], pa.binary())}), "b"),
        (pa.table({"l": pa.array([["x"]])}), "l"),
        (pd.DataFrame({"o": [1, "two", 3.0]}), "o"),
        ({"o": [1, "two"]}, "o"),
        ([{"k": {"nested": 1}}], "k"),
    ],
)
def test_unsupported_columns_are_refused_naming_them(store: shmcache.Store, data: Any, column: str) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match=f"column '{column}'"):
        store.put_table("bad", data)
    assert not store.exists("bad")


def test_corrupt_or_truncated_parquet_names_the_file(store: shmcache.Store, tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"x": list(range(1000))}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-100])
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + b"\x00" * 64)
    for path in (truncated, garbage):
        for attempt in (store.put_file, store.plan_file, store.put_table):
            with pytest.raises(shmcache.CorruptSourceError, match=path.name):
                attempt("bad", path)
    assert not store.exists("bad")
    with pytest.raises(shmcache.SourceNotFoundError):
        store.put_file("bad", tmp_path / "missing.parquet")


def test_without_pyarrow_columns_work_and_files_say_what_to_install(root: Path, tmp_path: Path) -> None:
    parquet = tmp_path / "x.parquet"
    pq.write_table(pa.table({"x": [1]}), parquet)
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text('{"a": 1, "b": "x"}\n{"a": 2, "b": "y"}\n')
    script = f"""
import sys
sys.modules["pyarrow"] = None  # what Python does for a missing package
import shmcache
store = shmcache.Store({str(root)!r})
store.put_table("cols", {{"a": [1, 2], "b": ["x", None]}})
store.put_table("rows", [{{"a": 1.5, "b": [1, 2]}}])
store.put_file("lines", {str(jsonl)!r})
print(store.open_table("cols")[1], store.open_table("rows")[0], list(store.open_table("lines")))
for attempt in (lambda: store.put_file("p", {str(parquet)!r}), store.open_table("cols").to_arrow):
    try:
        attempt()
    except shmcache.UnsupportedDataError as exc:
        print("refused:", exc)
print("pyarrow" in sys.modules and sys.modules["pyarrow"] is None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "{'a': 2, 'b': None} {'a': 1.5, 'b': [1, 2]} [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]"
    assert "x.parquet needs pyarrow: pip install 'shmcache[arrow]'" in lines[1]
    assert "to_arrow() needs pyarrow: pip install 'shmcache[arrow]'" in lines[2]
    assert lines[3] == "True"


# ---------------------------------------------------------------------- share() and records


def test_share_stores_a_list_of_dicts_with_one_schema_as_a_table(store: shmcache.Store) -> None:
    anns = [{"bbox": [1.5, 2.0, 3.0, 4.0], "label": 7, "id": "x", "crowd": False, "w": None},
            {"bbox": [0.5, 0.0, 1.0, 1.0], "label": 2**40, "id": "ÿ", "crowd": True, "w": 2.5}]
    table = store.share("anns", anns)
    assert isinstance(table, shmcache.SharedTable)
    assert list(table) == anns and len(table) == 2
    assert [type(v) for v in table[0].values()] == [list, int, str, bool, type(None)]
    assert type(table[1]["w"]) is float and type(table[0]["bbox"][1]) is float
    version = store.info("anns").version
    assert store.share("anns", [dict(a) for a in anns]) is table  # same content: reused
    assert store.info("anns").version == version


@pytest.mark.parametrize(
    "anns",
    [
        [{"a": 1}, {"a": 2.5}],  # int and float would come back as floats
        [{"a": [1, 2]}, {"a": [1.5]}],
        [{"a": 1}, {"b": 1}],
        [{"a": 1}, {"a": 1, "b": 2}],
        [{"a": {"nested": 1}}],
        [{"a": (1, 2)}],  # a tuple would come back a list
        [{"a": True}, {"a": 1}],
        [{"a": None}],
        [{"a": 1}, [1, 2]],
    ],
)
def test_share_keeps_records_for_mixed_or_nested_dicts(store: shmcache.Store, anns: list[Any]) -> None:
    shared = store.share("r", anns)
    assert isinstance(shared, shmcache.SharedRecords)
    assert list(shared) == json.loads(json.dumps(anns))


@pytest.mark.parametrize(
    "column",
    [
        [True, False, True],  # bools stay bools (marshal's T/F tags)
        [0, -(2**31), 2**31 - 1],  # int32 range: packed from marshal's 4-byte ints
        [2**31, -(2**31) - 1, 2**63 - 1],  # beyond int32: the general path, still int64
        [0.5, -0.0, float("inf"), 1e-300],
        [[1, 2], [3, -(2**31)]],  # fixed-size lists of ints
        [[1.5, 2.0], [0.0, 1e300]],  # fixed-size lists of floats
        [[1.5], [2.5, 3.5], []],  # ragged lists: offsets
        [[True, False], [False, True]],  # lists of bools: the general path
        ["ascii", "é€😀", "", "\udcff", "nul\0inside"],  # non-ASCII, lone surrogate, a NUL
        ["a", None, "ü"],
        [1, None, 3],
        [[1.0, 2.0], None],
    ],
)
def test_share_columns_come_back_with_their_exact_types(store: shmcache.Store, column: list[Any]) -> None:
    anns = [{"v": value, "n": i} for i, value in enumerate(column)]
    table = store.share("t", anns)
    assert isinstance(table, shmcache.SharedTable)
    assert list(table) == anns
    for row, ann in zip(table, anns, strict=True):
        assert type(row["v"]) is type(ann["v"])
        if isinstance(ann["v"], list):
            assert [type(x) for x in row["v"]] == [type(x) for x in ann["v"]]


@pytest.mark.parametrize(
    "column",
    [
        [1, True],  # bool among ints
        [True, 1],
        [1.0, 2],  # int among floats
        [np.float64(1.0), 2.0],  # a float subclass would come back a float
        [[1.0, 2.0], [1.0, 2]],  # an int inside fixed-size float lists
        [[1.0, 2.0], [1.0, True]],
        [[1, 2], [3, 2**80]],
        [[1.0, 2.0], (1.0, 2.0)],
        [[1.0, 2.0], [1.0, [2.0]]],
    ],
)
def test_share_keeps_records_when_a_type_would_change(store: shmcache.Store, column: list[Any]) -> None:
    shared = store.share("r", [{"v": value} for value in column])
    assert isinstance(shared, shmcache.SharedRecords)
    assert len(shared) == len(column) and shared[0] == {"v": column[0]}


_FLOAT = st.floats(allow_nan=False, allow_infinity=False)  # records refuse inf
_PLAIN = st.none() | st.booleans() | st.integers() | _FLOAT | st.text(max_size=6)
_NUMBER = st.booleans() | st.integers() | _FLOAT


def _typed(value: Any) -> Any:
    """``value`` with the type of every part beside it (what must survive share)."""
    if isinstance(value, list):
        return [_typed(x) for x in value]
    return (type(value), value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    column=st.lists(_PLAIN, min_size=1, max_size=12)
    | st.lists(st.lists(_NUMBER, min_size=2, max_size=2), min_size=1, max_size=12)
    | st.lists(st.lists(_NUMBER, max_size=3) | st.none(), min_size=1, max_size=12)
)
def test_share_round_trips_any_column_with_exact_types(store: shmcache.Store, column: list[Any]) -> None:
    anns = [{"v": value} for value in column]
    shared = store.share("h", anns, overwrite=True)  # one key across examples
    if isinstance(shared, shmcache.SharedTable):
        assert [_typed(row["v"]) for row in shared] == [_typed(value) for value in column]
    else:
        assert isinstance(shared, shmcache.SharedRecords) and len(shared) == len(column)


def test_rows_are_compiled_with_any_column_name(store: shmcache.Store) -> None:
    """Column names become literals in the compiled row: quotes, newlines, backslashes,
    lone surrogates and code-like text stay plain keys."""
    names = ["a'b\"c", "line\nbreak", "back\\slash", "\udcff", "}, __import__('os'): {", ""]
    anns = [{name: i * 10 + j for j, name in enumerate(names)} for i in range(3)]
    table = store.share("names", anns)
    assert isinstance(table, shmcache.SharedTable)
    assert table.columns == names and list(table) == anns and table[-1] == anns[-1]
    assert table[0] is not table[0] and table[1:] == anns[1:]
    with pytest.raises(IndexError):
        table[3]


def test_records_fast_path_keeps_the_exact_cases(store: shmcache.Store) -> None:
    records = [{"big": 2**80, "small": -(2**63) - 1, "u64": 2**64 - 1, "surrogate": "\udcff", "none": None,
                "nan": float("nan")},
               {"s": "null inside", "f": 1e-300, "n": -(2**63)}]
    store.put_records("r", records, allow_nan=True)
    got = store.open_records("r")
    assert got[0]["big"] == 2**80 and got[0]["small"] == -(2**63) - 1 and got[0]["u64"] == 2**64 - 1
    assert type(got[0]["big"]) is int and got[0]["surrogate"] == "\udcff" and np.isnan(got[0]["nan"])
    assert got[1] == records[1]


# ---------------------------------------------------------------------- CLI and daemon


def test_cli_put_of_a_parquet_file(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "anns.parquet"
    pq.write_table(pa.table({"label": [1, 2], "id": ["a", "b"]}), path)
    code, out, err = cli("put", str(path), "--key", "anns", "--local", "--root", str(root))
    assert code == 0, err
    assert out.split() == ["anns"]
    assert shmcache.open_table("anns", root=root)[1] == {"label": 2, "id": "b"}


def test_daemon_loads_a_parquet_file(daemon: Daemon, data_dir: Path, tmp_path: Path) -> None:
    key = unique("table")
    path = data_dir / f"{key}.parquet"
    pq.write_table(pa.table({"x": [1.5, 2.5], "s": ["é", None]}), path)
    with daemon.client() as client:
        job = load(client, key, path)
        assert job["state"] == "done", job
        outside = tmp_path / "outside.parquet"
        pq.write_table(pa.table({"x": [1]}), outside)
        refused = client.put(f"/v1/entries/{unique('out')}", json={"source": str(outside)})
        assert refused.status_code == 400 and "SourceNotAllowedError" in refused.text, refused.text
        corrupt = data_dir / f"{key}-bad.parquet"
        corrupt.write_bytes(b"PAR1 not really")
        bad = client.put(f"/v1/entries/{unique('bad')}", json={"source": str(corrupt)})
        assert bad.status_code in (400, 422) and "CorruptSourceError" in bad.text, bad.text
        assert "bad.parquet" in bad.text
    assert list(shmcache.open_table(key, root=daemon.root)) == [{"x": 1.5, "s": "é"}, {"x": 2.5, "s": None}]


def test_share_of_dicts_marshals_columns_never_the_whole_list(
    store: shmcache.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 item 5: deciding that a list of 1M dicts is no list of numbers took
    ``marshal.dumps`` of the whole list (more than the rest of ``share()`` together)."""
    from shmcache._containers import table_pack

    dumped: list[Any] = []
    real = table_pack.marshal.dumps

    def recording(values: Any, version: int) -> bytes:
        dumped.append(values)
        return real(values, version)

    monkeypatch.setattr(table_pack.marshal, "dumps", recording)
    anns = [{"bbox": [1.0, 2.0, 3.0, 4.0], "label": i, "id": f"a{i}"} for i in range(100)]
    table = store.share("anns", anns)
    assert table[7] == anns[7]
    assert dumped and all(type(values[0]) is not dict for values in dumped)  # columns only


def test_share_of_a_table_reuses_identical_dicts_and_refuses_one_changed_value(store: shmcache.Store) -> None:
    """The digest covers every column: a copy of the dicts is reused, one bbox float or one
    label changed is other content."""
    anns = [{"bbox": [float(i), 2.0, 3.5, 4.0], "label": i % 80, "id": f"ann-{i:06d}"} for i in range(1000)]
    store.share("anns", anns)
    version = store.info("anns").version
    store.share("anns", [dict(a, bbox=list(a["bbox"])) for a in anns])  # equal, other objects
    assert store.info("anns").version == version
    for changed in ({"bbox": [999.0, 2.0, 3.5, 4.0]}, {"label": 81}, {"id": "ann-x"}):
        other = [dict(a) for a in anns]
        other[500] |= changed
        with pytest.raises(shmcache.KeyExistsError, match="other content"):
            store.share("anns", other)
    assert store.info("anns").version == version and store.open("anns")[500] == anns[500]


_SHARE_WITHOUT_XXHASH = """
import sys
sys.modules["xxhash"] = None  # as if it were not installed
import shmcache
store = shmcache.Store(sys.argv[1])
anns = [{"bbox": [1.0, 2.0, 3.0, 4.0], "label": i, "id": f"a{i}"} for i in range(50)]
try:
    store.share("anns", anns)
except shmcache.KeyExistsError:
    print("refused")
store.share("own", anns)
first = store.info("own").version
store.share("own", anns)
print("reused" if store.info("own").version == first else "rewritten")
"""


def test_share_without_xxhash_hashes_with_sha256_and_never_reuses_an_xxh3_entry(root: Path) -> None:
    """The fallback digest has its own prefix: a process without xxhash reuses its own
    entries, and refuses (never wrongly reuses) one hashed with XXH3."""
    from shmcache._containers.encode import content_digest
    from shmcache._disk.meta import read_meta

    store = shmcache.Store(root)
    anns = [{"bbox": [1.0, 2.0, 3.0, 4.0], "label": i, "id": f"a{i}"} for i in range(50)]
    store.share("anns", anns)
    meta = read_meta(store.layout, store.info("anns").version)
    assert meta is not None and meta.content_hash is not None
    assert meta.content_hash.startswith("xxh3_128:")
    assert content_digest("array", {"data": np.arange(3)}) != content_digest("array", {"data": np.arange(4)})
    out = subprocess.run(
        [sys.executable, "-c", _SHARE_WITHOUT_XXHASH, str(root)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "reused"]


@pytest.mark.parametrize("recorded", ["legacy", "sha256"])
def test_share_reuses_an_identical_entry_hashed_before_the_upgrade(root: Path, recorded: str) -> None:
    """Roots outlive upgrades: an entry whose meta.json records the unprefixed SHA-256 of the
    versions before XXH3 (or the prefixed SHA-256 of a process without xxhash) is reused by
    an identical re-share, and still refused for other content."""
    import json

    from shmcache._containers.encode import content_digest, encode_any

    store = shmcache.Store(root)
    anns = [{"bbox": [1.0, 2.0, 3.0, float(i)], "label": i, "id": f"a{i}"} for i in range(50)]
    store.share("anns", anns)
    version = store.info("anns").version
    kind, files, _ = encode_any(anns, "anns")
    old_digest = content_digest(kind, files, "" if recorded == "legacy" else "sha256")
    meta_file = store.layout.objects / version / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["content_hash"] = old_digest  # as the older code recorded it
    meta_file.write_text(json.dumps(meta))
    store.share("anns", [dict(a) for a in anns])
    assert store.info("anns").version == version  # reused, not refused nor rewritten
    with pytest.raises(shmcache.KeyExistsError, match="other content"):
        store.share("anns", anns[:-1])


def test_float16_columns_give_python_floats_by_row(store: shmcache.Store) -> None:
    """A float16 column and a list-of-float16 column read by row (memoryview cannot index
    float16: it raised NotImplementedError) give the values as Python floats."""
    pa = pytest.importorskip("pyarrow")
    halves = np.array([0.5, 1.5, -2.0], dtype=np.float16)
    table = pa.table({
        "h": pa.array(halves),
        "l": pa.array([[np.float16(1.5)], [], [np.float16(2.5), np.float16(3)]], pa.list_(pa.float16())),
    })
    store.put_table("halves", table)
    shared = shmcache.open_table("halves", root=store.root)
    rows = [shared[i] for i in range(3)]
    assert rows == [{"h": 0.5, "l": [1.5]}, {"h": 1.5, "l": []}, {"h": -2.0, "l": [2.5, 3.0]}]
    assert all(type(row["h"]) is float for row in rows) and type(rows[2]["l"][0]) is float
