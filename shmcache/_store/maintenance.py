"""Keeping a root sound: remove what dead writers left behind, and check entries against
the checksums recorded when they were put."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from .._disk.checksum import crc_of_range, parse_checksums
from .._disk.dtypes import dtype_name
from .._disk.entry_tree import MIGRATING_PREFIX, migrate_flat_links, prune_empty_prefixes
from .._disk.fs import FileLockProbe, remove_tree
from .._disk.generations import bump_all_generations
from .._disk.layout import MANIFEST_FILE, META_FILE, PACKED_GUARD, Layout, packed_range
from .._disk.manifest import clear_live, live_entries, open_packed, split_batch_version
from .._disk.meta import EntryMeta, damaged, read_entry_meta
from .._disk.npy import NpyHeader, header_length, parse_header_bytes
from .._disk.shapes import checked_shape
from .._disk.writer import STAGING_SUFFIX, writer_of
from ..errors import CorruptEntryError, KeyNotFoundError, ShmCacheError
from .catalog import referenced_versions
from .locks import publish_lock
from .reading import Reader
from .writing import remove_batch_if_empty, remove_versions

__all__ = [
    "linked_keys",
    "refuse_half_published",
    "remove_dead_partials",
    "remove_dead_writers_leftovers",
    "verify_entry",
]

logger = logging.getLogger(__name__)

_STAGING_GRACE_S = 60.0
_HEAD = 4096  # the first read of a file's header (nearly always all of it)
_STAGED_LINK = ".link"  # a version's link staged in tmp/ (swapped one by one before the tree)


def remove_dead_writers_leftovers(layout: Layout, evict_version: Callable[[str, str], int | None]) -> int:
    """Remove partial writes and unreferenced versions of dead writers, and entry links
    whose data vanished; move a format 1 root's flat links into the tree and remove empty
    prefix directories; returns the bytes freed.

    Partial writes of live writers are never touched: a writer's flock tells the two
    apart, whatever PID namespace the writer runs in.
    """
    with publish_lock(layout, shared=False):  # no writer links or copies a prefix meanwhile
        moved = migrate_flat_links(layout)
        pruned = prune_empty_prefixes(layout)
    if moved or pruned:
        logger.info("cleanup moved %d flat entry links to the tree, removed %d empty prefixes", moved, pruned)

    alive = _liveness(layout)
    kept = _half_published(layout, alive)
    freed, dead_writer = _remove_dead_partials(layout, alive, kept)
    dead_unreferenced = [
        v for v in os.listdir(layout.objects) if not alive(writer_of(v)) and writer_of(v) not in kept
    ]
    # Read the links only now: a dead writer can no longer link anything.
    linked = referenced_versions(layout)
    batches = {version.partition("/")[0] for version in linked if "/" in version}
    for version in dead_unreferenced:
        if version not in linked and version not in batches:  # a batch: while any leaf points in
            freed += remove_tree(layout.version_dir(version))
    freed += _remove_unlinked_batch_entries(layout)
    for version, key in linked.items():  # links whose version directory was removed by hand
        if not _data_present(layout, version):
            with suppress(KeyNotFoundError, OSError):
                if evict_version(key, version) is not None:
                    logger.warning("removed entry %s: its data had vanished", key)
    if dead_writer:  # send every warm open back to the disk once
        bump_all_generations(layout)
    if freed:
        logger.info("cleanup freed %d bytes in %s", freed, layout.root)
    return freed


def remove_dead_partials(layout: Layout) -> int:
    """Remove the partial writes dead writers left in ``tmp/`` as ``cleanup`` does (its
    first step, with the same rules), for a writer short of room; returns the bytes freed.

    A writer's flock tells a dead writer from a live one; a lock still being created is
    kept for its grace period; a directory an older shmcache half published is kept."""
    alive = _liveness(layout)
    freed, dead_writer = _remove_dead_partials(layout, alive, _half_published(layout, alive))
    if dead_writer:
        bump_all_generations(layout)
        logger.info("removed the partial writes of dead writers in %s: %d bytes", layout.tmp, freed)
    return freed


def _liveness(layout: Layout) -> Callable[[str], bool]:
    """Whether a writer is alive (holds the flock of its ``tmp/<writer>.lock``), probed
    once per writer."""
    live: dict[str, bool] = {}

    def alive(writer: str) -> bool:
        if writer not in live:
            live[writer] = FileLockProbe.holder_alive(layout.tmp / f"{writer}.lock")
        return live[writer]

    return alive


def _remove_dead_partials(layout: Layout, alive: Callable[[str], bool], kept: set[str]) -> tuple[int, bool]:
    """Remove what dead writers (but those in ``kept``) left in ``tmp/``; returns the bytes
    freed and whether any dead writer's files were there (it may have died switching keys,
    before bumping or settling them)."""
    freed, dead_writer = 0, False
    for name in os.listdir(layout.tmp):
        path = layout.tmp / name
        if name.endswith(STAGING_SUFFIX):  # a writer between creating and locking it
            if not FileLockProbe.holder_alive(path) and _age(path) > _STAGING_GRACE_S:
                freed += remove_tree(path)
        elif name.startswith(MIGRATING_PREFIX):  # a format-1 link between its symlink and rename
            if _age(path) > _STAGING_GRACE_S:
                freed += remove_tree(path)
        elif not alive(writer_of(name)) and writer_of(name) not in kept:
            dead_writer = True
            freed += remove_tree(path)
    return freed, dead_writer


def _remove_unlinked_batch_entries(layout: Layout) -> int:
    """Remove the entries of directory puts' batches that no link points at (an evict or a
    replace killed between moving the link and removing the entry: a directory removed, a
    packed entry's live byte cleared), and batches left with their manifest alone and no
    live packed entry; returns the bytes freed. The links are read under the publish lock
    exclusive: no directory put or evict moves one during the walk, and a batch still
    being published has no link yet, so none of its entries is taken (nor the batch: its
    packed entries are live)."""
    orphans: list[str] = []
    packed: dict[str, set[int]] = {}
    root = str(layout.root)
    with publish_lock(layout, shared=False):
        linked = referenced_versions(layout)
        batches: dict[str, set[int]] = {}
        for version in linked:
            found = split_batch_version(version)
            if found is not None:
                batches.setdefault(found[0], set()).add(found[1])
        for batch, indices in batches.items():
            with suppress(OSError):
                names = os.listdir(layout.version_dir(batch))
                entries = (f"{batch}/{name}" for name in names if name not in _NOT_ENTRIES)
                orphans += [version for version in entries if version not in linked]
            with suppress(OSError, ValueError):
                unlinked = (live_entries(root, batch) or set()) - indices
                if unlinked:
                    packed[batch] = unlinked
        alone = [
            name
            for name in os.listdir(layout.objects)
            if name not in linked and name not in batches and _holds_manifest_alone(layout, name)
        ]
        for batch, indices in packed.items():  # under the lock: no link into them can appear
            clear_live(root, batch, indices)
    freed = remove_versions(layout, orphans)
    for batch in packed:
        freed += remove_batch_if_empty(layout, batch)
    for batch in alone:  # no entry left, no link into it: not a batch being published
        freed += remove_tree(layout.version_dir(batch))
    if orphans or alone or packed:
        logger.info(
            "cleanup removed %d unlinked entries of directory puts, %d empty batches",
            len(orphans) + sum(map(len, packed.values())),
            len(alone),
        )
    return freed


_NOT_ENTRIES = frozenset({MANIFEST_FILE, PACKED_GUARD})
"""What a batch directory holds beside its entries' directories."""


def _holds_manifest_alone(layout: Layout, name: str) -> bool:
    """Whether ``objects/<name>`` is a batch with no entry directory and no live packed
    entry (a damaged manifest counts none: no link points into it)."""
    try:
        names = os.listdir(layout.version_dir(name))
        if MANIFEST_FILE not in names or not _NOT_ENTRIES.issuperset(names):
            return False
    except OSError:
        return False
    try:
        return not live_entries(str(layout.root), name)
    except ValueError:
        return True


def _data_present(layout: Layout, version: str) -> bool:
    """Whether ``version``'s data is there: its directory, or a packed entry's manifest."""
    if packed_range(version) is not None:
        return os.path.isfile(layout.object_file(version.partition("/")[0], MANIFEST_FILE))
    return layout.version_dir(version).is_dir()


def linked_keys(layout: Layout) -> list[str]:
    """Every key that has an entry link, sorted, whatever state its data is in (``list``
    shows only entries whose metadata reads back: ``verify`` must also see the others)."""
    return list(layout.links_under(""))  # sorted; two links may share a version: not by version


def verify_entry(layout: Layout, key: str) -> bool:
    """Check ``key``'s entry as a whole: its link against the key its ``meta.json`` records,
    ``meta.json`` against its files (names, headers, sizes, dtype, shape), the checksum
    list for completeness and every file against it, then open it (and read its first and
    last items) the way a reader does.

    True if every checksum matches, False if none were recorded (the rest is still
    checked); :class:`~shmcache.errors.CorruptEntryError` naming the key and the fix if
    anything is wrong, :class:`~shmcache.errors.KeyNotFoundError` if there is no entry.
    """
    reader = Reader(layout)
    version = layout.entry_version(key)
    meta = None if version is None else read_entry_meta(layout, key, version)
    if version is None or meta is None:
        raise reader.not_found(key)
    refuse_half_published(layout, key, version)
    headers = _check_files(layout, key, version, meta)
    _check_meta(key, version, meta, headers)
    checked = _check_checksums(layout, key, version, meta.checksum, sorted(headers))
    _open_as_a_reader(reader, key)
    return checked


def _check_files(layout: Layout, key: str, version: str, meta: EntryMeta) -> dict[str, NpyHeader]:
    """The header of every file ``meta`` lists, each checked against the file's size; the
    files listed are exactly the ``.npy`` files there."""
    files = meta.files if meta.files is not None else ("data",) if meta.kind == "array" else None
    if not files:
        raise damaged(key, f"its {META_FILE} lists no files ({files!r:.80})")
    try:
        if packed_range(version) is not None:  # its one data.npy, inside the manifest
            present = {"data"} if _data_present(layout, version) else set()
        else:
            names = os.listdir(layout.version_dir(version))
            present = {n[: -len(".npy")] for n in names if n.endswith(".npy")}
    except FileNotFoundError:
        raise KeyNotFoundError(f"entry {key!r} was replaced or evicted while verifying") from None
    missing, extra = sorted(set(files) - present), sorted(present - set(files))
    if missing or extra:
        raise damaged(
            key,
            f"its {META_FILE} lists {', '.join(sorted(files))} but {layout.version_dir(version)} "
            f"holds {', '.join(sorted(present)) or 'no .npy file'}",
        )
    return {name: _file_header(layout, key, version, name) for name in files}


def _open_file(layout: Layout, key: str, version: str, name: str) -> tuple[int, int, int]:
    """``(descriptor, start, size)`` of file ``name`` of ``version``: a file of its own
    (start 0), or a packed entry's bytes in its batch's manifest."""
    try:
        if packed_range(version) is None:
            fd = os.open(layout.object_file(version, name), os.O_RDONLY | os.O_CLOEXEC)
            return fd, 0, os.fstat(fd).st_size
        try:
            return open_packed(str(layout.root), version)
        except ValueError as exc:
            raise damaged(key, str(exc)) from None
    except FileNotFoundError:
        raise KeyNotFoundError(f"entry {key!r} was replaced or evicted while verifying") from None


def _file_header(layout: Layout, key: str, version: str, name: str) -> NpyHeader:
    where = f"{name}.npy"
    fd, start, size = _open_file(layout, key, version, where)
    try:
        head = os.pread(fd, min(_HEAD, size), start)
        try:
            end = header_length(head, where)
            if end > len(head):
                head = os.pread(fd, min(end, size), start)
            header = NpyHeader(*parse_header_bytes(head, end, where)) if end <= len(head) else None
        except CorruptEntryError as exc:
            raise damaged(key, str(exc)) from None
        if header is None:
            raise damaged(key, f"{where} ends inside its header")
    finally:
        os.close(fd)
    try:
        checked_shape(header.shape, header.dtype.itemsize, f"{where} (its header)", CorruptEntryError)
    except CorruptEntryError as exc:
        raise damaged(key, str(exc)) from None
    if size != header.file_size:
        raise damaged(
            key,
            f"{where} holds {size} bytes, its header says {header.file_size} "
            f"({header.shape} of {header.dtype}): truncated or extended",
        )
    return header


def _check_meta(key: str, version: str, meta: EntryMeta, headers: dict[str, NpyHeader]) -> None:
    """What ``meta.json`` says of the data is what the files' headers and sizes say."""
    recorded = meta.version if meta.version is not None else version
    if recorded != version:
        raise damaged(key, f"its {META_FILE} describes version {recorded!r:.80}, not {version}")
    said: dict[str, Any] = {
        "nbytes": sum(h.nbytes for h in headers.values()),
        "size": sum(h.file_size for h in headers.values()),
    }
    if meta.kind == "array" and "data" in headers:
        data = headers["data"]
        said |= {"dtype": dtype_name(data.dtype), "shape": data.shape, "fortran_order": data.fortran_order}
    for field, actual in said.items():
        value = getattr(meta, field)
        if meta.records(field) and value != actual:  # what older entries did not record is not compared
            raise damaged(key, f"its {META_FILE} says {field} {value!r:.80}, its data {actual!r:.80}")


def _check_checksums(layout: Layout, key: str, version: str, checksum: Any, files: list[str]) -> bool:
    """Every file's CRC against the list recorded at put time, which must cover every file."""
    if not checksum:
        return False
    try:
        recorded = parse_checksums(checksum)
    except (ValueError, TypeError, AttributeError):
        raise damaged(key, f"its checksum list {checksum!r:.80} cannot be read") from None
    if sorted(recorded) != files:
        raise damaged(
            key,
            f"its checksum list covers {', '.join(sorted(recorded))} but it holds {', '.join(files)}: "
            f"{META_FILE} was edited",
        )
    for name, crc in sorted(recorded.items()):
        fd, start, size = _open_file(layout, key, version, f"{name}.npy")
        try:
            actual = crc_of_range(fd, start, size)
        finally:
            os.close(fd)
        if actual != crc:
            raise damaged(
                key,
                f"{name}.npy has checksum {actual:08x}, {crc:08x} was recorded when it was put; "
                "its bytes changed in memory",
            )
    return True


def _open_as_a_reader(reader: Reader, key: str) -> None:
    """Open the entry as ``open`` does, and read its first and last items (a container's
    parts are only decoded then): what a reader would meet, met now."""
    try:
        opened = reader.open(key, raw=True)  # bfloat16 as bits: verify needs no ml_dtypes
        if isinstance(opened, Mapping):
            names = list(opened)
            for name in names[:1] + names[-1:]:
                opened[name]
        elif isinstance(opened, Sequence) and len(opened):
            opened[0]
            opened[len(opened) - 1]
    except ShmCacheError:
        raise
    except Exception as exc:  # whatever decoding damaged parts raises
        raise damaged(key, f"reading it fails ({type(exc).__name__}: {exc})") from None
    finally:
        reader.forget()


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


def refuse_half_published(layout: Layout, key: str, version: str) -> None:
    """Raise :class:`CorruptEntryError` if the entry belongs to a directory that an older
    shmcache left half published (see ``_half_published``). One ``stat`` when it does not."""
    writer = writer_of(version)
    lock = layout.tmp / f"{writer}.lock"
    if not lock.exists() or FileLockProbe.holder_alive(lock):
        return
    if any(writer_of(n) == writer and n.endswith(_STAGED_LINK) for n in os.listdir(layout.tmp)):
        raise CorruptEntryError(
            f"entry {key!r} is part of a directory put that an older shmcache published only "
            "in part before it was killed: the directory mixes old and new entries; put the "
            "directory again (overwrite=True / --overwrite)"
        )


def _age(path: Path) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0
