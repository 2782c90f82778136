"""Reading what a root holds: entries' records, the space they use, who maps them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from .._disk.fs import free_bytes, total_bytes
from .._disk.layout import Layout, read_version
from .._disk.meta import read_meta
from ..errors import CacheRootError
from .records import EntryInfo, StoreStats, entry_info

__all__ = ["info_of", "iter_infos", "referenced_versions", "store_stats"]


def info_of(layout: Layout, version: str) -> EntryInfo | None:
    """The record of a published version (None if it is gone)."""
    meta = read_meta(layout, version)
    if not meta:
        return None
    first = (meta.get("files") or ["data"])[0]
    try:  # attaching touches the first file: its atime is the last use
        last_used = os.stat(layout.object_file(version, f"{first}.npy")).st_atime
    except FileNotFoundError:
        last_used = meta.get("created", 0.0)
    return entry_info(meta, max(last_used, meta.get("created", 0.0)))


def _entry_links(layout: Layout) -> dict[str, str]:
    """Key -> link path of every entry (the tree, and a format 1 root's flat links)."""
    try:
        return layout.links_under("")
    except OSError as exc:
        raise CacheRootError(f"cannot read cache root {layout.root}: {exc.strerror}") from exc


def iter_infos(layout: Layout) -> Iterator[EntryInfo]:
    """Every published entry (sorted by key)."""
    for key, link in _entry_links(layout).items():
        version = read_version(link)
        if version is None:
            continue
        info = info_of(layout, version)
        if info is not None and info.key == key:
            yield info


def referenced_versions(layout: Layout) -> dict[str, str]:
    """Version -> the key whose entry links to it, for every entry link."""
    linked = {}
    for key, link in _entry_links(layout).items():
        version = read_version(link)
        if version is not None:
            linked[version] = key
    return linked


def store_stats(layout: Layout, entries: list[EntryInfo], budget: int | None) -> StoreStats:
    """Space of the root's file system (of its nearest existing ancestor, before the first put)."""
    probe: Path = layout.root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return StoreStats(
        root=str(layout.root),
        capacity=total_bytes(probe),
        used=sum(e.size for e in entries),
        free=free_bytes(probe),
        budget=budget,
        entries=len(entries),
    )
