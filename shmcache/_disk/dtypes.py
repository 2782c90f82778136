"""bfloat16 and float8 (e4m3fn, e5m2): the machine-learning dtypes numpy has no type for.

Such an entry's ``.npy`` holds the raw bits under a one-field structured dtype named after
the real type: ``[('bfloat16', '<u2')]``, ``[('float8_e4m3fn', 'u1')]``,
``[('float8_e5m2', 'u1')]``. The file stays a standard ``.npy`` (``np.load`` reads it; the
field name says what the bits are), the header alone tells every reader the real dtype
(no ``meta.json`` read on the open path), and ``meta.json`` records ``"dtype": "bfloat16"``.

What each reader gets: ``shmcache.torch`` a tensor of the real torch dtype over the same
bytes (``torch.from_numpy(bits).view(torch.bfloat16)``); numpy readers an ``ml_dtypes``
array when ``ml_dtypes`` is installed (the ``ml_dtypes`` extra), else an
:class:`UnsupportedDataError` saying how to get the raw bits (``open_array(key,
raw=True)``). Nothing here imports torch: tensors passed to ``put_array`` are recognized by
their type's module and dtype name, and viewed through the torch module already loaded.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import UnsupportedDataError

__all__ = [
    "ML_DTYPES",
    "dtype_name",
    "for_numpy",
    "marker",
    "ml_name",
    "raw_bits",
    "storable",
]

ML_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
}
"""Real dtype name (torch's and ml_dtypes' spelling) -> the unsigned integer of its bits."""
_MARKERS: dict[np.dtype, str] = {np.dtype([(name, bits)]): name for name, bits in ML_DTYPES.items()}
_BY_NAME: dict[str, np.dtype] = {name: dtype for dtype, name in _MARKERS.items()}


def marker(name: str) -> np.dtype:
    """The stored dtype of ``name`` (``"bfloat16"`` -> ``[('bfloat16', '<u2')]``)."""
    return _BY_NAME[name]


def ml_name(dtype: np.dtype) -> str | None:
    """The real dtype a stored dtype stands for, or None for every other dtype."""
    if dtype.names is None:
        return None
    return _MARKERS.get(dtype)


def dtype_name(dtype: np.dtype) -> str:
    """What ``meta.json`` and ``ls`` call ``dtype``: ``str(dtype)``, the real name for a marker."""
    return ml_name(dtype) or str(dtype)


def raw_bits(array: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers (uint16 for bfloat16, uint8 for float8)."""
    name = ml_name(array.dtype)
    return array if name is None else array.view(ML_DTYPES[name])


def for_numpy(array: np.ndarray, key: str) -> np.ndarray:
    """The array numpy readers get for a stored marker: an ``ml_dtypes`` view of the same
    bytes, or a clear error where ``ml_dtypes`` is missing. Other arrays pass through."""
    name = ml_name(array.dtype)
    if name is None:
        return array
    try:
        import ml_dtypes
    except ImportError:
        raise UnsupportedDataError(
            f"entry {key!r} holds {name}, which numpy has no type for: install ml_dtypes "
            f"(pip install 'shmcache[ml_dtypes]') to get {name} arrays, use "
            f"shmcache.torch.as_tensor({key!r}) for a torch.{name} tensor, or "
            f"open_array({key!r}, raw=True) for the raw bits as {ML_DTYPES[name]}"
        ) from None
    return array.view(getattr(ml_dtypes, name))


def storable(value: Any) -> np.ndarray | None:
    """A bfloat16/float8 torch tensor or ``ml_dtypes`` array as its stored marker array
    (the same memory, no copy for a contiguous CPU tensor), or None for anything else."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    if isinstance(value, np.ndarray):
        name = str(dtype) if dtype.type.__module__.startswith("ml_dtypes") else None
        if name in ML_DTYPES and dtype.itemsize == ML_DTYPES[name].itemsize:
            return value.view(_BY_NAME[name])  # an ml_dtypes array
        return None
    name = str(dtype).removeprefix("torch.")
    if type(value).__module__.split(".")[0] != "torch" or name not in ML_DTYPES:
        return None
    torch = sys.modules["torch"]  # loaded: the caller holds one of its tensors
    bits = getattr(torch, "int16" if ML_DTYPES[name].itemsize == 2 else "uint8")
    numbers: np.ndarray = value.detach().cpu().view(bits).numpy()
    return numbers.view(_BY_NAME[name])
