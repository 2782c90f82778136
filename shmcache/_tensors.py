"""Tensors over stored arrays, bfloat16 and float8 included (imported by ``shmcache.torch`` only).

A bfloat16/float8 entry holds its raw bits (``_disk/dtypes``); its tensor is
``torch.from_numpy(bits).view(torch.bfloat16)``: the same memory, no copy.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ._api import get_store
from ._disk.dtypes import ML_DTYPES, ml_name, storable

__all__ = ["open_state_dict", "tensor_of"]


def tensor_of(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array)``, with a stored marker or an ``ml_dtypes`` array as a
    tensor of its real dtype over the same bytes."""
    if array.dtype.names is None and array.dtype.num < 256:  # a builtin numpy type (ml_dtypes': >= 256)
        return torch.from_numpy(array)
    marked = storable(array) if array.dtype.names is None else array  # an ml_dtypes array
    name = ml_name(marked.dtype) if marked is not None else None
    if marked is None or name is None:
        return torch.from_numpy(array)  # torch explains what it refuses
    bits = marked.view(ML_DTYPES[name])
    return torch.from_numpy(bits).view(getattr(torch, name))


def open_state_dict(
    prefix: str, *, root: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every array entry under ``prefix`` (what ``put_file(prefix, "model.safetensors")`` or a
    ``.pt`` state dict made) as ``{name: tensor}`` for ``model.load_state_dict``: tensors of
    the stored dtype (bfloat16 and float8 included) over the cache's pages, no copy, each
    on a copy-on-write mapping of its own (``as_tensor``). Names are relative to ``prefix``."""
    store = get_store(root)
    prefix = prefix.rstrip("/")
    names = list(store.open_group(prefix))  # one snapshot of the names; entries mapped below
    return {name: tensor_of(store.open_private_array(f"{prefix}/{name}")) for name in names}
