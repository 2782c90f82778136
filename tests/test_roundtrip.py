"""put_array/open_array round trips (hypothesis) and refusal of what cannot be shared."""

from __future__ import annotations

import itertools
import os
import pickle
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmcache
from shmcache import KeyExistsError, Store, UnsupportedDataError

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_keys = itertools.count()

_scalar = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?"),
    hnp.complex_number_dtypes(endianness="?"),
    hnp.byte_string_dtypes(endianness="?", max_len=8),
    hnp.unicode_string_dtypes(endianness="?", max_len=8),
    hnp.datetime64_dtypes(endianness="?"),
    hnp.timedelta64_dtypes(endianness="?"),
)
# Field names: any latin-1 text (what .npy format 1.0/2.0 headers can hold), titles optional.
_field_names = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=255), min_size=1, max_size=6)


@st.composite
def _structured(draw: st.DrawFn, depth: int = 0) -> np.dtype:
    names = draw(st.lists(_field_names, min_size=1, max_size=4, unique=True))
    fields: list[tuple[Any, ...]] = []
    for name in names:
        inner = draw(_structured(depth + 1)) if depth < 1 and draw(st.booleans()) else draw(_scalar)
        shape = draw(st.sampled_from([(), (2,), (1, 2)]))
        fields.append((name, inner, shape) if shape else (name, inner))
    return np.dtype(fields)


_dtypes = st.one_of(_scalar, _structured())
_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


def _fresh_key() -> str:
    return f"rt/{next(_keys)}"


def _assert_same(result: np.ndarray, expected: np.ndarray) -> None:
    assert type(result) is np.ndarray
    assert result.dtype == expected.dtype
    assert result.shape == expected.shape
    # Bit-for-bit in logical (C) order: covers NaN payloads, NaT, structured and padded data.
    assert result.tobytes() == expected.tobytes()
    if expected.dtype.names is None:
        equal_nan = expected.dtype.kind in "fcmM"
        assert np.array_equal(result, expected, equal_nan=equal_nan)
    else:
        assert (result == expected).shape == expected.shape


def _assert_read_only(result: np.ndarray) -> None:
    # (setflags(write=True) is allowed: the mapping is copy-on-write, tests/test_torch_writes.py)
    assert not result.flags.writeable
    with pytest.raises(ValueError):
        result[...] = np.zeros((), dtype=result.dtype)


@SETTINGS
@given(array=hnp.arrays(_dtypes, _shapes))
def test_round_trip(store: Store, array: np.ndarray) -> None:
    key = _fresh_key()
    info = store.put_array(key, array)
    result = store.open_array(key)
    _assert_same(result, array)
    _assert_read_only(result)
    assert info.key == key and info.nbytes == array.nbytes and info.shape == array.shape


@SETTINGS
@given(array=hnp.arrays(_scalar, hnp.array_shapes(min_dims=2, max_dims=4, min_side=2, max_side=5)))
def test_fortran_order_is_preserved(store: Store, array: np.ndarray) -> None:
    fortran = np.asfortranarray(array)
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    key = _fresh_key()
    store.put_array(key, fortran)
    result = store.open_array(key)
    _assert_same(result, fortran)
    assert result.flags.f_contiguous and not result.flags.c_contiguous
    _assert_read_only(result)


@SETTINGS
@given(
    array=hnp.arrays(_dtypes, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7)),
    data=st.data(),
)
def test_non_contiguous_input(store: Store, array: np.ndarray, data: st.DataObject) -> None:
    steps = data.draw(st.lists(st.sampled_from([-3, -2, -1, 2, 3]), min_size=array.ndim, max_size=array.ndim))
    view = array[tuple(slice(None, None, step) for step in steps)]
    if data.draw(st.booleans()):
        view = view.T
    key = _fresh_key()
    store.put_array(key, view)
    result = store.open_array(key)
    _assert_same(result, view)
    _assert_read_only(result)


def test_large_non_contiguous_array_is_written_in_chunks(store: Store) -> None:
    base = np.arange(3 * 2048 * 1100, dtype=np.float64).reshape(3 * 2048, 1100)
    view = base[::3, ::-2]  # rows far apart; more than one 16 MiB chunk of the writer
    store.put_array("big", view)
    _assert_same(store.open_array("big"), view)


def test_plain_python_data_is_converted(store: Store) -> None:
    store.put_array("ints", [[1, 2], [3, 4]])
    store.put_array("strs", ["a", "bcd"])
    store.put_array("scalar", 3.5)
    _assert_same(store.open_array("ints"), np.array([[1, 2], [3, 4]]))
    _assert_same(store.open_array("strs"), np.array(["a", "bcd"]))
    _assert_same(store.open_array("scalar"), np.array(3.5))


class _Tagged(np.ndarray):
    """An ndarray subclass a user might hand in."""


def test_subclass_input_comes_back_as_plain_ndarray(store: Store) -> None:
    tagged = np.arange(6).reshape(2, 3).view(_Tagged)
    store.put_array("tagged", tagged)
    result = store.open_array("tagged")
    assert type(result) is np.ndarray
    np.testing.assert_array_equal(result, np.arange(6).reshape(2, 3))


EDGE_CASES: dict[str, np.ndarray] = {
    "0-d": np.array(5),
    "0-d-structured": np.zeros((), dtype=[("a", "i4"), ("b", "S3")]),
    "empty": np.zeros((0,)),
    "empty-middle": np.zeros((3, 0, 2), dtype=np.int16),
    "empty-fortran": np.zeros((2, 0, 3), order="F"),
    "empty-structured": np.zeros((0,), dtype=[("a", "i4")]),
    "bytes": np.array([b"xy", b"", b"a\x00b"]),
    "unicode": np.array(["é", "名前", ""]),
    "datetime-nat": np.array(["2020-01-01", "NaT"], dtype="M8[D]"),
    "timedelta": np.array([1, -5, 0], dtype="m8[ns]"),
    "float-specials": np.array([np.nan, -0.0, np.inf, -np.inf]),
    "complex-nan": np.array([complex(np.nan, 1), 1j]),
    "big-endian": np.arange(6, dtype=">i8").reshape(2, 3),
    "bool": np.array([[True, False], [False, True]]),
    "float16": np.linspace(0, 1, 7, dtype=np.float16),
    "latin-1-field-names": np.zeros(2, dtype=[("é'\"", "i4"), (("title", "n"), "f8")]),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(store: Store, name: str) -> None:
    array = EDGE_CASES[name]
    store.put_array(name, array)
    result = store.open_array(name)
    _assert_same(result, array)
    _assert_read_only(result)
    assert store.info(name).shape == array.shape


def test_non_latin1_field_names_round_trip_or_are_refused_clearly(store: Store) -> None:
    array = np.zeros(2, dtype=[("名", "i4")])
    try:
        store.put_array("k", array)
    except UnsupportedDataError as exc:
        assert "latin-1" in str(exc) or "field name" in str(exc)
    else:
        _assert_same(store.open_array("k"), array)


def test_open_array_again_returns_current_data(store: Store) -> None:
    store.put_array("k", np.arange(5))
    first = store.open_array("k")
    assert store.open_array("k") is first  # attached once per process
    np.testing.assert_array_equal(shmcache.open_array("k"), np.arange(5))  # module level, same root


def test_pickling_an_opened_array_sends_a_reference(store: Store) -> None:
    data = np.arange(1 << 16, dtype=np.float64)
    store.put_array("p", data)
    array = store.open_array("p")
    payload = pickle.dumps(array)
    assert len(payload) < 1024  # a reference, not 512 KiB of data
    np.testing.assert_array_equal(pickle.loads(payload), data)
    view = array[10:20:2]
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(view)), data[10:20:2])


# ---------------------------------------------------------------------- refused data

UNSUPPORTED: dict[str, Any] = {
    "object": np.array([1, "a"], dtype=object),
    "object-of-numbers": np.array([1, 2], dtype=object),
    "structured-with-object": np.zeros(3, dtype=[("x", "i4"), ("o", "O")]),
    "nested-object": np.zeros(2, dtype=[("s", [("o", "O")])]),
    "ragged-list": [[1, 2], [3]],
    "huge-int": 2**100,
    "masked": np.ma.array([1, 2, 3], mask=[False, True, False]),
    "masked-no-mask": np.ma.array([1.0, 2.0]),
}


def _files_under(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(Path(d, f).relative_to(path)) for d, _, files in os.walk(path) for f in files) + sorted(
        str(Path(d, s).relative_to(path)) for d, subdirs, _ in os.walk(path) for s in subdirs
    )


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_data_is_refused_and_nothing_is_published(store: Store, root: Path, name: str) -> None:
    with pytest.raises(UnsupportedDataError) as info:
        store.put_array("bad", UNSUPPORTED[name])
    assert isinstance(info.value, TypeError)
    assert "bad" in str(info.value)  # names the key
    assert store.list() == []
    assert _files_under(root / "tmp") == []
    assert _files_under(root / "objects") == []
    with pytest.raises(shmcache.KeyNotFoundError):
        store.open_array("bad")


def test_unsupported_data_does_not_replace_an_existing_entry(store: Store) -> None:
    store.put_array("k", np.arange(3))
    with pytest.raises(UnsupportedDataError):
        store.put_array("k", np.array([None]), overwrite=True)
    np.testing.assert_array_equal(store.open_array("k"), np.arange(3))


# ---------------------------------------------------------------------- overwrite


def test_existing_key_needs_overwrite(store: Store) -> None:
    store.put_array("k", np.arange(3))
    with pytest.raises(KeyExistsError) as info:
        store.put_array("k", np.arange(4))
    assert isinstance(info.value, FileExistsError)
    assert "overwrite" in str(info.value)
    np.testing.assert_array_equal(store.open_array("k"), np.arange(3))
    store.put_array("k", np.ones(4, dtype=np.float32), overwrite=True)
    result = store.open_array("k")
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, np.ones(4, dtype=np.float32))
    assert [e.key for e in store.list()] == ["k"]


def test_overwrite_removes_the_old_version(store: Store, root: Path) -> None:
    old = store.put_array("k", np.arange(3)).version
    new = store.put_array("k", np.arange(5), overwrite=True).version
    assert old != new
    assert os.listdir(root / "objects") == [new]
    assert _files_under(root / "tmp") == []


def test_overwrite_seen_by_another_store_instance(store: Store, root: Path) -> None:
    other = Store(root)
    store.put_array("k", np.arange(3))
    np.testing.assert_array_equal(other.open_array("k"), np.arange(3))
    store.put_array("k", np.arange(10, 14), overwrite=True)
    np.testing.assert_array_equal(other.open_array("k"), np.arange(10, 14))
    store.evict("k")
    with pytest.raises(shmcache.KeyNotFoundError):
        other.open_array("k")
