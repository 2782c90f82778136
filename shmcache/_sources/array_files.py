"""``put_file`` planners for array files other tools write: ``.safetensors``, torch
``.pt``/``.pth`` state dicts and HDF5. Each tensor or dataset becomes ``key/<its name>``
(an entry of a group: ``open_group(key)``), with a ``.npy`` header built here; raw
tensors are then copied by the kernel from their byte range, strided ones gathered and
HDF5 datasets decoded by h5py (``hdf5.py``). The parsers are imported on first use:
``import shmcache`` pays nothing for them."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from .._disk.npy import NpyHeader, build_header
from .planned import Planned, member_key
from .source_files import SourceFile

__all__ = ["PLANNERS", "plan_hdf5", "plan_safetensors", "plan_torch"]


def _raw(
    key: str, path: Path, file: SourceFile, name: str, dtype: np.dtype, shape: tuple[int, ...], offset: int
) -> Planned:
    """A built header, then ``dtype``/``shape``'s bytes from ``offset`` of ``path``."""
    prefix = build_header(dtype, shape, False)
    return Planned(
        key=member_key(key, name, path, "tensor"),
        header=NpyHeader(dtype, shape, False, len(prefix)),
        source=f"{path}[{name}]",
        file=file,
        copy_offset=offset,
        member=name,
        prefix=prefix,
    )


def plan_safetensors(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    from .safetensors import read_safetensors_index  # lazy: import shmcache stays light

    tensors = read_safetensors_index(fp.fileno(), file.size, str(path))
    return [_raw(key, path, file, t.name, t.dtype, t.shape, t.offset) for t in tensors]


def plan_torch(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    from .torch_zip import gather_writer, read_torch_index

    plan = []
    for t in read_torch_index(fp, str(path)):
        item = _raw(key, path, file, t.name, t.dtype, t.shape, t.start)
        if not t.contiguous:
            assert item.prefix is not None
            item.write = gather_writer(t, item.prefix)
        plan.append(item)
    return plan


def plan_hdf5(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    from .hdf5 import plan_hdf5

    return plan_hdf5(key, path, file, fp)


PLANNERS = {
    ".safetensors": plan_safetensors,
    ".pt": plan_torch,
    ".pth": plan_torch,
    ".h5": plan_hdf5,
    ".hdf5": plan_hdf5,
}
"""Suffix -> planner for the formats of this module (merged into ``files.PLANNERS``)."""
