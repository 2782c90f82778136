"""put_file: .npy, .npz and directories of them; damaged sources publish nothing."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from source_times import age

from shmcache import (
    CorruptSourceError,
    InvalidKeyError,
    InvalidSourceError,
    KeyExistsError,
    SourceNotFoundError,
    Store,
    UnsupportedDataError,
)


def _assert_nothing_published(store: Store, root: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub


def _save_npz(path: Path, compressed: bool, **arrays: np.ndarray) -> None:
    save = np.savez_compressed if compressed else np.savez
    save(path, **arrays)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- good sources


def test_npy_file(store: Store, tmp_path: Path) -> None:
    data = np.arange(1000, dtype=np.float32).reshape(10, 100)
    source = tmp_path / "feats.npy"
    np.save(source, data)
    age(source)  # else racily clean (source_files.RACY_NS): its fingerprint says so
    assert store.put_file("feats", source) == ["feats"]
    result = store.open_array("feats")
    np.testing.assert_array_equal(result, data)
    assert result.dtype == data.dtype and not result.flags.writeable
    (info,) = store.list()
    assert info.source == str(source)
    st = source.stat()
    assert info.source_fingerprint == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    assert info.nbytes == data.nbytes and info.shape == data.shape


def test_fortran_npy_file(store: Store, tmp_path: Path) -> None:
    data = np.asfortranarray(np.arange(12).reshape(3, 4))
    np.save(tmp_path / "f.npy", data)
    store.put_file("f", tmp_path / "f.npy")
    result = store.open_array("f")
    np.testing.assert_array_equal(result, data)
    assert result.flags.f_contiguous and not result.flags.c_contiguous


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_npz_file(store: Store, tmp_path: Path, compressed: bool) -> None:
    arrays = {
        "labels": np.arange(50, dtype=np.int64),
        "boxes": np.random.default_rng(0).random((20, 4)),
        "names": np.array(["a", "bb", "ccc"]),
        "empty": np.zeros((0, 3)),
    }
    source = tmp_path / "data.npz"
    _save_npz(source, compressed, **arrays)
    keys = store.put_file("ds", source)
    assert sorted(keys) == sorted(f"ds/{name}" for name in arrays)
    for name, expected in arrays.items():
        result = store.open_array(f"ds/{name}")
        np.testing.assert_array_equal(result, expected)
        assert result.dtype == expected.dtype
    infos = store.list("ds")
    assert [e.key for e in infos] == sorted(keys)
    assert all(e.source is not None and str(source) in e.source for e in infos)


def test_directory_of_npy_and_npz(store: Store, tmp_path: Path) -> None:
    top = tmp_path / "dataset"
    (top / "sub" / "deeper").mkdir(parents=True)
    np.save(top / "x.npy", np.arange(3))
    np.save(top / "sub" / "y.v2.npy", np.arange(4.0))
    np.savez(top / "sub" / "deeper" / "z.npz", m=np.ones(2), n=np.zeros(1))
    np.savez_compressed(top / "c.npz", q=np.arange(5))
    (top / "README.txt").write_text("ignored")
    with pytest.raises(InvalidSourceError, match="--as arrays") as mixed:  # auto: arrays or blobs?
        store.put_file("ds", top)
    assert str(top) in str(mixed.value) and store.list() == []
    keys = store.put_file("ds", top, as_="arrays")
    expected = {
        "ds/x": np.arange(3),
        "ds/sub/y.v2": np.arange(4.0),
        "ds/sub/deeper/z/m": np.ones(2),
        "ds/sub/deeper/z/n": np.zeros(1),
        "ds/c/q": np.arange(5),
    }
    assert sorted(keys) == sorted(expected)
    assert [e.key for e in store.list()] == sorted(expected)
    for key, data in expected.items():
        np.testing.assert_array_equal(store.open_array(key), data)
    sources = {e.key: e.source for e in store.list()}
    assert sources["ds/x"] == str(top / "x.npy")
    assert str(top / "sub" / "deeper" / "z.npz") in str(sources["ds/sub/deeper/z/m"])


def test_put_file_overwrite(store: Store, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(3))
    np.save(tmp_path / "b.npy", np.arange(7))
    store.put_file("k", tmp_path / "a.npy")
    with pytest.raises(KeyExistsError):
        store.put_file("k", tmp_path / "b.npy")
    np.testing.assert_array_equal(store.open_array("k"), np.arange(3))
    store.put_file("k", tmp_path / "b.npy", overwrite=True)
    np.testing.assert_array_equal(store.open_array("k"), np.arange(7))
    assert store.list()[0].source == str(tmp_path / "b.npy")


def test_directory_with_one_existing_key_publishes_nothing(store: Store, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(3))
    np.save(tmp_path / "b.npy", np.arange(4))
    store.put_array("ds/b", np.arange(9))
    with pytest.raises(KeyExistsError):
        store.put_file("ds", tmp_path)
    assert [e.key for e in store.list()] == ["ds/b"]
    np.testing.assert_array_equal(store.open_array("ds/b"), np.arange(9))


# ---------------------------------------------------------------------- bad sources


def _truncated(path: Path) -> None:
    np.save(path, np.arange(1000, dtype=np.float64))
    os.truncate(path, path.stat().st_size - 100)


def _npy_bytes(header: bytes, payload: bytes = bytes(64)) -> bytes:
    """A version 1.0 ``.npy`` with an arbitrary header text, padded as numpy pads it."""
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + payload


def _npy_with_header(path: Path, header: bytes, payload: bytes = bytes(64)) -> None:
    path.write_bytes(_npy_bytes(header, payload))


def _garbage_header(path: Path) -> None:
    _npy_with_header(path, b"{'descr': <garbage>!!, 'shape': (3,), 'fortran_order': False}")


def _negative_shape(path: Path) -> None:
    _npy_with_header(path, b"{'descr': '<i8', 'shape': (-3,), 'fortran_order': False}")


# No element, so no byte: numpy itself refuses to make an array of such a shape.
_BEYOND_INTP = f"{{'descr': '<i8', 'shape': (0, {10**30}), 'fortran_order': False}}".encode()
_BYTES_BEYOND_INTP = f"{{'descr': '<i8', 'shape': (0, {2**62}, 4), 'fortran_order': False}}".encode()


def _empty_shape_beyond_intp(path: Path) -> None:
    _npy_with_header(path, _BEYOND_INTP, b"")


def _empty_shape_bytes_beyond_intp(path: Path) -> None:
    _npy_with_header(path, _BYTES_BEYOND_INTP, b"")


def _npz_with_empty_shape_beyond_intp(path: Path) -> None:
    np.savez(path, good=np.arange(3))
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("bad.npy", _npy_bytes(_BEYOND_INTP, b""))


def _bad_descr(path: Path) -> None:
    _npy_with_header(path, b"{'descr': 'zz9', 'shape': (3,), 'fortran_order': False}")


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(256))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _header_only(path: Path) -> None:
    np.save(path, np.arange(10))
    os.truncate(path, 20)


def _pickled_objects(path: Path) -> None:
    np.save(path, np.array([1, "a", None], dtype=object), allow_pickle=True)


def _not_npy(path: Path) -> None:
    path.write_text("hello")


def _corrupt_npz(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + os.urandom(200))


def _truncated_npz(path: Path) -> None:
    np.savez(path, a=np.arange(1000))
    os.truncate(path, path.stat().st_size // 2)


def _npz_with_objects(path: Path) -> None:
    np.savez(path, good=np.arange(3), bad=np.array([{}], dtype=object))


BAD_SOURCES: dict[str, tuple[str, Callable[[Path], None], type[Exception]]] = {
    "truncated-npy": ("a.npy", _truncated, CorruptSourceError),
    "header-only-npy": ("a.npy", _header_only, CorruptSourceError),
    "garbage-header-npy": ("a.npy", _garbage_header, CorruptSourceError),
    "negative-shape-npy": ("a.npy", _negative_shape, CorruptSourceError),
    "empty-shape-beyond-intp-npy": ("a.npy", _empty_shape_beyond_intp, CorruptSourceError),
    "empty-shape-bytes-beyond-intp-npy": ("a.npy", _empty_shape_bytes_beyond_intp, CorruptSourceError),
    "bad-descr-npy": ("a.npy", _bad_descr, CorruptSourceError),
    "garbage-npy": ("a.npy", _garbage, CorruptSourceError),
    "empty-npy": ("a.npy", _empty, CorruptSourceError),
    "pickled-object-npy": ("a.npy", _pickled_objects, UnsupportedDataError),
    "not-npy": ("a.txt", _not_npy, CorruptSourceError),
    "corrupt-npz": ("a.npz", _corrupt_npz, CorruptSourceError),
    "truncated-npz": ("a.npz", _truncated_npz, CorruptSourceError),
    "empty-shape-beyond-intp-npz": ("a.npz", _npz_with_empty_shape_beyond_intp, CorruptSourceError),
    "object-member-npz": ("a.npz", _npz_with_objects, UnsupportedDataError),
}
BUILTIN: dict[type[Exception], type[Exception]] = {
    CorruptSourceError: ValueError,
    UnsupportedDataError: TypeError,
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_file(store: Store, root: Path, tmp_path: Path, case: str) -> None:
    name, make, error = BAD_SOURCES[case]
    source = tmp_path / name
    make(source)
    with pytest.raises(error) as info:
        store.put_file("k", source)
    assert isinstance(info.value, BUILTIN[error])
    assert str(source) in str(info.value)
    _assert_nothing_published(store, root)


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_directory_with_one_bad_file_publishes_nothing(
    store: Store, root: Path, tmp_path: Path, case: str
) -> None:
    name, make, error = BAD_SOURCES[case]
    top = tmp_path / "ds"
    (top / "sub").mkdir(parents=True)
    np.save(top / "a0.npy", np.arange(100))
    np.savez_compressed(top / "b.npz", m=np.arange(10))
    bad = top / "sub" / name.replace("a.", "bad.")
    make(bad)
    np.save(top / "sub" / "z.npy", np.arange(5))
    if bad.suffix not in (".npy", ".npz"):  # skipped with --as arrays; auto asks which
        with pytest.raises(InvalidSourceError, match="--as arrays"):
            store.put_file("ds", top)
        assert sorted(store.put_file("ds", top, as_="arrays")) == ["ds/a0", "ds/b/m", "ds/sub/z"]
        return
    with pytest.raises(error) as info:
        store.put_file("ds", top)
    assert str(bad) in str(info.value)
    _assert_nothing_published(store, root)


def test_missing_source(store: Store, root: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.npy"
    with pytest.raises(SourceNotFoundError) as info:
        store.put_file("k", missing)
    assert isinstance(info.value, FileNotFoundError)
    assert str(missing) in str(info.value)
    _assert_nothing_published(store, root)


def test_directory_without_arrays(store: Store, root: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InvalidSourceError) as info:
        store.put_file("k", tmp_path, as_="arrays")
    assert str(tmp_path) in str(info.value) and "holds no .h5, .hdf5, .npy, .npz" in str(info.value)
    _assert_nothing_published(store, root)
    assert store.put_file("k", tmp_path) == ["k"]  # auto: a blobs entry
    assert bytes(store.open_blobs("k")["notes.txt"]) == b"x"


def test_directory_file_name_that_is_no_key(store: Store, root: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "fine.npy", np.arange(2))
    np.save(tmp_path / "bad name.npy", np.arange(2))
    with pytest.raises(InvalidKeyError) as info:
        store.put_file("k", tmp_path)
    assert "bad name.npy" in str(info.value)
    _assert_nothing_published(store, root)


def _deflate_offset(path: Path, member: str) -> int:
    """Offset of a zip member's compressed bytes."""
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        start = archive.getinfo(member).header_offset
    name_len = int.from_bytes(raw[start + 26 : start + 28], "little")
    extra_len = int.from_bytes(raw[start + 28 : start + 30], "little")
    return start + 30 + name_len + extra_len


def test_npz_with_corrupt_deflate_stream_at_start(store: Store, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "c.npz"
    np.savez_compressed(source, a=np.arange(100_000) % 7)
    raw = bytearray(source.read_bytes())
    raw[_deflate_offset(source, "a.npy")] = 0x06  # a deflate block of the reserved type 3
    source.write_bytes(bytes(raw))
    with pytest.raises(CorruptSourceError) as info:
        store.put_file("k", source)
    assert str(source) in str(info.value)
    _assert_nothing_published(store, root)


def test_npz_with_corrupt_deflate_payload(store: Store, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "c.npz"
    np.savez_compressed(source, a=np.random.default_rng(1).integers(0, 4, 400_000, dtype=np.uint8))
    good = source.read_bytes()
    start = _deflate_offset(source, "a.npy") + 2048
    for seed in range(20):  # some damage fails the CRC check, some the inflater itself
        raw = bytearray(good)
        where = start + seed * (len(raw) - start - 4096) // 20
        raw[where : where + 16] = np.random.default_rng(seed).integers(0, 256, 16, dtype=np.uint8).tobytes()
        source.write_bytes(bytes(raw))
        with pytest.raises(CorruptSourceError) as info:
            store.put_file("k", source)
        assert str(source) in str(info.value)
        _assert_nothing_published(store, root)


def test_npy_header_with_unbalanced_brackets(store: Store, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "a.npy"
    _npy_with_header(source, b"{'descr': '<i8', 'shape': (3,), 'fortran_order': False")
    with pytest.raises(CorruptSourceError) as info:
        store.put_file("k", source)
    assert str(source) in str(info.value)
    _assert_nothing_published(store, root)


def test_directory_failing_while_copying_publishes_nothing(store: Store, root: Path, tmp_path: Path) -> None:
    """Damage that only shows at the end of inflating (a CRC mismatch), after other files were copied."""
    np.save(tmp_path / "a.npy", np.arange(100_000))
    bad = tmp_path / "z.npz"
    np.savez_compressed(bad, m=np.arange(100_000) % 7)
    with zipfile.ZipFile(bad) as archive:
        crc = archive.getinfo("m.npy").CRC.to_bytes(4, "little")
    raw = bad.read_bytes()
    assert raw.count(crc) == 2  # local header and central directory
    bad.write_bytes(raw.replace(crc, bytes(a ^ 0xFF for a in crc)))
    with pytest.raises(CorruptSourceError) as info:
        store.put_file("ds", tmp_path)
    assert str(bad) in str(info.value)
    _assert_nothing_published(store, root)
    assert store.put_file("ds", tmp_path / "a.npy") == ["ds"]  # the store is still usable


def test_npz_member_name_that_is_no_key(store: Store, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "m.npz"
    np.savez(source, **{"fine": np.arange(2), "not fine": np.arange(1)})  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError) as info:
        store.put_file("k", source)
    assert str(source) in str(info.value)
    _assert_nothing_published(store, root)


def test_npz_member_names_with_slashes_become_key_segments(store: Store, tmp_path: Path) -> None:
    source = tmp_path / "m.npz"
    np.savez(source, **{"a/b": np.arange(2)})  # type: ignore[arg-type]
    assert store.put_file("k", source) == ["k/a/b"]
    np.testing.assert_array_equal(store.open_array("k/a/b"), np.arange(2))


@pytest.mark.parametrize("kind", ["empty-npz", "zip-of-text"])
def test_npz_without_arrays_is_refused(store: Store, root: Path, tmp_path: Path, kind: str) -> None:
    source = tmp_path / "x.npz"
    if kind == "empty-npz":
        np.savez(source)
    else:
        with zipfile.ZipFile(source, "w") as archive:
            archive.writestr("readme.txt", "no arrays here")
    with pytest.raises(InvalidSourceError) as info:
        store.put_file("k", source)
    assert str(source) in str(info.value)
    _assert_nothing_published(store, root)


def test_directory_where_two_files_become_one_key(store: Store, root: Path, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "sub" / "m.npy", np.arange(2))
    np.savez(tmp_path / "sub.npz", m=np.arange(3))
    with pytest.raises(InvalidSourceError) as info:
        store.put_file("k", tmp_path)
    assert "k/sub/m" in str(info.value)
    assert str(tmp_path / "sub" / "m.npy") in str(info.value)
    _assert_nothing_published(store, root)
