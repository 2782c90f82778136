"""Strings, ragged arrays, records, mappings, groups and share(): round trips and guarantees."""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmcache

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def key(self, base: str) -> str:
        self.n += 1
        return f"{base}/{self.n}"


@pytest.fixture
def keys() -> _Counter:
    return _Counter()


# ---------------------------------------------------------------------- strings


@SETTINGS
@given(strings=st.lists(st.text(), max_size=40))
def test_strings_round_trip_any_unicode(store: shmcache.Store, keys: _Counter, strings: list[str]) -> None:
    key = keys.key("s")
    store.put_strings(key, strings)
    shared = store.open_strings(key)
    assert len(shared) == len(strings)
    assert list(shared) == strings
    assert [shared[i] for i in range(-len(strings), len(strings))] == strings + strings
    assert shared[1:-1:2] == strings[1:-1:2]
    for text in strings:
        assert text in shared
        assert shared.index(text) == strings.index(text)
    with pytest.raises(IndexError):
        shared[len(strings)]


def test_strings_lookup_misses_and_types(store: shmcache.Store) -> None:
    store.put_strings("p", ["a", "b", "a", ""])
    shared = store.open_strings("p")
    assert "c" not in shared and 1 not in shared and None not in shared
    assert shared.index("a") == 0 and shared.index("") == 3 and shared.count("a") == 2
    assert shared.index("a", 1) == 2
    with pytest.raises(ValueError, match="'c' is not in"):
        shared.index("c")


def test_strings_lone_surrogates_and_non_str_items(store: shmcache.Store) -> None:
    store.put_strings("u", ["\ud800", "x\udfff", "😀"])
    assert list(store.open_strings("u")) == ["\ud800", "x\udfff", "😀"]
    with pytest.raises(shmcache.UnsupportedDataError, match=r"\[1\] is int"):
        store.put_strings("bad", ["ok", 1])  # type: ignore[list-item]
    assert not store.exists("bad")


# ---------------------------------------------------------------------- ragged


@SETTINGS
@given(
    dtype=st.sampled_from([np.float32, np.int64, np.uint8, np.bool_, np.complex64]),
    lengths=st.lists(st.integers(0, 6), max_size=12),
    inner=st.sampled_from([(), (2,), (3, 2)]),
    data=st.data(),
)
def test_ragged_round_trip(
    store: shmcache.Store, keys: _Counter, dtype: Any, lengths: list[int], inner: tuple[int, ...], data: Any
) -> None:
    arrays = [data.draw(hnp.arrays(dtype, (n, *inner))) for n in lengths]
    key = keys.key("r")
    store.put_ragged(key, arrays)
    shared = store.open_ragged(key)
    assert len(shared) == len(arrays)
    for got, want in zip(shared, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        assert not got.flags.writeable
    assert shared.lengths.tolist() == lengths


def test_ragged_refuses_mixed_items(store: shmcache.Store) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match=r"\[1\]"):
        store.put_ragged("r", [np.zeros((2, 3)), np.zeros((2, 4))])
    with pytest.raises(shmcache.UnsupportedDataError, match="0-d"):
        store.put_ragged("r", [np.float64(1.0)])
    with pytest.raises(shmcache.UnsupportedDataError, match="object"):
        store.put_ragged("r", [np.array([None])])
    assert store.list() == []


# ---------------------------------------------------------------------- records


@SETTINGS
@given(records=st.lists(JSON, max_size=20))
def test_records_round_trip(store: shmcache.Store, keys: _Counter, records: list[Any]) -> None:
    key = keys.key("j")
    store.put_records(key, records)
    shared = store.open_records(key)
    assert list(shared) == records
    assert shared[-1:] == records[-1:]


def test_records_normalise_numpy_scalars_and_tuples(store: shmcache.Store) -> None:
    store.put_records("a", [{"score": np.float32(0.5), "n": np.int64(3), "box": (1, 2)}])
    assert store.open_records("a")[0] == {"score": 0.5, "n": 3, "box": [1, 2]}


def test_mutating_a_record_never_changes_the_cache(store: shmcache.Store) -> None:
    store.put_records("anns", [{"boxes": [[1, 2, 3, 4]], "label": "cat"}])
    shared = store.open_records("anns")
    first = shared[0]
    first["boxes"].append([0, 0, 0, 0])
    first["label"] = "dog"
    assert shared[0] == {"boxes": [[1, 2, 3, 4]], "label": "cat"}
    assert shared[0] is not shared[0]


def _mutate_then_report(root: str, queue: Any) -> None:
    shared = shmcache.open_records("anns", root=root)
    record = shared[0]
    record["label"] = "changed in child"
    queue.put(shared[0]["label"])


def test_mutation_in_another_process_is_invisible(store: shmcache.Store) -> None:
    store.put_records("anns", [{"label": "cat"}])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_mutate_then_report, args=(str(store.root), queue))
    child.start()
    assert queue.get(timeout=60) == "cat"
    child.join(timeout=60)
    assert child.exitcode == 0
    assert store.open_records("anns")[0] == {"label": "cat"}


@pytest.mark.parametrize(
    ("record", "where"),
    [
        ({"a": {1, 2}}, r"\[0\]\['a'\] is a set"),
        ({"a": [b"x"]}, r"\[0\]\['a'\]\[0\] is a bytes"),
        ({"a": {"b": object()}}, r"\[0\]\['a'\]\['b'\] is a object"),
        ({"a": float("nan")}, r"\[0\]\['a'\] is nan"),
        ({"a": float("inf")}, r"\[0\]\['a'\] is inf"),
        ({1: "x"}, r"\[0\] has key 1"),
        ({"a": np.zeros(2)}, r"ndarray.*tolist"),
    ],
)
def test_non_json_values_name_their_path(store: shmcache.Store, record: dict[Any, Any], where: str) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match=where):
        store.put_records("bad", [record])
    assert not store.exists("bad")


def test_nan_allowed_on_request(store: shmcache.Store) -> None:
    store.put_records("nan", [{"a": float("nan")}], allow_nan=True)
    assert math.isnan(store.open_records("nan")[0]["a"])


# ---------------------------------------------------------------------- mapping


@SETTINGS
@given(
    mapping=st.dictionaries(st.text(), st.integers(-(2**31), 2**31), max_size=30),
)
def test_mapping_of_numbers_round_trip(
    store: shmcache.Store, keys: _Counter, mapping: dict[str, int]
) -> None:
    key = keys.key("m")
    store.put_mapping(key, mapping)
    shared = store.open_mapping(key)
    assert len(shared) == len(mapping) and list(shared) == list(mapping)
    for name, value in mapping.items():
        assert name in shared and shared[name] == value
    assert "\x00missing" not in shared
    with pytest.raises(KeyError):
        shared["\x00missing"]


def test_mapping_value_forms(store: shmcache.Store) -> None:
    scans = {"a": np.arange(6.0).reshape(2, 3), "b": np.ones((2, 3))}
    store.put_mapping("rows", scans)
    rows = store.open_mapping("rows")
    np.testing.assert_array_equal(rows["b"], scans["b"])
    assert not rows["a"].flags.writeable

    store.put_mapping("ragged", {"a": np.zeros((1, 2)), "b": np.zeros((3, 2))})
    assert store.open_mapping("ragged")["b"].shape == (3, 2)

    store.put_mapping("paths", {"x": "/data/x.jpg", "y": "/data/y.jpg"})
    assert dict(store.open_mapping("paths")) == {"x": "/data/x.jpg", "y": "/data/y.jpg"}

    store.put_mapping("anns", {"x": {"k": [1]}, "y": [2]})
    anns = store.open_mapping("anns")
    anns["x"]["k"].append(5)
    assert anns["x"] == {"k": [1]}


def test_mapping_refuses_mixed_values_and_non_str_keys(store: shmcache.Store) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match="arrays may not be mixed"):
        store.put_mapping("m", {"a": "x", "b": np.zeros(2)})
    with pytest.raises(shmcache.UnsupportedDataError, match="key 1"):
        store.put_mapping("m", {1: "x"})  # type: ignore[dict-item]
    assert store.list() == []


# ---------------------------------------------------------------------- kinds, pickling


def test_wrong_kind_is_a_clear_error(store: shmcache.Store) -> None:
    store.put_strings("s", ["a"])
    store.put_array("a", np.arange(2))
    with pytest.raises(shmcache.UnsupportedDataError, match=r"holds strings.*open_strings"):
        store.open_array("s")
    with pytest.raises(shmcache.UnsupportedDataError, match=r"holds array.*open_array"):
        store.open_records("a")
    assert isinstance(store.open("s"), shmcache.SharedStrings)
    assert isinstance(store.open("a"), np.ndarray)


def test_containers_pickle_as_small_references(store: shmcache.Store) -> None:
    store.put_strings("s", [f"/path/{i}" for i in range(100_000)])
    store.put_records("r", [{"i": i} for i in range(10_000)])
    store.put_ragged("g", [np.zeros((i % 5, 4)) for i in range(10_000)])
    store.put_mapping("m", {f"k{i}": i for i in range(10_000)})
    for key in ("s", "r", "g", "m"):
        shared = store.open(key)
        payload = pickle.dumps(shared)
        assert len(payload) < 1024, key
        clone = pickle.loads(payload)
        assert type(clone) is type(shared) and len(clone) == len(shared)
    assert pickle.loads(pickle.dumps(store.open_strings("s")))[99_999] == "/path/99999"


def test_replaced_container_keeps_old_version_for_holders(store: shmcache.Store) -> None:
    store.put_strings("s", ["old"])
    held = store.open_strings("s")
    store.put_strings("s", ["new", "er"], overwrite=True)
    assert list(held) == ["old"]
    assert list(store.open_strings("s")) == ["new", "er"]
    store.evict("s")
    with pytest.raises(shmcache.KeyNotFoundError):
        store.open_strings("s")
    assert list(held) == ["old"]


# ---------------------------------------------------------------------- group, share


def test_group_is_a_lazy_mapping_of_a_put_directory(store: shmcache.Store, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "a.npy", np.arange(3))
    np.save(tmp_path / "sub" / "b.npy", np.ones(2))
    store.put_file("feats", tmp_path)
    store.put_array("featsX", np.zeros(1))
    group = store.open_group("feats")
    assert sorted(group) == ["a", "sub/b"] and len(group) == 2
    np.testing.assert_array_equal(group["sub/b"], np.ones(2))
    assert "a" in group and "featsX" not in group and "../x" not in group
    with pytest.raises(KeyError):
        group["missing"]
    clone = pickle.loads(pickle.dumps(group))
    assert len(pickle.dumps(group)) < 1024 and sorted(clone) == ["a", "sub/b"]


def test_a_typo_or_a_group_opened_as_one_entry_says_so(store: shmcache.Store, tmp_path: Path) -> None:
    for name in ("a", "b", "c", "d"):
        np.save(tmp_path / f"{name}.npy", np.arange(3))
    store.put_file("scannet", tmp_path)
    with pytest.raises(shmcache.KeyNotFoundError, match="no entries under 'scanet/'"):
        store.open_group("scanet")  # a typo: no silent empty group
    for open_one in (store.open_array, store.open):
        with pytest.raises(shmcache.KeyNotFoundError) as caught:
            open_one("scannet")
        message = str(caught.value)
        assert "is a group of 4 entries (scannet/a, scannet/b, scannet/c, ...)" in message
        assert "open_array('scannet/a')" in message and "open_group('scannet')" in message
    with pytest.raises(shmcache.KeyNotFoundError, match="put it first"):
        store.open_array("scanet")
    assert sorted(store.open_group("scannet/")) == ["a", "b", "c", "d"]


def test_share_picks_the_form(store: shmcache.Store) -> None:
    assert isinstance(store.share("a", np.arange(3)), np.ndarray)
    assert isinstance(store.share("s", ["x", "y"]), shmcache.SharedStrings)
    assert isinstance(store.share("g", [np.zeros(2), np.ones(3)]), shmcache.SharedRagged)
    assert isinstance(store.share("t", [{"a": 1}]), shmcache.SharedTable)  # one schema: columns
    assert isinstance(store.share("r", [{"a": {"b": 1}}]), shmcache.SharedRecords)
    assert isinstance(store.share("m", {"a": np.zeros(2)}), shmcache.SharedMapping)
    for bad in (42, [1, "a"], {1, 2}, [object()]):
        with pytest.raises(shmcache.UnsupportedDataError):
            store.share("bad", bad)
    assert not store.exists("bad")


def test_share_reuses_identical_content_and_refuses_different(store: shmcache.Store) -> None:
    store.share("paths", ["a", "b"])
    first = store.info("paths").version
    store.share("paths", ["a", "b"])
    assert store.info("paths").version == first
    with pytest.raises(shmcache.KeyExistsError, match=r"other content.*overwrite=True"):
        store.share("paths", ["a", "c"])  # another experiment's list under the same key
    assert store.info("paths").version == first and list(store.open_strings("paths")) == ["a", "b"]
    assert list(store.share("paths", ["a", "c"], overwrite=True)) == ["a", "c"]
    assert store.info("paths").version != first


def test_module_level_functions_use_the_default_root(root: Path) -> None:
    shmcache.put_strings("s", ["x"])
    shmcache.put_ragged("g", [np.zeros(1)])
    shmcache.put_records("r", [{}])
    shmcache.put_mapping("m", {"k": "v"})
    assert list(shmcache.open_strings("s")) == ["x"]
    assert len(shmcache.open_ragged("g")) == 1
    assert shmcache.open_records("r")[0] == {}
    assert shmcache.open_mapping("m")["k"] == "v"
    with pytest.raises(shmcache.KeyNotFoundError, match="single entry"):
        shmcache.open_group("m")  # an entry, not a group
    assert list(shmcache.share("t", ["y"])) == ["y"]
    assert (root / "entries" / "s").is_symlink()
