"""A directory put's planning (issue 22 item 1): one walk of the directory decides its kind
and lists its array files, in the order ``sorted(rglob)`` gives; every file still gets
its header checked (a header seen before is recognised by its bytes, any other is parsed
by the fast path or numpy's own parser), the keys are checked all at once but a bad name
still raises naming its file; and the batch-wide helpers of the publish (common prefix,
generation slots) give what the per-key definitions give."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcache import Store
from shmcache._disk.entry_tree import common_prefix
from shmcache._disk.generations import key_generation_slots
from shmcache._disk.layout import generation_slot
from shmcache._sources import files
from shmcache._sources.dispatch import classify_source
from shmcache.errors import CorruptSourceError, InvalidKeyError, InvalidSourceError, UnsupportedDataError


def _nothing_published(store: Store, root: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub


def _save_as(path: Path, array: np.ndarray) -> None:
    """``np.save`` under exactly this name (``np.save`` adds ``.npy`` to ``x.NPY``)."""
    with open(path, "wb") as fp:
        np.save(fp, array)


def _good_folder(path: Path, count: int) -> Path:
    path.mkdir()
    for i in range(count):
        np.save(path / f"f{i:04d}.npy", np.full((2, 3), i, np.float32))
    return path


def test_a_corrupt_header_among_1000_good_files_names_it_and_publishes_nothing(
    store: Store, root: Path, tmp_path: Path
) -> None:
    folder = _good_folder(tmp_path / "d", 1000)
    whole = bytearray((folder / "f0500.npy").read_bytes())
    whole[20:26] = b"!!!!!!"  # inside the header's dict
    (folder / "f0500.npy").write_bytes(bytes(whole))
    with pytest.raises(CorruptSourceError, match=r"f0500\.npy"):
        store.put_file("d", folder)
    _nothing_published(store, root)


def test_a_pickled_array_among_good_files_is_refused(store: Store, root: Path, tmp_path: Path) -> None:
    folder = _good_folder(tmp_path / "d", 50)
    np.save(folder / "f0025.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(UnsupportedDataError, match=r"f0025\.npy"):
        store.put_file("d", folder)
    _nothing_published(store, root)


def test_a_file_shorter_than_a_header_seen_before_says_so(store: Store, root: Path, tmp_path: Path) -> None:
    """Its header bytes are those of the other files (known): its own size is still checked."""
    folder = _good_folder(tmp_path / "d", 20)
    whole = (folder / "f0000.npy").read_bytes()
    (folder / "f0019.npy").write_bytes(whole[:-1])
    with pytest.raises(CorruptSourceError, match=r"f0019\.npy: truncated"):
        store.put_file("d", folder)
    _nothing_published(store, root)


HEADER_VARIANTS = {
    "format-2.0": lambda a, path: _save_version(path, a, (2, 0)),
    "fortran-order": lambda a, path: np.save(path, np.asfortranarray(a.reshape(6, 4))),
    "big-endian": lambda a, path: np.save(path, a.astype(">f8")),
    "zero-d": lambda a, path: np.save(path, np.float64(a[0])),
    "structured": lambda a, path: np.save(path, np.zeros(3, dtype=[("x", "<i4"), ("y", ">f2", (2,))])),
    "empty": lambda a, path: np.save(path, np.zeros((0, 5), np.int16)),
    "bool": lambda a, path: np.save(path, a > 10),
}


def _save_version(path: Path, array: np.ndarray, version: tuple[int, int]) -> None:
    with open(path, "wb") as fp:
        np.lib.format.write_array(fp, array, version=version)


def test_header_variants_in_one_directory_read_back_bit_for_bit(store: Store, tmp_path: Path) -> None:
    """Headers other than the common one: format 2.0, Fortran order, big-endian, 0-d, structured,
    empty, bool; each (twice: the second is recognised by its bytes) published as ``np.load``
    reads it."""
    folder = tmp_path / "d"
    folder.mkdir()
    base = np.arange(24, dtype=np.float64)
    for name, save in HEADER_VARIANTS.items():
        for copy in ("a", "b"):
            save(base, folder / f"{name}-{copy}.npy")
    keys = store.put_file("v", folder)
    assert sorted(keys) == sorted(f"v/{name}-{c}" for name in HEADER_VARIANTS for c in ("a", "b"))
    for key in keys:
        expected = np.load(folder / f"{key[2:]}.npy")
        got = store.open_array(key)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.flags.f_contiguous == expected.flags.f_contiguous
        assert np.asarray(got).tobytes("A") == expected.tobytes("A")


def test_a_format_3_header_is_refused_by_the_full_parser(store: Store, root: Path, tmp_path: Path) -> None:
    folder = _good_folder(tmp_path / "d", 5)
    with open(folder / "u.npy", "wb") as fp:
        np.lib.format.write_array(fp, np.zeros(2, dtype=[("é", "<i4")]), version=(3, 0))
    with pytest.raises(CorruptSourceError, match=r"u\.npy: not a valid \.npy file \(\.npy format version 3"):
        store.put_file("d", folder)
    _nothing_published(store, root)


def test_odd_but_valid_names_and_nesting_keep_the_order_of_sorted_rglob(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "d"
    names = [
        "a.npy", "a/x.npy", "a-b.npy", "a.b/c.npy", "B.NPY", "x..npy", "..y.npy", "_-.npy",
        "deep/er/and/deeper/z.npy", "a/b/c.npy", "a/b.npy", "z9.Npy",
    ]
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        _save_as(folder / name, np.array([len(name)], np.int64))
    os.symlink(folder / "deep", folder / "link-to-dir")  # not entered
    os.symlink(folder / "a.npy", folder / "linked.npy")  # a link to a file: taken
    expected = sorted(p for p in folder.rglob("*") if p.suffix.lower() == ".npy" and p.is_file())
    expected = [p for p in expected if "link-to-dir" not in p.parts]
    assert files.array_files_under(folder) == expected
    keys = store.put_file("k", folder)
    assert keys == [f"k/{p.relative_to(folder).as_posix().rpartition('.')[0]}" for p in expected]
    assert int(store.open_array("k/x.")[0]) == len("x..npy")
    assert int(store.open_array("k/..y")[0]) == len("..y.npy")
    assert int(store.open_array("k/linked")[0]) == len("a.npy")
    assert int(store.open_array("k/B")[0]) == len("B.NPY")


@pytest.mark.parametrize(
    ("name", "error"),
    [("bad name.npy", InvalidKeyError), ("..npy", InvalidKeyError), ("x" * 190 + ".npy", InvalidKeyError)],
)
def test_a_name_that_makes_no_key_is_named_among_good_ones(
    store: Store, root: Path, tmp_path: Path, name: str, error: type[Exception]
) -> None:
    folder = _good_folder(tmp_path / "d", 30)
    _save_as(folder / name, np.zeros(1))
    with pytest.raises(error, match=rf"{name[:20]}.*does not make a valid key"):
        store.put_file("some/prefix", folder)
    _nothing_published(store, root)


def test_two_files_that_make_one_key_are_named(store: Store, root: Path, tmp_path: Path) -> None:
    folder = _good_folder(tmp_path / "d", 10)
    _save_as(folder / "f0003.NPY", np.zeros(1))  # f0003.npy exists: both make d/f0003
    with pytest.raises(InvalidSourceError, match=r"f0003\.NPY and .*f0003\.npy|f0003\.npy and .*f0003\.NPY"):
        store.put_file("d", folder)
    _nothing_published(store, root)


def test_one_walk_decides_the_kind_and_is_what_is_planned(tmp_path: Path) -> None:
    folder = _good_folder(tmp_path / "d", 3)
    source = classify_source(folder)
    assert source.kind == "arrays" and source.listing is not None
    assert [relative for relative, _ in source.listing.files] == ["f0000.npy", "f0001.npy", "f0002.npy"]
    os.mkfifo(folder / "pipe.npy")  # named like an array: the kind stays arrays, the plan skips it
    source = classify_source(folder)
    assert source.kind == "arrays" and source.listing is not None and source.listing.named == 4
    plan = files.plan_sources("d", folder, listing=source.listing)
    assert [item.key for item in plan] == ["d/f0000", "d/f0001", "d/f0002"]
    (folder / "readme.txt").write_text("x")
    with pytest.raises(InvalidSourceError, match="mixes array files and other files"):
        classify_source(folder)
    os.unlink(folder / "readme.txt")
    os.symlink(tmp_path, folder / "up")  # a link to a directory is no other file
    assert classify_source(folder).kind == "arrays"


def test_a_listing_of_another_directory_is_not_taken(tmp_path: Path) -> None:
    one, two = _good_folder(tmp_path / "one", 2), _good_folder(tmp_path / "two", 3)
    listing = classify_source(one).listing
    assert [item.source for item in files.plan_sources("k", two, listing=listing)] == [
        str(two / f"f000{i}.npy") for i in range(3)
    ]


_SEGMENT = st.text(alphabet="ab.-_", min_size=1, max_size=3).filter(lambda s: s not in (".", ".."))
_KEYS = st.lists(st.lists(_SEGMENT, min_size=1, max_size=4).map("/".join), min_size=1, max_size=12)


def _common_prefix_by_segments(keys: list[str]) -> str:
    """The definition: the longest run of parent segments that every key has."""
    common: list[str] | None = None
    for key in keys:
        parts = key.split("/")[:-1]
        if common is None:
            common = parts
            continue
        n = 0
        while n < len(common) and n < len(parts) and common[n] == parts[n]:
            n += 1
        del common[n:]
    return "/".join(common or [])


@settings(max_examples=400, deadline=None)
@given(_KEYS)
def test_common_prefix_is_the_segments_every_key_has(keys: list[str]) -> None:
    assert common_prefix(keys) == _common_prefix_by_segments(keys)
    assert common_prefix(iter(keys)) == _common_prefix_by_segments(keys)


def test_common_prefix_of_tricky_keys() -> None:
    assert common_prefix([]) == ""
    assert common_prefix(["a/b/c"]) == "a/b"
    assert common_prefix(["a/b", "a/b/c"]) == "a"
    assert common_prefix(["a/bc", "a/b/x"]) == "a"
    assert common_prefix(["d/f1", "d/f2"]) == "d"
    assert common_prefix(["x", "x/y"]) == ""
    assert common_prefix(["a-b/x", "a/b/x", "a.b/x"]) == ""


def test_the_batch_generation_slots_are_each_keys_slot() -> None:
    keys = [f"d/f{i:05d}" for i in range(5000)] + ["x", "a/b/c", "é-not-a-key-but-hashed"]
    assert key_generation_slots(keys) == {generation_slot(key) for key in keys}
