"""``put_file`` of array files from other tools: ``.safetensors``, torch ``.pt``/``.pth``
state dicts and HDF5. Round trips tensor by tensor against the library that wrote the file;
every kind of damage gives a typed error naming the file and the tensor or dataset, and
publishes nothing; a malicious pickle is refused without running anything."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, save
from service_helpers import Daemon, clean_env, unique

import shmcache
from shmcache import Store
from shmcache.errors import (
    CorruptSourceError,
    InvalidKeyError,
    SourceNotAllowedError,
    UnsupportedDataError,
)
from tests.source_times import age

safetensors_numpy = pytest.importorskip("safetensors.numpy")
torch = pytest.importorskip("torch")
h5py = pytest.importorskip("h5py")

NUMPY_DTYPES = [
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "complex64",
]


def _values(dtype: str, shape: tuple[int, ...] = (3, 5)) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "bool":
        values = rng.integers(0, 2, shape).astype(bool)
    elif dtype.startswith(("float", "complex")):
        values = (rng.standard_normal(shape) * 100).astype(dtype)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return np.asarray(values)


def _published(store: Store) -> list[str]:
    return [entry.key for entry in store.list()]


# ---------------------------------------------------------------- safetensors


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_safetensors_round_trip_per_dtype(store: Store, tmp_path: Path, dtype: str) -> None:
    tensors = {
        "layer.0.weight": _values(dtype),
        "bias": _values(dtype, (7,)),
        "scalar": _values(dtype, ()),
        "empty": _values(dtype, (0, 4)),
    }
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    keys = store.put_file("m", path)
    assert sorted(keys) == sorted(f"m/{name}" for name in tensors)
    group = shmcache.open_group("m", root=store.root)
    assert sorted(group) == sorted(tensors)
    for name, expected in tensors.items():
        got = group[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    assert store.info("m/bias").source == f"{path}[bias]"
    assert all(store.verify(key) for key in keys)  # checksums of the bytes written, built header included


def test_safetensors_dtypes_not_stored_are_refused_by_tensor_name(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"  # bfloat16 and float8 e4m3/e5m2 load (test_ml_dtypes.py); F8_E8M0 not
    header = {
        "fine": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "scale.e8": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [4, 6]},
    }
    path.write_bytes(_safetensors_bytes(header, bytes(6)))
    with pytest.raises(UnsupportedDataError, match=r"f4\.safetensors: tensor 'scale\.e8' has dtype F8_E8M0"):
        store.put_file("m", path)
    assert _published(store) == []


def _safetensors_bytes(header: object, payload: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + payload


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "shorter than its 8-byte header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header claims"),
        (_safetensors_bytes({}, length=4096), "truncated .safetensors file"),
        (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
        (_safetensors_bytes([1, 2]), "not a JSON object"),
        (
            _safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
            "tensor 'w' ends at byte",
        ),
        (
            _safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16),
            r"tensor 'w': data_offsets \[0, 12\] hold 12 bytes, but shape \(4,\) of F32 needs 16",
        ),
        (
            _safetensors_bytes({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
            r"tensor 'w': its shape \(-1,\) has a negative dimension",
        ),
        (
            _safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8),
            "tensor 'w': data_offsets",
        ),
        (
            _safetensors_bytes({"w": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "tensor 'w' has no dtype",
        ),
        (_safetensors_bytes({"w": 3}), "tensor 'w' is described by int"),
        (
            struct.pack("<Q", 103)
            + b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "a": {"dtype": "U8"}}'
            + b" " * 21,
            "a name appears twice",
        ),
    ],
)
def test_damaged_safetensors_is_refused_naming_file_and_tensor(
    store: Store, tmp_path: Path, content: bytes, message: str
) -> None:
    good = tmp_path / "good.safetensors"
    safetensors_numpy.save_file({"ok": np.arange(4.0)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(CorruptSourceError, match=message) as info:
        store.put_file("m", tmp_path)  # the good file beside it is not published either
    assert str(bad) in str(info.value)
    assert _published(store) == []


def test_truncated_safetensors_names_the_tensor_cut(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    safetensors_numpy.save_file({"a": np.zeros(100), "z": np.ones(100)}, str(path))
    with path.open("r+b") as fp:
        fp.truncate(path.stat().st_size - 8)
    with pytest.raises(
        CorruptSourceError, match=r"cut\.safetensors: tensor '[az]' ends at byte .* past the end"
    ):
        store.put_file("m", path)
    assert _published(store) == []


def test_tensor_name_that_is_no_key_is_refused_like_a_bad_relative_path(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file({"a b": np.zeros(2), "ok": np.ones(2)}, str(path))
    with pytest.raises(InvalidKeyError, match=r"m\.safetensors: tensor 'a b' does not make a valid key"):
        store.put_file("m", path)
    assert _published(store) == []


# ---------------------------------------------------------------- torch state dicts


def _state_dict() -> dict[str, object]:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return {
        **{f"dt.{dt}": torch.from_numpy(_values(dt)) for dt in NUMPY_DTYPES},  # uint16+: _rebuild_tensor_v3
        "transposed": base.t(),  # strided: gathered
        "sliced": base[2:5, 3:7],  # an offset into a shared storage, strided
        "row": base[4],  # an offset into the same storage, contiguous: kernel copy
        "every_other": torch.arange(20)[::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "nested": {"inner": {"deep": torch.full((3,), 7, dtype=torch.int16)}},
    }


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_torch_state_dict_round_trip(store: Store, tmp_path: Path, suffix: str) -> None:
    state = _state_dict()
    path = tmp_path / f"ckpt{suffix}"
    torch.save(state, path)
    keys = store.put_file("sd", path)
    reference = torch.load(path, weights_only=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(obj: dict[str, object], prefix: str) -> None:
        for name, value in obj.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}/")
            else:
                assert isinstance(value, torch.Tensor)
                flat[f"{prefix}{name}"] = value

    walk(reference, "")
    assert sorted(keys) == sorted(f"sd/{name}" for name in flat)
    group = shmcache.open_group("sd", root=store.root)
    for name, tensor in flat.items():
        expected = tensor.detach().numpy()
        got = group[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
        assert got.flags.c_contiguous
    assert all(store.verify(key) for key in keys)  # gathered tensors too


def test_model_state_dict_with_metadata(store: Store, tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    keys = store.put_file("net", path)
    assert sorted(keys) == sorted(f"net/{name}" for name in model.state_dict())  # _metadata is not a tensor
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(shmcache.open_array(f"net/{name}", root=store.root), tensor.numpy())


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz"])  # bfloat16, e4m3fn, e5m2 load
def test_torch_dtypes_not_stored_are_refused_by_tensor_name(
    store: Store, tmp_path: Path, dtype: str
) -> None:
    path = tmp_path / "low.pt"
    torch.save({"ok": torch.ones(2), "w": torch.ones(2, dtype=getattr(torch, dtype))}, path)
    with pytest.raises(
        UnsupportedDataError, match=rf"low\.pt: tensor 'w' is {dtype}, which shmcache does not store"
    ):
        store.put_file("m", path)
    assert _published(store) == []


def test_non_tensor_values_are_refused_naming_them(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 5}, path)
    with pytest.raises(UnsupportedDataError, match=r"ckpt\.pt: 'epoch' is int, not a tensor"):
        store.put_file("m", path)
    assert _published(store) == []


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running_anything(store: Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil(marker)}, path)
    assert b"system" in zipfile.ZipFile(path).read("evil/data.pkl")
    with pytest.raises(
        UnsupportedDataError, match=r"evil\.pt: refused to unpickle it \(it refers to (posix|os)\.system"
    ):
        store.put_file("m", path)
    with pytest.raises(UnsupportedDataError):
        store.plan_file("m", path)
    assert not marker.exists() and _published(store) == []


def test_pickle_without_torch_globals_is_refused(store: Store, tmp_path: Path) -> None:
    """A hand-made archive whose data.pkl builds a builtin through REDUCE."""
    path = tmp_path / "hand.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("hand/data.pkl", pickle.dumps({"w": io.BytesIO(b"x")}, protocol=2))
    with pytest.raises(UnsupportedDataError, match=r"refers to _io\.BytesIO"):
        store.put_file("m", path)


def _checkpoint(path: Path, pickled: bytes, storages: dict[str, bytes]) -> Path:
    """A zip checkpoint laid out as torch.save lays it out, with a hand-written pickle."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("x/data.pkl", pickled)
        archive.writestr("x/byteorder", "little")
        archive.writestr("x/version", "3\n")
        for key, data in storages.items():
            archive.writestr(f"x/data/{key}", data)
    return path


def _unicode(text: str) -> bytes:
    return b"X" + struct.pack("<I", len(text)) + text.encode()


# {"w": _rebuild_tensor_v2(<FloatStorage "0" of 4 elements>, 0, (4,), (1,), False, OrderedDict())}
_TENSOR = (
    b"ctorch._utils\n_rebuild_tensor_v2\n("
    + b"("
    + _unicode("storage")
    + b"ctorch\nFloatStorage\n"
    + _unicode("0")
    + _unicode("cpu")
    + b"K\x04tQ"
    + b"K\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR"
)


def test_hand_written_checkpoint_loads(store: Store, tmp_path: Path) -> None:
    """The opcodes the next tests tamper with, untampered: they make a valid checkpoint."""
    pickled = b"\x80\x02}" + _unicode("w") + _TENSOR + b"s."
    path = _checkpoint(tmp_path / "hand.pt", pickled, {"0": np.arange(4, dtype="<f4").tobytes()})
    assert torch.load(path, weights_only=True)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    store.put_file("h", path)
    np.testing.assert_array_equal(shmcache.open_array("h/w", root=store.root), np.arange(4, dtype="<f4"))


def test_pickle_cannot_alter_a_tensor_after_it_is_checked(store: Store, tmp_path: Path) -> None:
    """BUILD on a tensor (``{"offset": -100}``) would move it past its checks."""
    pickled = b"\x80\x02}" + _unicode("w") + _TENSOR + b"}" + _unicode("offset") + b"J\x9c\xff\xff\xffsbs."
    path = _checkpoint(tmp_path / "build.pt", pickled, {"0": bytes(16)})
    with pytest.raises(UnsupportedDataError, match=r"build\.pt: refused to unpickle it \(it sets the state"):
        store.put_file("m", path)


def test_dict_that_holds_itself_is_refused(store: Store, tmp_path: Path) -> None:
    loop: dict[str, object] = {}
    loop["again"] = loop
    path = _checkpoint(tmp_path / "loop.pt", pickle.dumps(loop, protocol=2), {})
    with pytest.raises(UnsupportedDataError, match=r"loop\.pt: 'again' is the very dict .* at the top"):
        store.put_file("m", path)


def test_legacy_torch_format_asks_to_save_again(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedDataError, match=r"old\.pt is in torch's legacy .* save it again"):
        store.put_file("m", path)


@pytest.mark.parametrize("cut", [100, 600])
def test_truncated_torch_checkpoint_is_corrupt(store: Store, tmp_path: Path, cut: int) -> None:
    path = tmp_path / "cut.pt"
    torch.save({"w": torch.arange(1000.0), "v": torch.arange(10)}, path)
    with path.open("r+b") as fp:
        fp.truncate(path.stat().st_size - cut)
    with pytest.raises(CorruptSourceError, match=r"cut\.pt"):
        store.put_file("m", path)
    assert _published(store) == []


def test_storage_smaller_than_the_view_is_corrupt(store: Store, tmp_path: Path) -> None:
    """A hand-edited pickle whose tensor reaches past its storage."""
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    pkl = members["bad/data.pkl"]
    members["bad/data.pkl"] = pkl.replace(b"K\x00K\n\x85", b"K\x00K\x14\x85", 1)  # offset 0, shape (20,)
    assert members["bad/data.pkl"] != pkl  # the shape (10,) is now (20,)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(CorruptSourceError, match=r"bad\.pt: tensor 'w': shape \(20,\).* past its storage"):
        store.put_file("m", path)


# ---------------------------------------------------------------- HDF5


def test_hdf5_round_trip(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "data.h5"
    compound = np.array(
        [(1, 2.5, b"ab"), (3, -1.0, b"xyz")], dtype=[("id", "<i4"), ("score", "<f8"), ("tag", "S3")]
    )
    expected = {
        **{f"dtypes/{dt}": _values(dt, (4, 3)) for dt in NUMPY_DTYPES},
        "chunked/gzip": np.arange(50_000, dtype=np.float32).reshape(500, 100),
        "chunked/lzf": np.arange(3000, dtype=np.int64).reshape(1000, 3),
        "compound": compound,
        "scalar": np.array(2.5),
        "bytes": np.array([b"one", b"three"]),
        "big_endian": np.arange(6, dtype=">i4"),
        "empty": np.zeros((0, 2)),
    }
    with h5py.File(path, "w") as h5:
        for name, value in expected.items():
            if name == "chunked/gzip":
                h5.create_dataset(name, data=value, chunks=(7, 100), compression="gzip", shuffle=True)
            elif name == "chunked/lzf":
                h5.create_dataset(name, data=value, chunks=(100, 3), compression="lzf")
            else:
                h5[name] = value
        h5["dtypes"].attrs["ignored"] = 1
    keys = store.put_file("h", path)
    assert sorted(keys) == sorted(f"h/{name}" for name in expected)
    group = shmcache.open_group("h", root=store.root)
    for name, value in expected.items():
        got = group[name]
        assert got.shape == value.shape and got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value, err_msg=name)
    assert store.info("h/chunked/gzip").source == f"{path}[chunked/gzip]"


def test_hdf5_variable_length_strings_become_a_strings_entry(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "names.h5"
    names = ["scene0000_00/frame-000001.jpg", "bêta", "", "x" * 10_000]
    with h5py.File(path, "w") as h5:
        h5.create_dataset("paths", data=names, dtype=h5py.string_dtype())
        h5.create_dataset("ascii", data=[b"a", b"bc"], dtype=h5py.string_dtype("ascii"))
        h5["ids"] = np.arange(4)
    planned = {entry.key: entry.size for entry in store.plan_file("d", path)}
    assert sorted(store.put_file("d", path)) == ["d/ascii", "d/ids", "d/paths"]
    group = shmcache.open_group("d", root=store.root)
    assert list(group["paths"]) == names and list(group["ascii"]) == ["a", "bc"]
    assert group["paths"].index("bêta") == 1
    info = store.info("d/paths")
    assert info.kind == "strings" and info.shape == (4,) and info.source == f"{path}[paths]"
    assert info.size == planned["d/paths"]  # what the plan reserved is what was written
    assert store.verify("d/paths")


def test_hdf5_large_dataset_in_many_slabs(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "big.hdf5"
    value = np.random.default_rng(1).standard_normal((5000, 1000)).astype(np.float32)  # 20 MB > one slab
    with h5py.File(path, "w") as h5:
        h5.create_dataset("x", data=value, chunks=(64, 1000), compression="gzip", compression_opts=1)
    store.put_file("big", path)
    np.testing.assert_array_equal(shmcache.open_array("big/x", root=store.root), value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda h5: h5.create_dataset("s", data=[["a"], ["bc"]], dtype=h5py.string_dtype()),
            r"\[s\] is a 2-d dataset of variable-length strings",
        ),
        (
            lambda h5: h5.create_dataset("v", (2,), dtype=h5py.vlen_dtype(np.int32)),
            r"\[v\] holds variable-length sequences",
        ),
        (
            lambda h5: h5.create_dataset("r", data=[h5.ref], dtype=h5py.ref_dtype),
            r"\[r\] holds .* object references",
        ),
        (lambda h5: h5.create_dataset("n", data=h5py.Empty("f")), r"\[n\] is an empty \(null dataspace\)"),
        (
            lambda h5: h5.create_dataset("e", (4,), dtype="f8", external=[("/etc/passwd", 0, 32)]),
            r"\[e\] keeps its bytes in other files",
        ),
    ],
)
def test_hdf5_datasets_that_are_no_arrays_are_refused_naming_them(
    store: Store, tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as h5:
        h5["fine"] = np.arange(3)
        make(h5)  # type: ignore[operator]
    with pytest.raises(UnsupportedDataError, match=message):
        store.put_file("m", path)
    assert _published(store) == []


def test_corrupt_and_truncated_hdf5(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "x.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(CorruptSourceError, match=r"x\.h5: not a valid HDF5 file"):
        store.put_file("m", path)
    cut = tmp_path / "cut.h5"
    with h5py.File(cut, "w") as h5:
        h5["a"] = np.arange(100_000.0)
    with cut.open("r+b") as fp:
        fp.truncate(cut.stat().st_size // 2)
    with pytest.raises(CorruptSourceError, match=r"cut\.h5"):
        store.put_file("m", cut)
    assert _published(store) == []


def test_missing_h5py_names_the_extra(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as h5:
        h5["a"] = np.arange(3)
    code = (
        "import sys; sys.modules['h5py'] = None\n"
        "import shmcache\n"
        f"try:\n    shmcache.Store({str(root)!r}).put_file('m', {str(path)!r})\n"
        "except shmcache.UnsupportedDataError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), check=True
    )
    assert done.stdout.startswith("UnsupportedDataError ")
    assert (
        f"{path}: reading HDF5 files needs h5py; install it with pip install 'shmcache[hdf5]'" in done.stdout
    )


# ---------------------------------------------------------------- directories, CLI, sources allowed, daemon


def test_directory_mixing_npy_safetensors_torch_and_hdf5(store: Store, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    save(tmp_path / "plain.npy", np.arange(3))
    safetensors_numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(tmp_path / "sub" / "m.safetensors"))
    torch.save({"b": torch.zeros(4)}, tmp_path / "ck.pth")
    with h5py.File(tmp_path / "t.hdf5", "w") as h5:
        h5["g/d"] = np.arange(5)
    (tmp_path / "notes.txt").write_text("ignored with --as arrays")
    keys = store.put_file("mix", tmp_path, as_="arrays")
    assert sorted(keys) == ["mix/ck/b", "mix/plain", "mix/sub/m/w", "mix/t/g/d"]
    group = shmcache.open_group("mix", root=store.root)
    np.testing.assert_array_equal(group["sub/m/w"], np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(group["t/g/d"], np.arange(5))
    np.testing.assert_array_equal(group["ck/b"], np.zeros(4, np.float32))


def test_plan_file_lists_tensors_with_their_sizes(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file({"a": np.zeros(10, np.float32)}, str(path))
    [entry] = store.plan_file("m", path)
    assert entry.key == "m/a" and entry.size == 128 + 40  # a built v1.0 header, then the payload
    assert _published(store) == []


def test_cli_put_of_a_safetensors_file(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file({"emb": np.arange(6, dtype=np.int32).reshape(2, 3)}, str(path))
    code, out, err = cli("put", str(path), "--key", "w", "--root", str(root), "--local")
    assert code == 0, err
    assert out.split() == ["w/emb"]
    np.testing.assert_array_equal(shmcache.open_array("w/emb", root=root), np.arange(6).reshape(2, 3))
    code, _, err = cli("put", str(tmp_path / "*.safetensors"), "--key", "g", "--root", str(root), "--local")
    assert code == 0, err
    assert shmcache.open_array("g/model/emb", root=root).shape == (2, 3)


def test_allowed_dirs_hold_for_new_formats(store: Store, tmp_path: Path) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    safetensors_numpy.save_file({"a": np.zeros(2)}, str(outside / "m.safetensors"))
    torch.save({"a": torch.zeros(2)}, outside / "m.pt")
    (inside / "link.pt").symlink_to(outside / "m.pt")
    for source in (outside / "m.safetensors", outside / "m.pt", inside / "link.pt"):
        with pytest.raises(SourceNotAllowedError):
            store.put_file("m", source, allowed_dirs=[inside])
    assert _published(store) == []


def test_daemon_loads_a_safetensors_file(daemon: Daemon, data_dir: Path, tmp_path: Path) -> None:
    from shmcache.client import Client

    name = unique("st")
    tensors = {"w": _values("float32", (64, 64)), "b": _values("int8", (9,))}
    safetensors_numpy.save_file(tensors, str(data_dir / f"{name}.safetensors"))
    outside = tmp_path / "outside.safetensors"
    safetensors_numpy.save_file(tensors, str(outside))
    with Client(daemon.root) as client:
        job = client.load(name, data_dir / f"{name}.safetensors", wait=True)
        assert sorted(job.keys) == [f"{name}/b", f"{name}/w"]
        with pytest.raises(SourceNotAllowedError):
            client.load(unique("no"), outside, wait=True)
    group = shmcache.open_group(name, root=daemon.root)
    for tensor, value in tensors.items():
        np.testing.assert_array_equal(group[tensor], value)


def test_preload_sees_a_multi_tensor_file_unchanged_until_it_changes(store: Store, tmp_path: Path) -> None:
    """The daemon skips a config preload whose entries came from the files as they are now."""
    pytest.importorskip("fastapi")
    from shmcache.service.sources import is_up_to_date

    folder = tmp_path / "weights"
    folder.mkdir()
    path = folder / "m.safetensors"
    safetensors_numpy.save_file({"a": np.zeros(2), "b": np.ones(3)}, str(path))
    torch.save({"c": torch.zeros(2)}, folder / "n.pt")
    age(folder)  # else racily clean (source_files.RACY_NS): never current
    store.put_file("w", folder)
    assert is_up_to_date(store, "w", folder)
    store.put_file("f", path)
    assert is_up_to_date(store, "f", path)
    safetensors_numpy.save_file({"a": np.zeros(2), "b": np.ones(4)}, str(path))
    assert not is_up_to_date(store, "f", path) and not is_up_to_date(store, "w", folder)
