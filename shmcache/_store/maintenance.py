"""Keeping a root sound: remove what dead writers left behind, and check entries against
the checksums recorded when they were put."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from .._disk.checksum import crc_of_range, parse_checksums
from .._disk.entry_tree import migrate_flat_links, prune_empty_prefixes
from .._disk.fs import FileLockProbe, remove_tree
from .._disk.generations import bump_all_generations
from .._disk.layout import Layout
from .._disk.writer import STAGING_SUFFIX, writer_of
from ..errors import CorruptEntryError, KeyNotFoundError
from .catalog import referenced_versions
from .locks import publish_lock
from .records import EntryInfo

__all__ = ["refuse_half_published", "remove_dead_writers_leftovers", "verify_entry"]

logger = logging.getLogger(__name__)

_STAGING_GRACE_S = 60.0
_STAGED_LINK = ".link"  # a version's link staged in tmp/ (swapped one by one before the tree)


def remove_dead_writers_leftovers(layout: Layout, evict_version: Callable[[str, str], int | None]) -> int:
    """Remove partial writes and unreferenced versions of dead writers, and entry links
    whose data vanished; move a format 1 root's flat links into the tree and remove empty
    prefix directories; returns the bytes freed.

    Partial writes of live writers are never touched: a writer's flock tells the two
    apart, whatever PID namespace the writer runs in.
    """
    freed = 0
    live: dict[str, bool] = {}
    with publish_lock(layout, shared=False):  # no writer links or copies a prefix meanwhile
        moved = migrate_flat_links(layout)
        pruned = prune_empty_prefixes(layout)
    if moved or pruned:
        logger.info("cleanup moved %d flat entry links to the tree, removed %d empty prefixes", moved, pruned)

    def alive(writer: str) -> bool:
        if writer not in live:
            live[writer] = FileLockProbe.holder_alive(layout.tmp / f"{writer}.lock")
        return live[writer]

    kept = _half_published(layout, alive)
    dead_writer = False  # one may have died switching keys, before bumping (or settling) them
    for name in os.listdir(layout.tmp):
        path = layout.tmp / name
        if name.endswith(STAGING_SUFFIX):  # a writer between creating and locking it
            if not FileLockProbe.holder_alive(path) and _age(path) > _STAGING_GRACE_S:
                freed += remove_tree(path)
        elif not alive(writer_of(name)) and writer_of(name) not in kept:
            dead_writer = True
            freed += remove_tree(path)
    dead_unreferenced = [
        v for v in os.listdir(layout.objects) if not alive(writer_of(v)) and writer_of(v) not in kept
    ]
    # Read the links only now: a dead writer can no longer link anything.
    linked = referenced_versions(layout)
    for version in dead_unreferenced:
        if version not in linked:
            freed += remove_tree(layout.version_dir(version))
    for version, key in linked.items():  # links whose version directory was removed by hand
        if not layout.version_dir(version).is_dir():
            with suppress(KeyNotFoundError, OSError):
                if evict_version(key, version) is not None:
                    logger.warning("removed entry %s: its data had vanished", key)
    if dead_writer:  # send every warm open back to the disk once
        bump_all_generations(layout)
    if freed:
        logger.info("cleanup freed %d bytes in %s", freed, layout.root)
    return freed


def verify_entry(layout: Layout, info: EntryInfo) -> bool:
    """Check an entry against the checksums recorded when it was put.

    True if they match, False if none were recorded; raises CorruptEntryError if the
    entry's bytes changed.
    """
    refuse_half_published(layout, info)
    if not info.checksum:
        return False
    for name, crc in sorted(parse_checksums(info.checksum).items()):
        try:
            fd = os.open(layout.object_file(info.version, f"{name}.npy"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KeyNotFoundError(f"entry {info.key!r} was replaced or evicted while verifying") from None
        try:
            actual = crc_of_range(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if actual != crc:
            raise CorruptEntryError(
                f"entry {info.key!r}: {name}.npy has checksum {actual:08x}, {crc:08x} was recorded "
                "when it was put; its bytes changed in memory. Evict it and put it again"
            )
    return True


def _half_published(layout: Layout, alive: Callable[[str], bool]) -> set[str]:
    """Dead writers that left a directory half published: some of their versions linked,
    others still staged (``tmp/<version>.link``). Only shmcache before the tree format
    (which swapped a directory's links one by one) leaves that. What shows it (their lock
    file, staged links and unlinked versions) is kept, so that ``verify`` names the mixed
    entries, until the directory is put again."""
    staged = {writer_of(n) for n in os.listdir(layout.tmp) if n.endswith(_STAGED_LINK)}
    dead = {writer for writer in staged if not alive(writer)}
    if not dead:
        return set()
    half: dict[str, list[str]] = {}
    for version, key in referenced_versions(layout).items():
        if writer_of(version) in dead:
            half.setdefault(writer_of(version), []).append(key)
    for keys in half.values():
        logger.warning(
            "%d entries (%s...) are the half of a directory put that an older shmcache published "
            "before it was killed: the directory mixes old and new entries; put it again "
            "(overwrite=True / --overwrite)", len(keys), min(keys),
        )
    return set(half)


def refuse_half_published(layout: Layout, info: EntryInfo) -> None:
    """Raise :class:`CorruptEntryError` if the entry belongs to a directory that an older
    shmcache left half published (see ``_half_published``). One ``stat`` when it does not."""
    writer = writer_of(info.version)
    lock = layout.tmp / f"{writer}.lock"
    if not lock.exists() or FileLockProbe.holder_alive(lock):
        return
    if any(writer_of(n) == writer and n.endswith(_STAGED_LINK) for n in os.listdir(layout.tmp)):
        raise CorruptEntryError(
            f"entry {info.key!r} is part of a directory put that an older shmcache published only "
            "in part before it was killed: the directory mixes old and new entries; put the "
            "directory again (overwrite=True / --overwrite)"
        )


def _age(path: Path) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0
