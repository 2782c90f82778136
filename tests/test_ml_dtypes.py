"""bfloat16 and float8 (e4m3fn, e5m2): put from safetensors, torch ``.pt``, tensors and
``ml_dtypes`` arrays; stored as their raw bits zero-copy, recorded with their real dtype;
read back as tensors of that dtype, ``ml_dtypes`` arrays, or raw bits."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import Store
from shmcache.errors import UnsupportedDataError

torch = pytest.importorskip("torch")
from shmcache.torch import CachedDataset, as_tensor, open_state_dict  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")

ML = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
SAFETENSORS_NAMES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.uint8)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format by hand (8-byte header length, JSON header, raw bytes), so
    the test needs no safetensors package; ``test_bf16_model_through_safetensors`` also
    uses the package's own writer when it is installed."""
    header, payload = {}, b""
    for name, tensor in tensors.items():
        raw = _bits(tensor.contiguous()).numpy().tobytes()
        dtype = SAFETENSORS_NAMES[str(tensor.dtype).removeprefix("torch.")]
        span = [len(payload), len(payload) + len(raw)]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": span}
        payload += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + payload)


def _assert_loads_back(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    fresh = _model().to(torch.bfloat16)
    for parameter in fresh.parameters():
        torch.nn.init.zeros_(parameter)
    fresh.load_state_dict(state)
    for name, tensor in fresh.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(_bits(tensor), _bits(expected[name])), name  # bit-identical


@pytest.mark.parametrize("writer", ["package", "by hand"])
def test_bf16_model_through_safetensors(store: Store, tmp_path: Path, writer: str) -> None:
    state = _model().to(torch.bfloat16).state_dict()
    path = tmp_path / "model.safetensors"
    if writer == "package":
        save_file = pytest.importorskip("safetensors.torch").save_file
        save_file(state, str(path))
    else:
        _write_safetensors(path, state)
    keys = store.put_file("llm", path)
    assert sorted(keys) == sorted(f"llm/{name}" for name in state)
    assert {store.info(key).dtype for key in keys} == {"bfloat16"}  # the real dtype, in meta.json
    loaded = open_state_dict("llm", root=store.root)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    _assert_loads_back(loaded, state)
    assert all(store.verify(key) for key in keys)


def test_bf16_model_through_torch_save(store: Store, tmp_path: Path) -> None:
    model = _model().to(torch.bfloat16)
    state = model.state_dict()
    path = tmp_path / "model.pt"
    torch.save(state, path)
    keys = store.put_file("llm", path)
    assert {store.info(key).dtype for key in keys} == {"bfloat16"}
    _assert_loads_back(open_state_dict("llm", root=store.root), state)
    transposed = tmp_path / "t.pt"  # a strided view is gathered, still as bits
    weight = state["0.weight"]
    torch.save({"t": weight.t()}, transposed)
    store.put_file("t", transposed)
    assert torch.equal(_bits(as_tensor("t/t", root=store.root)), _bits(weight.t().contiguous()))


@pytest.mark.parametrize("name", ML)
def test_each_dtype_from_every_source_is_bit_identical(store: Store, tmp_path: Path, name: str) -> None:
    dtype = getattr(torch, name)
    original = (torch.randn(7, 5) * 3).to(dtype)
    _write_safetensors(tmp_path / "a.safetensors", {"w": original})
    torch.save({"w": original}, tmp_path / "a.pt")
    store.put_file("st", tmp_path / "a.safetensors")
    store.put_file("pt", tmp_path / "a.pt")
    store.put_array("tensor", original)
    store.put_array("ml", original.float().numpy().astype(getattr(ml_dtypes, name)))
    for key in ("st/w", "pt/w", "tensor", "ml"):
        tensor = as_tensor(key, root=store.root)
        assert tensor.dtype == dtype, key
        assert torch.equal(_bits(tensor), _bits(original)), key
        assert store.info(key).dtype == name
        array = store.open_array(key)
        assert array.dtype == np.dtype(getattr(ml_dtypes, name)) and not array.flags.writeable
        assert store.open_array(key) is array  # kept warm, as every array is
        np.testing.assert_array_equal(array.astype(np.float32), original.float().numpy())
        assert torch.equal(_bits(as_tensor(array)), _bits(original))  # the ml_dtypes array's own pages
        raw = store.open_array(key, raw=True)
        assert raw.dtype == (np.uint16 if name == "bfloat16" else np.uint8)
        signed = raw.view(np.int16 if name == "bfloat16" else np.uint8)
        np.testing.assert_array_equal(signed, _bits(original).numpy())


def test_stored_zero_copy_as_a_standard_npy(store: Store) -> None:
    store.put_array("w", torch.ones(1000, 1000, dtype=torch.bfloat16))
    info = store.info("w")
    assert info.nbytes == 2_000_000  # two bytes an element: the bits, no widening
    version = store.layout.entry_version("w")
    assert version is not None
    loaded = np.load(store.layout.version_dir(version) / "data.npy")  # any tool reads it
    assert loaded.dtype == np.dtype([("bfloat16", "<u2")])
    assert int(loaded.view(np.uint16)[0, 0]) == 0x3F80  # bfloat16 1.0
    a, b = as_tensor("w", root=store.root), as_tensor("w", root=store.root)
    a[0, 0] = 5  # private on write, as for any tensor
    assert float(b[0, 0]) == 1.0 and float(store.open_array("w")[0, 0]) == 1.0


def test_group_and_pickle_give_ml_dtypes_arrays(store: Store) -> None:
    store.put_array("g/a", torch.arange(6, dtype=torch.float32).to(torch.bfloat16))
    group = store.open_group("g")
    assert group["a"].dtype == np.dtype(ml_dtypes.bfloat16)
    again = pickle.loads(pickle.dumps(group["a"]))  # by reference, and still bfloat16
    assert again.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(again.astype(np.float32), np.arange(6, dtype=np.float32))


def test_cached_dataset_batches_keep_the_dtype(store: Store) -> None:
    x = torch.randn(64, 8).to(torch.bfloat16)
    store.put_array("x", x)
    store.put_array("y", torch.arange(64))
    dataset = CachedDataset("x", "y", root=store.root)
    row, label = dataset[3]
    assert row.dtype == torch.bfloat16 and torch.equal(_bits(row), _bits(x[3])) and int(label) == 3
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2)
    batches = list(loader)
    assert torch.equal(_bits(torch.cat([b[0] for b in batches])), _bits(x))


def test_without_ml_dtypes_numpy_readers_get_a_clear_error(store: Store) -> None:
    store.put_array("w", torch.ones(4, dtype=torch.bfloat16))
    store.put_array("g/b", torch.ones(2, dtype=torch.float8_e5m2))
    script = (
        "import sys; sys.modules['ml_dtypes'] = None\n"  # what Python does for a missing package
        "import shmcache\n"
        f"root = {str(store.root)!r}\n"
        "try:\n    shmcache.open_array('w', root=root)\n"
        "except shmcache.UnsupportedDataError as exc:\n    print(exc)\n"
        "print(shmcache.open_array('w', root=root, raw=True).tolist())\n"
        "print(shmcache.Store(root).verify('w'))\n"
        "from shmcache.torch import CachedDataset, as_tensor, open_state_dict\n"  # torch needs no ml_dtypes
        "print(as_tensor('w', root=root).dtype, CachedDataset('w', root=root)[0].dtype,"
        " open_state_dict('g', root=root)['b'].dtype)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    message, raw, verified, tensors = out.strip().splitlines()
    assert tensors == "torch.bfloat16 torch.bfloat16 torch.float8_e5m2"
    assert "holds bfloat16, which numpy has no type for" in message
    assert "shmcache[ml_dtypes]" in message and "raw=True" in message and "as_tensor('w')" in message
    assert raw == str([0x3F80] * 4) and verified == "True"


def test_unsupported_tensor_dtypes_are_refused(store: Store) -> None:
    with pytest.raises((UnsupportedDataError, TypeError)):
        store.put_array("w", torch.ones(2, dtype=torch.float8_e4m3fnuz))
    assert not store.exists("w")


def test_a_structured_array_is_not_mistaken(store: Store) -> None:
    other = np.zeros(3, dtype=[("x", "<u2")])  # one field, but not a marker's name
    store.put_array("s", other)
    assert store.open_array("s").dtype == other.dtype and store.info("s").dtype == str(other.dtype)


def test_the_module_level_function_takes_raw(store: Store) -> None:
    shmcache.put_array("w", torch.ones(2, dtype=torch.float8_e5m2), root=store.root)
    assert shmcache.open_array("w", root=store.root, raw=True).tolist() == [0x3C, 0x3C]
