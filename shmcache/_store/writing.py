"""Writing entries: new versions are written in ``tmp/``, described in ``meta.json`` from
the headers already in hand (never re-read), and published under each key's lock."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from .._disk.checksum import format_checksums
from .._disk.fs import remove_tree
from .._disk.generations import bump_generations
from .._disk.layout import Layout, read_version
from .._disk.meta import META_FORMAT
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from ..errors import KeyExistsError
from .locks import key_locks, publish_lock

__all__ = ["ITEM_TYPES", "publish", "version_meta"]

_DTYPE_NAMES: dict[np.dtype, str] = {}

ITEM_TYPES = {"strings": "str", "records": "json", "blobs": "bytes"}
"""What ``ls`` shows as the dtype of a container's items."""


def version_meta(
    key: str,
    kind: str,
    version: str,
    headers: Mapping[str, NpyHeader],
    crcs: Mapping[str, int],
    pin: bool,
) -> dict[str, Any]:
    """The ``meta.json`` of a version whose files have these headers and checksums."""
    names = sorted(headers)
    meta: dict[str, Any] = {
        "format": META_FORMAT,
        "key": key,
        "kind": kind,
        "version": version,
        "files": names,
        "nbytes": sum(headers[name].nbytes for name in names),
        "size": sum(headers[name].file_size for name in names),
        "created": time.time(),
        "pinned": pin,
        "source": None,
        "source_fingerprint": None,
        "checksum": format_checksums(dict(crcs)),
    }
    if kind == "array":
        data = headers["data"]
        dtype = _dtype_name(data.dtype)
        meta |= {"dtype": dtype, "shape": list(data.shape), "fortran_order": data.fortran_order}
    return meta


def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, remembered (numpy takes ~40 us to format one, per file of a batch)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
        if len(_DTYPE_NAMES) > 1024:
            _DTYPE_NAMES.clear()
    return name


def publish(
    layout: Layout,
    writer: VersionWriter,
    versions: Sequence[tuple[str, str]],
    *,
    overwrite: bool,
    lock_timeout: float | None,
) -> None:
    """Make every ``(key, version)`` current, all or none: under the locks of all the keys
    (taken in sorted order), check them all, promote and stage every link, then swap the
    links in one tight loop under the root's publish lock (exclusive when there are
    several, so a reader's snapshot of a group sees the whole old set or the whole new
    one). Then bump the generations of those keys once, and remove replaced versions
    (processes that map them keep reading them)."""
    linked: list[str] = []
    replaced: list[str] = []
    keys = [key for key, _ in versions]
    try:
        with key_locks(layout, keys, lock_timeout):
            for key in keys:  # before anything is promoted: a conflict publishes nothing
                old = read_version(layout.entry_link(key))
                if old is not None:
                    if not overwrite:
                        raise KeyExistsError(f"entry {key!r} was published by another process meanwhile")
                    replaced.append(old)
            staged = []
            for _, version in versions:
                writer.promote(version)
                staged.append(writer.stage_link(version))
            with publish_lock(layout, shared=False) if len(versions) > 1 else nullcontext():
                for (key, version), link in zip(versions, staged, strict=True):
                    writer.swap_link(key, version, link)
                    linked.append(key)
    finally:
        if linked:
            bump_generations(layout, linked)
        if len(linked) == len(versions):
            for old in replaced:
                remove_tree(layout.version_dir(old))
