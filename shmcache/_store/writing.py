"""Writing entries: new versions are written in ``tmp/``, described in ``meta.json`` from
the headers already in hand (never re-read), and published under each key's lock."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from .._disk.checksum import format_checksums
from .._disk.fs import full_is_cache_full, remove_tree
from .._disk.generations import bump_generations
from .._disk.layout import Layout, read_version
from .._disk.meta import META_FORMAT
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from ..errors import KeyExistsError
from .locks import key_lock

__all__ = ["ITEM_TYPES", "publish", "version_meta"]

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
        meta |= {"dtype": str(data.dtype), "shape": list(data.shape), "fortran_order": data.fortran_order}
    return meta


def publish(
    layout: Layout,
    writer: VersionWriter,
    versions: Sequence[tuple[str, str]],
    *,
    overwrite: bool,
    lock_timeout: float | None,
) -> None:
    """Make each ``(key, version)`` current, each with one atomic rename under its key's
    lock; then bump the generations of those keys once, and remove replaced versions
    (processes that map them keep reading them)."""
    linked: list[str] = []
    replaced: list[str] = []
    try:
        for key, version in versions:
            with full_is_cache_full(layout.key_lock(key)), key_lock(layout, key, lock_timeout):
                writer.promote(version)
                old = read_version(layout.entry_link(key))
                if old is not None and not overwrite:
                    raise KeyExistsError(f"entry {key!r} was published by another process meanwhile")
                writer.link(key, version)
                linked.append(key)
                if old is not None:
                    replaced.append(old)
    finally:
        if linked:
            bump_generations(layout, linked)
        for old in replaced:
            remove_tree(layout.version_dir(old))
