"""Arrays from shmcache pickle by reference (key + root + version), never by value.

A Dataset holding a shared array must reach ``spawn``/``forkserver`` workers in a few
hundred bytes and re-attach there to the same physical pages (DESIGN.md, "Public
Python API"). Plain arrays must keep pickling exactly as numpy pickles them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest

import shmcache
from shmcache._disk.mapped import MappedFile

REFERENCE_LIMIT = 1024
"""A pickled reference must stay under 1 KiB, whatever the array's size."""

BIG_SHAPE = (8192, 1024)  # float64: 64 MiB
FORTRAN_SHAPE = (2048, 1024)  # float64: 16 MiB
MEMORY_CHECK_MIN_BYTES = 16 << 20
"""Views at least this big are also checked for copies by memory accounting."""

View = Callable[[np.ndarray], np.ndarray]

VIEWS: dict[str, tuple[str, View]] = {
    "whole": ("big", lambda a: a),
    "row": ("big", lambda a: a[4321]),
    "column": ("big", lambda a: a[:, 7]),
    "strided": ("big", lambda a: a[1::3, ::5]),
    "negative": ("big", lambda a: a[::-1, ::-2]),
    "negative-offset": ("big", lambda a: a[5000:100:-7, 900:3:-3]),
    "transposed": ("big", lambda a: a.T),
    "fortran": ("fortran", lambda a: a),
    "fortran-slice": ("fortran", lambda a: a[10:-10:2, ::-1]),
}


def _source(name: str) -> np.ndarray:
    """The data each entry is made of (deterministic, so a child can check it)."""
    if name == "big":
        return np.arange(np.prod(BIG_SHAPE), dtype=np.float64).reshape(BIG_SHAPE)
    data = np.arange(np.prod(FORTRAN_SHAPE), dtype=np.float64).reshape(FORTRAN_SHAPE) * 0.5 - 7
    return np.asfortranarray(data)


@pytest.fixture(scope="module")
def sources() -> dict[str, np.ndarray]:
    return {name: _source(name) for name in ("big", "fortran")}


@pytest.fixture
def shared(store: shmcache.Store, sources: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Both entries published in ``store`` and opened (which installs the reducer)."""
    for key, data in sources.items():
        store.put_array(key, data)
    return {key: store.open_array(key) for key in sources}


def _base_chain(array: np.ndarray) -> list[Any]:
    chain: list[Any] = []
    base: Any = array.base
    while base is not None:
        chain.append(base)
        base = getattr(base, "base", None)
    return chain


def _ends_in_shared_mapping(array: np.ndarray) -> bool:
    chain = _base_chain(array)
    return bool(chain) and isinstance(chain[-1], MappedFile)


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _assert_same_array(got: Any, want: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _assert_read_only(array: np.ndarray) -> None:
    # numpy refuses writes; setflags(write=True) is allowed (the mapping is copy-on-write:
    # such writes stay in this process, tests/test_torch_writes.py)
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array.flat[0] = 1


# ---------------------------------------------------------------------- same process


@pytest.mark.parametrize("view_name", list(VIEWS))
def test_pickled_view_is_a_small_reference(
    view_name: str, shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    entry, view = VIEWS[view_name]
    array = view(shared[entry])
    assert array.nbytes > REFERENCE_LIMIT
    payload = pickle.dumps(array)
    assert len(payload) < REFERENCE_LIMIT, f"{view_name}: {len(payload)} bytes pickled"

    loaded = pickle.loads(payload)
    _assert_same_array(loaded, view(sources[entry]))
    assert loaded.strides == array.strides
    assert loaded.flags.c_contiguous == array.flags.c_contiguous
    assert loaded.flags.f_contiguous == array.flags.f_contiguous
    _assert_read_only(loaded)
    assert _ends_in_shared_mapping(loaded)


def test_fortran_entry_stays_fortran_order(shared: dict[str, np.ndarray]) -> None:
    array = shared["fortran"]
    assert array.flags.f_contiguous and not array.flags.c_contiguous
    loaded = pickle.loads(pickle.dumps(array))
    assert loaded.flags.f_contiguous and not loaded.flags.c_contiguous


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_sends_a_reference(
    protocol: int, shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    for view_name in ("whole", "row", "negative-offset", "fortran-slice"):
        entry, view = VIEWS[view_name]
        payload = pickle.dumps(view(shared[entry]), protocol=protocol)
        assert len(payload) < REFERENCE_LIMIT
        loaded = pickle.loads(payload)
        _assert_same_array(loaded, view(sources[entry]))
        assert not loaded.flags.writeable


def test_forking_pickler_sends_a_reference(shared: dict[str, np.ndarray]) -> None:
    """multiprocessing (and so DataLoader with spawn/forkserver) pickles with ForkingPickler."""
    payload = bytes(ForkingPickler.dumps(shared["big"][::2]))
    assert len(payload) < REFERENCE_LIMIT
    _assert_same_array(pickle.loads(payload), shared["big"][::2])


def test_unpickled_arrays_pickle_by_reference_again(shared: dict[str, np.ndarray]) -> None:
    once = pickle.loads(pickle.dumps(shared["big"][::-3]))
    payload = pickle.dumps(once[1:, 5])
    assert len(payload) < REFERENCE_LIMIT
    _assert_same_array(pickle.loads(payload), shared["big"][::-3][1:, 5])


def test_unpickled_arrays_share_one_mapping(shared: dict[str, np.ndarray]) -> None:
    first = pickle.loads(pickle.dumps(shared["big"][1]))
    second = pickle.loads(pickle.dumps(shared["big"][::-1]))
    assert _base_chain(first)[-1] is _base_chain(second)[-1]


def test_empty_view_pickles(shared: dict[str, np.ndarray]) -> None:
    empty = shared["big"][5:5]
    loaded = pickle.loads(pickle.dumps(empty))
    assert loaded.shape == (0, BIG_SHAPE[1])
    assert loaded.dtype == np.float64


def test_module_level_open_array_pickles_by_reference(
    shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    """``shmcache.open_array`` with the default root (SHMCACHE_ROOT, set by the fixture)."""
    array = shmcache.open_array("big")
    payload = pickle.dumps(array[100:200])
    assert len(payload) < REFERENCE_LIMIT
    _assert_same_array(pickle.loads(payload), sources["big"][100:200])


# ---------------------------------------------------------------------- plain arrays


def test_plain_arrays_still_pickle_by_value(shared: dict[str, np.ndarray]) -> None:
    plain = np.arange(100_000, dtype=np.int64)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        payload = pickle.dumps(plain, protocol=protocol)
        assert len(payload) >= plain.nbytes
        loaded = pickle.loads(payload)
        _assert_same_array(loaded, plain)
        assert loaded.flags.writeable
        loaded[0] = -1
        assert plain[0] == 0


def test_private_copies_of_shared_arrays_pickle_by_value(shared: dict[str, np.ndarray]) -> None:
    for private in (shared["big"][3].copy(), np.array(shared["big"][:4]), shared["big"][7] * 2):
        assert not _ends_in_shared_mapping(private)
        payload = pickle.dumps(private)
        assert len(payload) >= private.nbytes
        loaded = pickle.loads(payload)
        _assert_same_array(loaded, private)
        assert loaded.flags.writeable


@pytest.mark.xfail(
    strict=True,
    reason="known limitation (README, 'In a Dataset'): a copyreg reducer is not told the "
    "protocol, so once a process has attached an entry, plain arrays pickle in-band even "
    "under protocol 5 with a buffer_callback",
)
def test_plain_arrays_keep_out_of_band_buffers(shared: dict[str, np.ndarray]) -> None:
    plain = np.arange(100_000, dtype=np.int64)
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(plain, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    assert len(payload) < REFERENCE_LIMIT
    _assert_same_array(pickle.loads(payload, buffers=buffers), plain)


# ---------------------------------------------------------------------- copies


def test_deepcopy_gives_a_private_writable_copy(shared: dict[str, np.ndarray]) -> None:
    array = shared["big"]
    for copied in (copy.deepcopy(array), copy.copy(array), copy.deepcopy(array[::-2])):
        assert type(copied) is np.ndarray
        assert copied.flags.writeable
        assert not _ends_in_shared_mapping(copied)
        copied[0] = -1.0
    assert array[0, 0] == 0.0
    np.testing.assert_array_equal(copy.deepcopy(array[::-2]), array[::-2])


# ---------------------------------------------------------------------- datasets


class ArrayDataset:
    """What a user's torch Dataset typically holds: shared arrays and a little config."""

    def __init__(self, features_key: str, labels_key: str) -> None:
        self.features = shmcache.open_array(features_key)
        self.labels = shmcache.open_array(labels_key)
        self.transform_scale = 2.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.features[index] * self.transform_scale, int(self.labels[index])


def test_dataset_holding_arrays_pickles_small(
    shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    shmcache.put_array("labels", np.arange(BIG_SHAPE[0], dtype=np.int32) % 10)
    dataset = ArrayDataset("big", "labels")
    payload = pickle.dumps(dataset)
    assert len(payload) < REFERENCE_LIMIT, f"{len(payload)} bytes pickled"

    loaded = pickle.loads(payload)
    assert len(loaded) == BIG_SHAPE[0]
    features, label = loaded[1234]
    np.testing.assert_array_equal(features, sources["big"][1234] * 2.0)
    assert label == 1234 % 10
    assert _ends_in_shared_mapping(loaded.features)


# ---------------------------------------------------------------------- eviction


@pytest.mark.parametrize("how", ["evict", "overwrite"])
def test_unpickling_a_removed_version_raises_key_not_found(
    how: str, store: shmcache.Store, shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    array = shared["big"]
    version = store.info("big").version
    if how == "evict":
        store.evict("big")
    else:
        store.put_array("big", np.zeros(3), overwrite=True)
    assert not (store.root / "objects" / version).exists()
    payload = pickle.dumps(array[10])  # still a reference: pickling needs no file
    assert len(payload) < REFERENCE_LIMIT

    with pytest.raises(shmcache.KeyNotFoundError) as caught:
        pickle.loads(payload)
    assert isinstance(caught.value, KeyError)
    message = str(caught.value)
    assert "'big'" in message and version in message
    assert "evicted" in message and "open the key again" in message

    child = _run_child(payload, "load")
    assert child["error_type"] == "KeyNotFoundError"
    assert child["error"] == message

    # This process mapped the old version before it went: it keeps reading it.
    np.testing.assert_array_equal(array[10], sources["big"][10])


# ---------------------------------------------------------------------- other process

_CHILD = textwrap.dedent(
    """
    import hashlib, json, pickle, sys
    import numpy as np
    import shmcache
    from shmcache._disk.mapped import MappedFile

    def status(field):
        with open("/proc/self/status") as fp:
            for line in fp:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise LookupError(field)

    payload = sys.stdin.buffer.read()
    if sys.argv[1] == "load":
        try:
            pickle.loads(payload)
        except Exception as exc:
            print(json.dumps({"error_type": type(exc).__name__, "error": str(exc)}))
        else:
            print(json.dumps({"error_type": None}))
        raise SystemExit

    anon0, shmem0 = status("RssAnon"), status("RssShmem")
    array = pickle.loads(payload)
    array.sum()  # reads every element (and so every page the view covers)
    anon1, shmem1 = status("RssAnon"), status("RssShmem")

    chain, base = [], array.base
    while base is not None:
        chain.append(base)
        base = getattr(base, "base", None)
    mapping = chain[-1]
    root, version, filename, _key = mapping.origin
    with open("/proc/self/maps") as fp:
        mapped = f"{root}/objects/{version}/{filename}" in fp.read()
    print(json.dumps({
        "type": type(array).__module__ + "." + type(array).__qualname__,
        "base_types": [type(b).__qualname__ for b in chain],
        "ends_in_shared_mapping": isinstance(mapping, MappedFile),
        "mapped": mapped,
        "writeable": bool(array.flags.writeable),
        "shape": list(array.shape),
        "strides": list(array.strides),
        "dtype": array.dtype.str,
        "anon_growth": anon1 - anon0,
        "shmem_growth": shmem1 - shmem0,
        "digest": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
        "repickled": pickle.dumps(array[1:][::-1]).hex(),
    }))
    """
)


def _run_child(payload: bytes, mode: str) -> dict[str, Any]:
    """Unpickle ``payload`` in a fresh interpreter and report what it got."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        input=payload,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("view_name", list(VIEWS))
def test_unpickling_in_another_process_maps_instead_of_copying(
    view_name: str, shared: dict[str, np.ndarray], sources: dict[str, np.ndarray]
) -> None:
    entry, view = VIEWS[view_name]
    array = view(shared[entry])
    array.sum()  # this process maps the pages too, as the owner of a Dataset would
    want = view(sources[entry])

    child = _run_child(pickle.dumps(array), "view")

    assert child["type"] == "numpy.ndarray"
    assert child["ends_in_shared_mapping"], child["base_types"]
    assert child["mapped"], "the entry's data file is not in the child's /proc/self/maps"
    assert not child["writeable"]
    assert tuple(child["shape"]) == want.shape
    assert tuple(child["strides"]) == array.strides
    assert child["dtype"] == want.dtype.str
    assert child["digest"] == _digest(want)
    if want.nbytes >= MEMORY_CHECK_MIN_BYTES:
        # A copy would be anonymous memory; a shared mapping of tmpfs is RssShmem.
        assert child["anon_growth"] < want.nbytes // 8, child
        assert child["shmem_growth"] >= want.nbytes // 2, child

    repickled = bytes.fromhex(child["repickled"])
    assert len(repickled) < REFERENCE_LIMIT
    _assert_same_array(pickle.loads(repickled), want[1:][::-1])
