"""Reading what a root holds: entries' records, the space they use, who maps them."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import numpy as np

from .._disk.fs import allocated_bytes, free_bytes, out_of_descriptors, too_many_open_files, total_bytes
from .._disk.layout import (
    GENERATION_BYTES,
    MANIFEST_FILE,
    Layout,
    generation_slot,
    object_path,
    packed_range,
    read_version,
)
from .._disk.meta import read_meta
from ..errors import CacheRootError
from .records import EntryInfo, StoreStats, entry_info

__all__ = [
    "held_by_batches",
    "info_of",
    "iter_infos",
    "packed_batch",
    "partial_bytes",
    "referenced_versions",
    "store_stats",
    "used_bytes",
]

_USAGE_MAX_AGE_S = 5.0
_usage: dict[str, tuple[bytes, float, dict[str, tuple[str, int]]]] = {}
"""root -> (its generation table when read, when, key -> (version, size)): the
sizes of a root's entries, re-read only for keys whose generation slot changed since (a
published version never changes, so ``meta.json`` is read once per new version)."""


def info_of(layout: Layout, version: str) -> EntryInfo | None:
    """The record of a published version (None if it is gone)."""
    meta = read_meta(layout, version)
    if meta is None:
        return None
    first = (meta.files or ("data",))[0]
    try:  # attaching touches the first file: its atime is the last use
        last_used = os.stat(layout.object_file(version, f"{first}.npy")).st_atime
    except FileNotFoundError:
        last_used = meta.created
    return entry_info(meta, max(last_used, meta.created))


def _entry_links(layout: Layout) -> dict[str, str]:
    """Key -> link path of every entry (the tree, and a format 1 root's flat links)."""
    try:
        return layout.links_under("")
    except OSError as exc:
        if out_of_descriptors(exc):
            raise too_many_open_files(exc, f"listing cache root {layout.root}") from exc
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


def packed_batch(version: str) -> str | None:
    """The batch whose manifest holds a packed entry's bytes (None: not packed)."""
    packed = packed_range(version)
    return None if packed is None else packed[0]


def held_by_batches(layout: Layout, linked: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Batch -> bytes its manifest holds beyond the sizes of its linked packed entries
    (``linked``: ``(version, size)`` of each entry counted). Every batch with a linked
    entry, packed or an entry directory, keeps its whole manifest: evicting a packed
    entry clears its live byte but frees nothing, the manifest's pages return only with
    the batch's last entry (a batch whose packed entries are all evicted still holds them
    while an entry directory of it is linked). One ``stat`` per batch (its allocated
    blocks), none per key."""
    live: dict[str, int] = {}
    for version, size in linked:
        batch, slash, rest = version.partition("/")
        if slash:  # an entry of a directory put: a packed one's bytes are in the manifest
            live[batch] = live.get(batch, 0) + (size if "." in rest and packed_range(version) else 0)
    held = {}
    for batch, size in live.items():
        try:
            allocated = os.stat(object_path(str(layout.root), batch, MANIFEST_FILE)).st_blocks * 512
        except OSError:  # gone since the listing (or a batch of an older format without one)
            continue
        held[batch] = max(0, allocated - size)
    return held


def used_bytes(layout: Layout, excluding: Collection[str] = ()) -> int:
    """Bytes held by the root's published entries but those under ``excluding`` keys (what
    ``stats`` calls used), and by the manifests of their directory puts beyond those
    entries (what evicted packed entries still hold, see :func:`held_by_batches`). Every
    put under a budget pays it first, so it must not read every entry's metadata: one walk
    of the entry tree, then a ``readlink`` only for keys whose generation slot changed
    since the last call (every publish and evict bumps its keys' slots), one ``stat`` per
    batch, and every key again after a few seconds (a writer killed between its link swap and its
    bump leaves no trace in the table)."""
    root = str(layout.root)
    table = _generation_table(layout)  # before the listing: a change during it is seen next time
    now = time.monotonic()
    cached = _usage.get(root)
    changed: set[int] | None = None  # None: every key
    if cached is not None and table is not None and now - cached[1] <= _USAGE_MAX_AGE_S:
        before = np.frombuffer(cached[0], dtype=np.uint64)
        changed = set(np.flatnonzero(np.frombuffer(table, dtype=np.uint64) != before).tolist())
    known = {} if cached is None else cached[2]
    sizes = _scan_sizes(layout, known, changed)
    if table is not None:
        full_scan_at = now if changed is None or cached is None else cached[1]
        _usage[root] = (table, full_scan_at, sizes)
    excluded = set(excluding)
    counted = [seen for key, seen in sizes.items() if key not in excluded]
    # a replaced packed entry's bytes stay in its manifest: held, not freed by the put
    return sum([size for _, size in counted]) + sum(held_by_batches(layout, counted).values())


def _scan_sizes(
    layout: Layout, known: dict[str, tuple[str, int]], changed: set[int] | None
) -> dict[str, tuple[str, int]]:
    """Key -> (version, size) of every entry: from ``known`` for keys whose slot is not in
    ``changed``, else read (``meta.json`` only for a version not seen before)."""
    sizes = {}
    for key, link in _entry_links(layout).items():
        seen = known.get(key)
        if seen is not None and changed is not None and generation_slot(key) not in changed:
            sizes[key] = seen
            continue
        version = read_version(link)
        if version is None:
            continue
        if seen is None or seen[0] != version:
            meta = read_meta(layout, version)
            if meta is None or meta.key != key:
                continue
            seen = (version, meta.size)
        sizes[key] = seen
    return sizes


def _generation_table(layout: Layout) -> bytes | None:
    """A copy of the root's generation table (None without one)."""
    try:
        fd = os.open(layout.generation, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        table = os.pread(fd, GENERATION_BYTES, 0)
    finally:
        os.close(fd)
    return table if len(table) == GENERATION_BYTES else None


def referenced_versions(layout: Layout) -> dict[str, str]:
    """Version -> the key whose entry links to it, for every entry link."""
    linked = {}
    for key, link in _entry_links(layout).items():
        version = read_version(link)
        if version is not None:
            linked[version] = key
    return linked


def partial_bytes(layout: Layout, but: str | None = None) -> int:
    """Bytes the files in ``tmp/`` take: writes in progress and what dead writers left
    (``cleanup`` frees those); no entry counts them, yet the file system's free space
    lacks them. ``but``: a writer whose own files are left out."""
    try:
        names = os.listdir(layout.tmp)
    except OSError:  # no root yet, or one this user may not read (doctor on another's)
        return 0
    total = 0
    for name in names:
        if but is not None and name.startswith(f"{but}."):
            continue
        path = layout.tmp / name
        try:  # a version's directory, or a lock file or staged link of its own
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        total += allocated_bytes(path) if stat.S_ISDIR(st.st_mode) else st.st_blocks * 512
    return total


def store_stats(layout: Layout, entries: list[EntryInfo], budget: int | None) -> StoreStats:
    """Space of the root's file system (of its nearest existing ancestor, before the first put)."""
    held = sum(held_by_batches(layout, [(e.version, e.size) for e in entries]).values())
    probe: Path = layout.root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return StoreStats(
        root=str(layout.root),
        capacity=total_bytes(probe),
        used=sum(e.size for e in entries) + held,
        free=free_bytes(probe),
        budget=budget,
        entries=len(entries),
        packed_held=held,
        partial_bytes=partial_bytes(layout),
    )
