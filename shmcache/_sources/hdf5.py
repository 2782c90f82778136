"""HDF5 sources for ``put_file`` (needs h5py: the ``hdf5`` extra, imported only here and
only when an HDF5 file is loaded). Every dataset becomes ``key/<its path in the file>``,
under each of its names (``walk_datasets``: external links refused, never followed);
its bytes are decoded by h5py (chunked and compressed layouts included) in slabs of at
most 16 MiB (whole rows, or parts of a row too large for one) and appended with
``write()`` to the staging file, never through a mapping.

Kept as arrays: numbers, bools, fixed-width bytes, enums (as their integers), compound
types (structured arrays), scalars (0-d arrays). A 1-D dataset of variable-length
strings becomes a strings entry (decoded when the file is checked, published with the
rest). Refused, naming the dataset: variable-length sequences, object references, empty
(null) datasets, and datasets whose bytes live in other files (external storage,
virtual datasets), which would read files the daemon's ``--allow-source`` never checked.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.lib.format as npy_format

from .._containers.encode import encode_strings
from .._disk.fs import write_all
from .._disk.npy import NpyHeader, build_header, check_storable_dtype
from .._disk.shapes import checked_shape
from ..errors import CorruptSourceError, ShmCacheError, UnsupportedDataError
from .planned import Container, Planned, container_header, member_key
from .source_files import SourceFile

__all__ = ["decode_strings", "plan_hdf5", "walk_datasets"]

_SLAB_BYTES = 16 << 20
_STRINGS_PER_SLAB = 4096
_MAX_SOFT_LINKS = 16  # HDF5's own limit on soft links followed in one traversal (H5L_NUM_LINKS)


def _h5py(path: Path) -> Any:
    try:
        import h5py  # type: ignore[import-untyped]
    except ImportError:
        raise UnsupportedDataError(
            f"{path}: reading HDF5 files needs h5py; install it with pip install 'shmcache[hdf5]'"
        ) from None
    return h5py


def plan_hdf5(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    """One planned entry per dataset of the HDF5 file open as ``fp``."""
    h5py = _h5py(path)
    plan: list[Planned] = []
    with _open(h5py, fp, path) as h5:
        for name, dataset in walk_datasets(h5py, h5, str(path)):
            where = f"{path}[{name}]"
            _check_storage(h5py, dataset, where)
            if h5py.check_string_dtype(dataset.dtype) is not None and dataset.dtype.kind == "O":
                plan.append(_strings(key, path, file, name, dataset, where))
                continue
            dtype, shape = _check_dataset(h5py, dataset, where)
            prefix = build_header(dtype, shape, False)
            plan.append(
                Planned(
                    key=member_key(key, name, path, "dataset"),
                    header=NpyHeader(dtype, shape, False, len(prefix)),
                    source=where,
                    file=file,
                    copy_offset=None,
                    member=name,
                    prefix=prefix,
                    write=_decoder(path, name, dtype, shape, prefix),
                )
            )
    if not plan:
        raise CorruptSourceError(f"{path}: the HDF5 file holds no datasets")
    return plan


def walk_datasets(h5py: Any, h5: Any, path: str) -> list[tuple[str, Any]]:
    """Every dataset of the open file ``h5`` under each name it has, in sorted order.

    ``visititems`` visits an object once, under its first name, and follows no soft or
    external link: a second (hard) name of a dataset and a dataset behind a link were
    left out without a word. Here every link is met: a dataset is listed under each of
    its names (hard links, and soft links resolved inside the file); a group is walked
    once, and a second name of a group is refused (two links per level of a tiny file
    would list 2**levels names); an external link, even on a soft link's path, is refused
    before it is followed (its file was never checked against the daemon's
    ``--allow-source``, and could be any file of the machine), as a dangling soft link is."""
    root = h5["/"]
    groups = {root.id: "/"}
    found: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        prefix, group = stack.pop()
        for name in sorted(group, reverse=True):  # popped in sorted order
            full = prefix + name
            link = group.get(name, getlink=True)
            obj = _follow(h5py, root, group, name, link, f"{path}[{full}]")
            if isinstance(obj, h5py.Group):
                first = groups.setdefault(obj.id, full)
                if first != full:
                    raise UnsupportedDataError(
                        f"{path}[{full}] is another name ({type(link).__name__}) of the group {first!r}; "
                        "shmcache publishes a dataset under each of its names, but a group's under "
                        f"one: delete the link (del f[{full!r}]) or put_file a copy without it"
                    )
                stack.append((full + "/", obj))
            elif isinstance(obj, h5py.Dataset):
                found.append((full, obj))
            # a named datatype holds no data
    return sorted(found, key=lambda item: item[0])


def _follow(
    h5py: Any, root: Any, group: Any, name: str, link: Any, where: str, budget: list[int] | None = None
) -> Any:
    """The object ``link`` (``name`` in ``group``) names, resolved one path component at a
    time so that no external link is ever followed; at most ``_MAX_SOFT_LINKS`` soft links
    in all (``budget``), as HDF5 counts them per traversal (else soft links whose paths
    name other soft links twice would take 2**16 steps)."""
    if isinstance(link, h5py.ExternalLink):
        raise UnsupportedDataError(
            f"{where} is an external link to {link.filename}:{link.path}, another file, which "
            "shmcache does not follow (it was never checked against the daemon's --allow-source): "
            "copy the data into this file (h5copy) or put_file that file itself"
        )
    if not isinstance(link, h5py.SoftLink):
        return group[name]
    budget = budget if budget is not None else [_MAX_SOFT_LINKS]
    budget[0] -= 1
    if budget[0] < 0:
        raise CorruptSourceError(f"{where}: over {_MAX_SOFT_LINKS} soft links to follow (a loop?)")
    node = root if link.path.startswith("/") else group
    for part in (p for p in link.path.split("/") if p not in ("", ".")):
        step = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if step is None:
            raise CorruptSourceError(f"{where} is a soft link to {link.path}, which is not in the file")
        node = _follow(h5py, root, node, part, step, where, budget)
    return node


def _open(h5py: Any, fp: BinaryIO, path: Path) -> Any:
    try:
        return h5py.File(fp, "r")
    except (OSError, ValueError) as exc:
        raise CorruptSourceError(f"{path}: not a valid HDF5 file ({exc})") from None


def _check_storage(h5py: Any, dataset: Any, where: str) -> None:
    """The dataset has a shape, keeps its bytes in this file, and this h5py can decode them."""
    if dataset.shape is None:
        raise UnsupportedDataError(f"{where} is an empty (null dataspace) dataset, which holds no array")
    if dataset.is_virtual or dataset.external:
        raise UnsupportedDataError(
            f"{where} keeps its bytes in other files (virtual or external storage), which shmcache "
            "does not follow; copy it into the file (h5repack) or load its source files instead"
        )
    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(i)
        if not h5py.h5z.filter_avail(code):
            raise UnsupportedDataError(
                f"{where} is compressed with filter {name.decode(errors='replace')!r} ({code}), which "
                "this h5py cannot decode; install its plugin (e.g. hdf5plugin) or repack the file"
            )


def _strings(key: str, path: Path, file: SourceFile, name: str, dataset: Any, where: str) -> Planned:
    """A strings entry from a 1-D dataset of variable-length strings, decoded now."""
    container = Container("strings", *decode_strings(dataset, where))
    return Planned(
        key=member_key(key, name, path, "dataset"),
        header=container_header(container),
        source=where,
        file=file,
        copy_offset=None,
        member=name,
        container=container,
    )


def decode_strings(dataset: Any, where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The strings entry's files and meta of a 1-D dataset of variable-length strings, decoded
    (by h5py, from a local file or an object's file-like: ``remote_files``) in slabs of
    ``_STRINGS_PER_SLAB`` and encoded as they come: memory is the entry's own arrays (~28
    bytes a string with its UTF-8), not a Python string per value (3M declared, unwritten
    strings in a 1.4 KB file held +283 MiB)."""
    if dataset.ndim != 1:
        raise UnsupportedDataError(
            f"{where} is a {dataset.ndim}-d dataset of variable-length strings; shmcache strings "
            "are a 1-D sequence: reshape it in the file, or put_strings its flattened values"
        )
    count = int(dataset.shape[0])
    strings = dataset.asstr()

    def values() -> Iterator[str]:  # a slab at a time: the list of all of them held ~100 bytes each
        for start in range(0, count, _STRINGS_PER_SLAB):
            yield from strings[start : start + _STRINGS_PER_SLAB].tolist()

    try:
        files = encode_strings(values(), where)
    except UnicodeDecodeError as exc:
        raise CorruptSourceError(f"{where} holds strings that are not valid UTF-8 ({exc})") from None
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CorruptSourceError(f"{where} cannot be decoded ({exc}): damaged or truncated") from None
    return files, {"length": count}


def _check_dataset(h5py: Any, dataset: Any, where: str) -> tuple[np.dtype, tuple[int, ...]]:
    raw = dataset.dtype
    if h5py.check_vlen_dtype(raw) is not None or h5py.check_ref_dtype(raw) is not None:
        raise UnsupportedDataError(
            f"{where} holds variable-length sequences or object references, which are not arrays"
        )
    dtype = _plain(raw)
    check_storable_dtype(dtype, where)
    return dtype, checked_shape(tuple(int(n) for n in dataset.shape), dtype.itemsize, where)


def _plain(dtype: np.dtype) -> np.dtype:
    """``dtype`` without h5py's metadata (enum names, string info), which .npy cannot keep."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return npy_format.descr_to_dtype(npy_format.dtype_to_descr(dtype))  # type: ignore[no-any-return]


def _decoder(
    path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...], prefix: bytes
) -> Callable[[int, int, Path, Callable[[int], None]], int]:
    """Writes ``prefix`` then the dataset, read by h5py from the reopened file in slabs of at
    most ``_SLAB_BYTES`` (:func:`_slabs`)."""
    where = f"{path}[{name}]"

    def write(src: int, dst: int, target: Path, advance: Callable[[int], None]) -> int:
        h5py = _h5py(path)
        write_all(dst, prefix, target)
        advance(len(prefix))
        crc = zlib.crc32(prefix)
        with open(os.dup(src), "rb") as fp, _open(h5py, fp, path) as h5:
            dataset = h5.get(name)
            if not isinstance(dataset, h5py.Dataset) or tuple(dataset.shape or ()) != shape:
                raise CorruptSourceError(f"{where} changed after it was checked; nothing was published")
            for slab in _slabs(shape, dtype.itemsize, _SLAB_BYTES):
                data = _read(dataset, slab, dtype, where)
                write_all(dst, data, target)
                crc = zlib.crc32(data, crc)
                advance(len(data))
        return crc

    return write


def _slabs(shape: tuple[int, ...], itemsize: int, limit: int) -> Iterator[tuple[int | slice, ...]]:
    """Selections of the dataset, in C order, each of at most ``limit`` bytes (or one element):
    whole rows when a row fits, else parts of a row along the first axis whose every
    inner row fits, down to parts of the last axis. A (1, 2**26) dataset was read whole
    (a slab was whole rows, at least one)."""
    if not shape:
        yield ()
        return
    axis, inner = len(shape) - 1, itemsize
    while axis > 0 and inner * shape[axis] <= limit:
        inner *= shape[axis]
        axis -= 1
    per = max(1, limit // max(1, inner))  # axis 0 when rows fit (inner: 0 for an empty row)
    for outer in np.ndindex(*shape[:axis]):
        for start in range(0, shape[axis], per):
            yield (*outer, slice(start, start + per))


def _read(dataset: Any, slab: Any, dtype: np.dtype, where: str) -> memoryview:
    try:
        values = np.ascontiguousarray(dataset[slab])
    except ShmCacheError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CorruptSourceError(f"{where} cannot be decoded ({exc}): damaged or truncated") from None
    if values.dtype.itemsize != dtype.itemsize:
        raise CorruptSourceError(f"{where} changed after it was checked; nothing was published")
    return values.reshape(-1).view(np.uint8).data
