"""torch ``.pt``/``.pth`` state dicts read without torch, with ``weights_only=True`` rules.

A checkpoint saved by torch >= 1.6 is a zip: ``<dir>/data.pkl`` (a pickle of the object)
and ``<dir>/data/<n>`` (each storage's raw bytes, stored uncompressed). The pickle is read
by an unpickler that can build nothing but dicts and tensor descriptions: ``find_class``
knows ``collections.OrderedDict``, torch's tensor and parameter rebuild functions and the
storage type names, and refuses every other global, so a malicious pickle (a ``__reduce__``
naming ``os.system``) stops before anything runs. Before it runs, the pickle (stored raw, as
torch writes it, so no larger than the file) has its opcodes walked (``pickle_bounds``): one
estimated to build over 40 times its size in objects, or to index its memo far past its
entries, is refused without building anything. Tensors become descriptions of byte
ranges; the bytes themselves are copied later by the kernel (contiguous tensors) or
gathered with ``pread`` and numpy (strided views), never through a mapping of the source.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .._disk.dtypes import ML_DTYPES, marker
from .._disk.fs import pread_exactly, write_all
from .._disk.npy import zip_data_offset
from .._disk.shapes import MAX_DIMS, MAX_INTP, MAX_TENSORS, checked_shape
from ..errors import CorruptSourceError, UnsupportedDataError
from .pickle_bounds import check_pickle_cost

__all__ = ["TorchTensor", "gather_slabs", "gather_writer", "read_torch_index"]

MAX_PICKLE_BYTES = 256 << 20  # data.pkl of a state dict is ~100 bytes per tensor (MAX_TENSORS: 2**20)
_PICKLE_AMPLIFICATION = 40  # a state dict's pickle is estimated at 13-20x its size (pickle_bounds)
_PICKLE_FLOOR = 1 << 20
_NUMPY: dict[str, str] = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "?",
    "complex64": "<c8",
    "complex128": "<c16",
}
"""torch dtype names numpy has a type for (bfloat16 and float8 are stored as raw bits: ``dtypes``)."""
_STORAGES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "BFloat16Storage": "bfloat16",
}
"""Typed storages (``_rebuild_tensor_v2``) -> the torch dtype of their elements."""
_UNTYPED = "UntypedStorage"  # with _rebuild_tensor_v3, which names the dtype (numel in bytes)
_DTYPE_NAME = re.compile(r"(u?int|float|bfloat|complex|q?u?int|bits)[0-9]+\w*|bool")
_GATHER_BYTES = 16 << 20
_MAX_DEPTH = 32  # nested dicts: a state dict nests a few levels


class _Sealed:
    """What the unpickler builds cannot be altered by a BUILD opcode afterwards (pickle would
    otherwise update its ``__dict__``, past the checks made when it was built)."""

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("it sets the state of a tensor or storage")


@dataclass(frozen=True)
class _StorageType(_Sealed):
    name: str


@dataclass(frozen=True)
class _DType(_Sealed):
    name: str


@dataclass(frozen=True)
class _Storage(_Sealed):
    kind: _StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef(_Sealed):
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: _DType | None = None  # _rebuild_tensor_v3 names it; v2's typed storage implies it


@dataclass(frozen=True)
class TorchTensor:
    """One tensor of a checkpoint and where its bytes lie in the file."""

    name: str
    """Its path in the (nested) dict, joined with ``/``."""
    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    """In elements, as torch gives them."""
    start: int
    """Absolute file offset of the tensor's first element."""
    contiguous: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _rebuild_tensor_v2(storage: Any, offset: Any, shape: Any, strides: Any, *_: Any) -> _TensorRef:
    if not isinstance(storage, _Storage) or not _ints(shape) or not _ints(strides) or not _ints((offset,)):
        raise pickle.UnpicklingError("a tensor with a malformed storage, shape or stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError("a tensor whose shape and strides differ in length")
    if len(shape) > MAX_DIMS:
        raise pickle.UnpicklingError(
            f"a tensor of {len(shape)} dimensions; numpy arrays have at most {MAX_DIMS}"
        )
    if any(n > MAX_INTP for n in shape) or any(s > MAX_INTP for s in strides) or offset > MAX_INTP:
        raise pickle.UnpicklingError(f"a tensor of shape {tuple(shape)} beyond what numpy can address")
    return _TensorRef(storage, offset, tuple(shape), tuple(strides))


def _rebuild_tensor_v3(
    storage: Any, offset: Any, shape: Any, strides: Any, requires_grad: Any, hooks: Any, dtype: Any, *_: Any
) -> _TensorRef:
    if not isinstance(dtype, _DType):
        raise pickle.UnpicklingError("a tensor without a dtype")
    ref = _rebuild_tensor_v2(storage, offset, shape, strides)
    return _TensorRef(ref.storage, ref.offset, ref.shape, ref.strides, dtype)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _StateDictUnpickler(pickle.Unpickler):
    """Builds dicts, tensor descriptions and nothing else (torch's ``weights_only`` set, minus
    what a state dict of tensors never holds)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if (module, name) in (("torch", _UNTYPED), ("torch.storage", _UNTYPED)) or (
            module == "torch" and name in _STORAGES
        ):
            return _StorageType(name)
        if module == "torch" and _DTYPE_NAME.fullmatch(name):
            return _DType(name)  # a marker: dtypes numpy lacks are refused by tensor name
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which a state dict of tensors never needs"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or not _ints((pid[4],))
        ):
            raise pickle.UnpicklingError(f"an unknown persistent reference {pid!r:.80}")
        return _Storage(pid[1], pid[2], pid[4])


def read_torch_index(fp: BinaryIO, path: str) -> list[TorchTensor]:
    """Every tensor of the checkpoint open as ``fp`` (a regular file), named by its path in
    the dict; errors name ``path`` and the tensor or value."""
    fp.seek(0)
    magic = fp.read(4)
    fp.seek(0)
    if magic != b"PK\x03\x04":
        if magic[:1] == b"\x80":
            raise UnsupportedDataError(
                f"{path} is in torch's legacy (pre-1.6, non-zip) format, which shmcache does not "
                "read; save it again with a current torch: "
                "torch.save(torch.load(path, weights_only=True), path)"
            )
        raise CorruptSourceError(f"{path}: not a torch checkpoint (not a zip archive)")
    try:
        with zipfile.ZipFile(fp) as archive:
            prefix, obj = _load_pickle(archive, path)
            starts: dict[str, int] = {}  # storage member -> where its bytes start
            size = fp.seek(0, os.SEEK_END)  # a file, or a remote object's file-like
            tensors = [
                _locate(archive, fp, size, starts, prefix, name, ref, path) for name, ref in _walk(obj, path)
            ]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError) as exc:
        raise CorruptSourceError(f"{path}: not a valid torch checkpoint ({exc})") from exc
    if not tensors:
        raise CorruptSourceError(f"{path}: the checkpoint holds no tensors")
    return tensors


def _load_pickle(archive: zipfile.ZipFile, path: str) -> tuple[str, Any]:
    pickles = [
        i for i in archive.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")
    ]
    if len(pickles) != 1:
        raise CorruptSourceError(f"{path}: not a torch checkpoint (no single <dir>/data.pkl in the zip)")
    info = pickles[0]
    prefix = info.filename[: -len("data.pkl")]
    if info.compress_type != zipfile.ZIP_STORED:  # its size then bounds nothing the file does
        raise CorruptSourceError(f"{path}: its {info.filename} is compressed (torch stores it raw)")
    if info.file_size > MAX_PICKLE_BYTES:
        raise UnsupportedDataError(
            f"{path}: its pickle ({info.file_size} bytes) is too large for a state dict"
        )
    order = archive.NameToInfo.get(prefix + "byteorder")
    if order is not None and (order.file_size > 16 or archive.read(order).strip() != b"little"):
        raise UnsupportedDataError(
            f"{path} was saved on a big-endian machine; shmcache reads little-endian only"
        )
    data = archive.read(info)
    check_pickle_cost(data, _PICKLE_AMPLIFICATION, _PICKLE_FLOOR, f"{path}: {info.filename}")
    try:
        return prefix, _StateDictUnpickler(io.BytesIO(data)).load()
    except UnsupportedDataError:
        raise
    except pickle.UnpicklingError as exc:
        raise UnsupportedDataError(
            f"{path}: refused to unpickle it ({exc}); put_file loads state dicts of tensors only "
            "(what torch.load(..., weights_only=True) accepts, minus non-tensor values)"
        ) from None
    except Exception as exc:  # anything a damaged pickle raises
        raise CorruptSourceError(
            f"{path}: damaged pickle in the checkpoint ({type(exc).__name__}: {exc})"
        ) from None


def _walk(obj: Any, path: str) -> list[tuple[str, _TensorRef]]:
    """Every tensor under the state dict ``obj`` with its ``/``-joined name, in order.

    Iterative, and each dict visited once: a pickle's memo lets a 2 KB file reference one
    dict from every slot of every level (2**24 tensors from 24 levels), so a dict met a
    second time is refused, as are nesting over ``_MAX_DEPTH`` and over ``MAX_TENSORS``
    tensors. The work is then bounded by the pickle's size."""
    if not isinstance(obj, dict):
        raise UnsupportedDataError(
            f"{path} holds a {type(obj).__name__}, not a state dict; save a dict of tensors"
        )
    found: list[tuple[str, _TensorRef]] = []
    names: dict[str, tuple[str, ...]] = {}  # joined name -> its keys, to name a collision
    seen: dict[int, tuple[str, ...]] = {id(obj): ()}
    stack: list[tuple[tuple[str, ...], Iterator[tuple[Any, Any]]]] = [((), iter(dict.items(obj)))]
    while stack:  # not obj.items: a BUILD could have shadowed it
        parts, items = stack[-1]
        entry = next(items, None)
        if entry is None:
            stack.pop()
            continue
        name, value = entry
        if not isinstance(name, str):
            raise UnsupportedDataError(f"{path}: key {name!r:.80} is not a string; state dict keys must be")
        here = (*parts, name)
        if isinstance(value, _TensorRef):
            if len(found) >= MAX_TENSORS:
                raise UnsupportedDataError(f"{path}: over {MAX_TENSORS} tensors in one checkpoint")
            joined = "/".join(here)
            other = names.setdefault(joined, here)
            if other is not here:
                raise UnsupportedDataError(
                    f"{path}: tensors {_keys(other)} and {_keys(here)} would both become {joined!r:.200} "
                    "(a key holding '/' beside nested dicts); rename one of them"
                )
            found.append((joined, value))
        elif isinstance(value, dict):
            first = seen.setdefault(id(value), here)
            if first is not here:
                where = repr("/".join(first))[:200] if first else "the top"
                raise UnsupportedDataError(
                    f"{path}: {'/'.join(here)!r:.200} is the very dict already found at {where}; a "
                    "state dict is a tree (each dict in one place), and a shared one could unfold "
                    "into millions of tensors: crafted or corrupt"
                )
            if len(here) > _MAX_DEPTH:
                raise UnsupportedDataError(
                    f"{path}: dicts nested over {_MAX_DEPTH} deep at {'/'.join(here)!r:.200}"
                )
            stack.append((here, iter(dict.items(value))))
        else:
            raise UnsupportedDataError(
                f"{path}: {'/'.join(here)!r:.200} is {type(value).__name__}, not a tensor; put_file "
                "loads state dicts of tensors only: save the state dict alone (e.g. model.state_dict()), "
                "without step counters, strings or optimizer state"
            )
    return found


def _keys(parts: tuple[str, ...]) -> str:
    """How the tensor is reached in the dict: ``['a']['b']``."""
    return "".join(f"[{part!r}]" for part in parts)[:200]


def _locate(
    archive: zipfile.ZipFile,
    fp: BinaryIO,
    size: int,
    starts: dict[str, int],
    prefix: str,
    name: str,
    ref: _TensorRef,
    path: str,
) -> TorchTensor:
    where = f"{path}: tensor {name!r}"
    kind = ref.storage.kind.name
    if (kind == _UNTYPED) != (ref.dtype is not None):
        raise CorruptSourceError(f"{where}: its storage type {kind} does not go with its rebuild function")
    torch_dtype = ref.dtype.name if ref.dtype is not None else _STORAGES[kind]
    code = _NUMPY.get(torch_dtype)
    if code is None and torch_dtype not in ML_DTYPES:
        raise UnsupportedDataError(
            f"{where} is {torch_dtype}, which shmcache does not store (numpy dtypes, bfloat16 and "
            "float8 e4m3fn/e5m2); convert it first (e.g. {k: v.float() for k, v in sd.items()}) "
            "and save again"
        )
    dtype = np.dtype(code) if code is not None else marker(torch_dtype)
    checked_shape(ref.shape, dtype.itemsize, where)
    storage_bytes = ref.storage.numel if kind == _UNTYPED else ref.storage.numel * dtype.itemsize
    numel = storage_bytes // dtype.itemsize
    member = f"{prefix}data/{ref.storage.key}"
    info = archive.NameToInfo.get(member)
    if info is None:
        raise CorruptSourceError(f"{where}: its storage {member} is missing from the archive")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptSourceError(f"{where}: its storage {member} is compressed (torch stores them raw)")
    if info.file_size < storage_bytes:
        raise CorruptSourceError(
            f"{where}: its storage {member} holds {info.file_size} bytes, not {storage_bytes}"
        )
    if math.prod(ref.shape):
        last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.strides, strict=True))
        if last >= numel:
            raise CorruptSourceError(
                f"{where}: shape {ref.shape} with strides {ref.strides} at offset {ref.offset} reaches "
                f"past its storage of {numel} elements"
            )
    base = starts.get(member)
    if base is None:  # one read per storage, however many tensors view it
        base = starts[member] = zip_data_offset(fp, info)
    if base + info.file_size > size:
        raise CorruptSourceError(f"{where}: its storage ends past the end of the file (truncated)")
    return TorchTensor(
        name, dtype, ref.shape, ref.strides, base + ref.offset * dtype.itemsize, _contiguous(ref)
    )


def _contiguous(ref: _TensorRef) -> bool:
    expected = 1
    for n, s in zip(reversed(ref.shape), reversed(ref.strides), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def gather_writer(
    tensor: TorchTensor, header: bytes
) -> Callable[[int, int, Path, Callable[[int], None]], int]:
    """A decoder for a strided tensor of a local file: ``header``, then its elements in C
    order (:func:`gather_slabs`), gathered from ``pread`` reads of its storage (never a
    mapping of a file that could shrink: SIGBUS)."""

    def write(src: int, dst: int, target: Path, advance: Callable[[int], None]) -> int:
        write_all(dst, header, target)
        advance(len(header))
        crc = zlib.crc32(header)
        short = _ended_early(tensor.name)
        for slab in gather_slabs(tensor, lambda count, at: pread_exactly(src, count, at, short)):
            write_all(dst, slab, target)
            crc = zlib.crc32(slab, crc)
            advance(len(slab))
        return crc

    return write


def gather_slabs(tensor: TorchTensor, read: Callable[[int, int], bytes | bytearray]) -> Iterator[memoryview]:
    """A strided tensor's elements in C order, in slabs of rows (bytes), from ``read(count,
    offset)`` of its file (``pread``, or ranged reads of an object: ``remote_files``).

    Slabs of rows are read one at a time when their byte spans are about as large as what
    they hold (a slice of rows); when every slab would span most of the storage (a
    transpose), the tensor's whole span is read once instead of once per slab."""
    itemsize = tensor.dtype.itemsize
    rows = tensor.shape[0]
    row_span = (tensor.strides[0] * itemsize) if rows else 0
    tail = sum((n - 1) * s for n, s in zip(tensor.shape[1:], tensor.strides[1:], strict=True)) * itemsize
    row_bytes = tensor.nbytes // max(rows, 1)
    per_slab = max(1, _GATHER_BYTES // max(1, row_bytes))
    slab_span = (min(per_slab, rows) - 1) * row_span + tail + itemsize
    whole = slab_span > 2 * min(per_slab, rows) * row_bytes
    strides = tuple(s * itemsize for s in tensor.strides)
    if not tensor.nbytes:
        return
    span = (rows - 1) * row_span + tail + itemsize
    source = read(span, tensor.start) if whole else None
    for first in range(0, rows, per_slab):
        count = min(per_slab, rows - first)
        if source is None:
            raw, offset = read((count - 1) * row_span + tail + itemsize, tensor.start + first * row_span), 0
        else:
            raw, offset = source, first * row_span
        view = np.lib.stride_tricks.as_strided(
            np.frombuffer(raw, dtype=tensor.dtype, offset=offset),  # offset: whole rows
            shape=(count, *tensor.shape[1:]),
            strides=strides,
            writeable=False,
        )
        yield np.ascontiguousarray(view).reshape(-1).view(np.uint8).data


def _ended_early(name: str) -> Callable[[int], CorruptSourceError]:
    return lambda _: CorruptSourceError(f"tensor {name!r}: its file ended early (truncated while loading)")


def _ints(values: Any) -> bool:
    return isinstance(values, tuple | list) and all(type(v) is int and v >= 0 for v in values)
