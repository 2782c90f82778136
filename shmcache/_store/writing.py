"""Writing entries: new versions are written in ``tmp/``, described in ``meta.json`` from
the headers already in hand (never re-read), and published under each key's lock."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._disk.checksum import crc32, format_checksums
from .._disk.dtypes import dtype_name
from .._disk.entry_tree import common_prefix, crash_point, migrate_flat_links
from .._disk.fs import remove_tree
from .._disk.generations import bump_generations, key_generation_slots, mark_changing
from .._disk.layout import ARRAY_FILE, MANIFEST_FILE, PACKED_GUARD, Layout, packed_range
from .._disk.manifest import (
    PACK_MAX,
    ManifestWriter,
    clear_live,
    live_entries,
    read_manifest_keys,
    split_batch_version,
)
from .._disk.meta import META_FORMAT, read_meta
from .._disk.npy import NpyHeader
from .._disk.writer import VersionWriter
from .._sources.blobs import BlobSources, Progress, tree_fingerprint, write_bytes
from .._sources.files import read_planned
from .._sources.planned import Planned
from .._sources.source_files import RACY_JSON, check_unchanged, reopen
from ..errors import KeyExistsError
from .copy_pool import copy_threads, run_copies
from .locks import key_locks, publish_lock
from .ownership import current_owner

__all__ = [
    "ITEM_TYPES",
    "array_line",
    "batch_common",
    "ensure_tree_format",
    "pack_blobs",
    "publish",
    "publish_batch",
    "remove_batch_if_empty",
    "remove_versions",
    "version_meta",
    "versions_of",
    "write_batch",
    "write_container",
]

logger = logging.getLogger(__name__)

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
        "owner_uid": current_owner(),
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
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)  # "bfloat16" for its stored bits
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
    (taken in sorted order), check them all and promote every version. One key: rename
    its link into place under the root's publish lock shared. Several (a directory put):
    under that lock exclusive, build a copy of their common prefix directory with the new
    links and exchange it with the live one (``entry_tree``), so that every reader, one
    opening a single key too, sees the whole old set or the whole new one, whenever the
    writer dies. Then bump the generations of those keys once, and remove replaced
    versions (processes that map them keep reading them)."""
    published = changing = False
    replaced: dict[str, str] = {}
    keys = [key for key, _ in versions]
    ensure_tree_format(layout)
    try:
        with key_locks(layout, keys, lock_timeout):
            for key in keys:  # before anything is promoted: a conflict publishes nothing
                old = layout.entry_version(key)
                if old is not None:
                    if not overwrite:
                        raise KeyExistsError(f"entry {key!r} was published by another process meanwhile")
                    replaced[key] = old
            for _, version in versions:
                writer.promote(version)
            if len(versions) == 1:
                ((key, version),) = versions
                staged = writer.stage_link(version, key)
                with publish_lock(layout, shared=True):
                    writer.swap_link(key, version, staged)
            else:
                with publish_lock(layout, shared=False):
                    mark_changing(layout, keys)
                    changing = True
                    writer.swap_tree(common_prefix(keys), versions)
            published = True
    finally:
        _settle(layout, writer, keys, changing, published, replaced)


def write_batch(
    writer: VersionWriter,
    plan: Sequence[Planned],
    pin: bool,
    advance: Callable[[int], None],
    copy: Callable[[Planned, int, str, Callable[[int], None]], int],
    *,
    threads: int | None = None,
) -> str:
    """Write every planned entry of a directory put into one new batch version, then its
    manifest; returns the batch (``item.version`` set on each). A small ``.npy`` (at most
    ``PACK_MAX`` bytes, a byte copy) is packed into the manifest (version
    ``<batch>/<n>.<offset>.<length>``, streamed there as it is read: no directory and no
    file per entry); any other in ``<batch>/<n>/`` (no ``meta.json``), copied by ``copy``
    (``_sources.files.copy_planned``; the target it is given is a ``str``: no ``Path`` per
    entry). Those are made relative to the batch's directory (``BatchEntries``), by
    several threads for a big batch of byte copies (``copy_pool``: ``threads``, default
    ``copy_threads`` of them; 1: this thread alone); the manifest lists every entry in
    plan order either way, and ``advance`` is called from this thread only."""
    batch = writer.new_batch()
    lines = [b""] * len(plan)
    fd = writer.create_file(batch, MANIFEST_FILE)
    try:
        manifest = ManifestWriter(fd, str(writer.path(batch, MANIFEST_FILE)), len(plan))
        apart = _pack_small(manifest, plan, batch, lines, advance)
        if len(apart) < len(plan):  # some packed: keep an older shmcache's evict off the batch
            writer.make_dir(batch, PACKED_GUARD)
        if apart:
            _write_apart(writer, batch, plan, apart, lines, pin, advance, copy, threads)
        manifest.finish(batch_common(pin), lines)
    finally:
        os.close(fd)
    return batch


def _pack_small(
    manifest: ManifestWriter,
    plan: Sequence[Planned],
    batch: str,
    lines: list[bytes],
    advance: Callable[[int], None],
) -> list[int]:
    """Pack the plan's small byte copies into ``manifest`` (their versions and manifest
    lines set); returns the indices of the others, written apart. Little Python per file
    (at 100,000 files each attribute and call counts): each entry's line formatted here
    (what :func:`array_line` writes, what depends on the header alone found once per
    header), its bytes packed a chunk at a time (:func:`_pack_chunk`: at most
    :data:`_PACK_CHUNK` entries, about :data:`_PACK_BYTES` bytes), progress reported so."""
    apart: list[int] = []
    last, small, described = None, False, ""
    prefix = f"{batch}/"
    indices: list[int] = []
    items: list[Planned] = []
    datas: list[bytes] = []
    crcs: list[int] = []
    gathered = held = 0
    for index, item in enumerate(plan):
        header = item.header
        if header is not last:  # a directory's files share a few header objects
            last, small = header, header.file_size <= PACK_MAX
            described = _described(header) if small else ""
        if not small or item.container is not None or item.write is not None or item.copy_offset is None:
            apart.append(index)
            continue
        data = item.data
        if data is not None:  # read whole when checked, a snapshot (read_planned, inline)
            item.data = None
            crc = crc32(data)
            gathered += len(data)
        else:
            data, crc = read_planned(item, advance)
        file = item.file
        racy = RACY_JSON if file.racy else ""  # changed just before it was read: never current
        lines[index] = (  # the source escaped after, if one of the chunk's needs it
            f'{{"key":"{item.key}",{described}{crc:08x}","source":"{item.source}",'
            f'"source_fingerprint":{{"size":{file.size},"mtime_ns":{file.mtime_ns}{racy}}}}}\n'
        ).encode("utf-8", "surrogatepass")  # a path not UTF-8 (a lone surrogate): escaped below
        indices.append(index)
        items.append(item)
        datas.append(data)
        crcs.append(crc)
        held += len(data)
        if held >= _PACK_BYTES or len(datas) >= _PACK_CHUNK:
            _pack_chunk(manifest, prefix, lines, indices, items, datas, crcs)
            indices, items, datas, crcs = [], [], [], []
            advance(gathered)
            gathered = held = 0
    if datas:
        _pack_chunk(manifest, prefix, lines, indices, items, datas, crcs)
    if gathered:
        advance(gathered)
    return apart


_PACK_CHUNK = 4096
"""Entries :func:`_pack_small` packs at a time at most (4 MiB of 1 KiB files) ..."""
_PACK_BYTES = 4 << 20
"""... or fewer, once they hold this many bytes: what a chunk holds stays a few MiB (its
bytes, their join, the writer's buffer: 4,096 files of 60 KiB held 767 MiB at once), and
progress, where a daemon paces a put and cancels it, comes every few MiB."""


def _pack_chunk(
    manifest: ManifestWriter,
    prefix: str,
    lines: list[bytes],
    indices: list[int],
    items: list[Planned],
    datas: list[bytes],
    crcs: list[int],
) -> None:
    """Pack ``datas`` (entries ``indices`` of the plan, ``items``) into ``manifest`` and
    set their versions (``prefix`` is the batch's, with its slash); their lines again with
    their sources escaped if one of them needs it (a quote, a backslash, not printable
    ASCII: rare)."""
    for item, version in zip(items, manifest.add_all(indices, datas, prefix), strict=True):
        item.version = version
    if not _plain_json("".join([item.source for item in items])):
        for index, item, crc in zip(indices, items, crcs, strict=True):
            lines[index] = array_line(item.key, item.header, crc, item.source, item.file.fingerprint_json)


def _plain_json(text: str) -> bool:
    """Whether ``text`` goes into a JSON string as it is (printable ASCII, no quote or
    backslash)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _json_text(text: str) -> str:
    """``text`` escaped for a JSON string (between its quotes)."""
    return text if _plain_json(text) else json.dumps(text)[1:-1]


def _write_apart(
    writer: VersionWriter,
    batch: str,
    plan: Sequence[Planned],
    apart: Sequence[int],
    lines: list[bytes],
    pin: bool,
    advance: Callable[[int], None],
    copy: Callable[[Planned, int, str, Callable[[int], None]], int],
    threads: int | None,
) -> None:
    """Write the entries ``apart`` of the plan into directories of their own, ``<batch>/<n>/``."""
    with writer.batch_entries(batch) as entries:

        def write_entry(at: int, add: Callable[[int], None]) -> None:
            index = apart[at]
            item = plan[index]
            item.version = entries.new_entry(index)
            if item.container is not None:  # decoded when checked: HDF5 variable-length strings
                meta = write_container(writer, item, pin, add, copy, with_meta_file=False)
                meta.pop("version")
                lines[index] = json.dumps(meta).encode() + b"\n"
                return
            dst = entries.create_file(index, ARRAY_FILE)
            try:
                crc = copy(item, dst, entries.path(index, ARRAY_FILE), add)
            finally:
                os.close(dst)
            lines[index] = array_line(item.key, item.header, crc, item.source, item.file.fingerprint_json)

        subset = [plan[index] for index in apart]
        workers = copy_threads(subset) if threads is None else threads
        if workers > 1:
            run_copies(len(apart), write_entry, workers, advance)
        else:
            for at in range(len(apart)):
                write_entry(at, advance)


def publish_batch(
    layout: Layout,
    writer: VersionWriter,
    batch: str,
    versions: Sequence[tuple[str, str]],
    *,
    overwrite: bool,
    lock_timeout: float | None,
) -> None:
    """Publish a directory put written as one batch version (``tmp/<batch>/``, entries
    ``<batch>/<n>`` and their ``manifest``), all or none: under the locks of all its keys,
    one rename moves the batch into ``objects/``; then under the publish lock exclusive
    the keys' slots are marked changing, a copy of their common prefix directory is built
    with the new links (what each key held is read from that copy: a key that has an
    entry refuses the put unless ``overwrite``), and exchanged with the live one. Then the
    generations are settled once and the replaced versions removed."""
    keys = [key for key, _ in versions]
    published = changing = False
    replaced: dict[str, str] = {}

    def refuse(found: dict[str, str]) -> None:
        if found and not overwrite:
            raise KeyExistsError(f"entry {min(found)!r} was published by another process meanwhile")

    ensure_tree_format(layout)
    slots = key_generation_slots(keys)  # once: marked, then bumped
    try:
        with key_locks(layout, keys, lock_timeout):
            writer.promote(batch)
            crash_point("batch-promoted")
            with publish_lock(layout, shared=False):
                mark_changing(layout, keys, slots)
                changing = True
                replaced = writer.swap_tree(common_prefix(keys), versions, refuse, batch)
            published = True
    finally:
        _settle(layout, writer, keys, changing, published, replaced, slots)


def _settle(
    layout: Layout,
    writer: VersionWriter,
    keys: Sequence[str],
    changing: bool,
    published: bool,
    replaced: Mapping[str, str],
    slots: frozenset[int] | None = None,
) -> None:
    """After a publish, whatever its outcome: settle the keys' generations if any link may
    have moved (or their slots were marked changing); once published, remove the old tree
    copies and the versions the keys held before (``replaced``: key -> version), those
    that record these keys only (:func:`versions_of`). ``slots``: the keys' generation
    slots, if computed already."""
    if published or changing:
        bump_generations(layout, keys, slots)
    if published:
        writer.remove_old_trees()
        remove_versions(layout, versions_of(layout, replaced))


def versions_of(layout: Layout, replaced: Mapping[str, str]) -> list[str]:
    """The versions of ``replaced`` (key -> the version its link pointed at) that record
    that key, as ``evict`` checks before removing: a link damaged to point at another
    entry's version must not take that version with it. Metadata without a key (older
    entries) is the key's; a version whose record cannot be read is kept (``cleanup``
    removes what no link points at). One ``meta.json`` read per version of its own, one
    opening of each batch's manifest for its entries."""
    owned: list[str] = []
    in_batches: dict[str, dict[int, tuple[str, str]]] = {}
    for key, version in replaced.items():
        found = split_batch_version(version)
        if found is not None:
            in_batches.setdefault(found[0], {})[found[1]] = (key, version)
            continue
        meta = read_meta(layout, version)
        if meta is not None and meta.key in (None, key):
            owned.append(version)
    for batch, entries in in_batches.items():
        try:
            recorded = read_manifest_keys(str(layout.root), batch, entries)
        except ValueError:  # a damaged manifest: its entries stay for cleanup
            continue
        for index, (key, version) in entries.items():
            if index in recorded and recorded[index] in (None, key):
                owned.append(version)
    return owned


def remove_versions(layout: Layout, versions: Iterable[str]) -> int:
    """Remove published versions no link points at any more; returns the bytes freed
    (processes that map their files keep reading them). An entry of a directory put
    (``<batch>/<n>``) is its own directory; a packed one (``<batch>/<n>.<offset>.<length>``)
    has its live byte in the manifest cleared (its bytes stay: a process that mapped them
    keeps reading them). The batch and its manifest go with the last of its entries (a
    directory's link count and the live bitmap tell, without listing the batch)."""
    freed = 0
    batches: set[str] = set()
    packed: dict[str, list[int]] = {}
    root = str(layout.root)
    for version in versions:
        batch, slash, _ = version.partition("/")
        if slash:
            batches.add(batch)
            span = packed_range(version)
            if span is not None:
                packed.setdefault(batch, []).append(span[1])
                continue
        freed += remove_tree(layout.version_dir(version))
    for batch in batches:
        live = clear_live(root, batch, packed[batch]) if batch in packed else None
        freed += remove_batch_if_empty(layout, batch, live)
    return freed


def remove_batch_if_empty(layout: Layout, batch: str, live: int | None = None) -> int:
    """Remove ``objects/<batch>`` if no entry directory is left in it and no packed entry
    is live (``live``: how many live bytes its manifest holds, as :func:`clear_live` just
    counted; None: read them). Two evicters of its last entries both see it empty, or
    the later one does: it never stays behind (on a file system whose directories count
    no links, ``cleanup`` removes it); removing it twice is harmless."""
    path = layout.version_dir(batch)
    try:
        # 2 + one per subdirectory (tmpfs, ext4, xfs): <n>/ and the PACKED_GUARD
        if os.stat(path).st_nlink > 3:
            return 0
        names = os.listdir(path)
    except FileNotFoundError:
        return 0
    if any(name != MANIFEST_FILE and name != PACKED_GUARD for name in names):
        return 0
    if live is None:
        try:
            found = live_entries(str(layout.root), batch)
        except ValueError:  # damaged: cleanup's to judge
            return 0
        live = 0 if found is None else len(found)
    if live:
        return 0
    return remove_tree(path)


def batch_common(pin: bool) -> dict[str, Any]:
    """What every array entry of a directory put shares: its manifest's common object."""
    return {
        "format": META_FORMAT,
        "kind": "array",
        "files": ["data"],
        "created": time.time(),
        "pinned": pin,
        "owner_uid": current_owner(),
    }


def array_line(key: str, header: NpyHeader, crc: int, source: str, fingerprint: str) -> bytes:
    """The manifest object of an array entry copied from a ``.npy`` (what its ``meta.json``
    would hold beyond :func:`batch_common`), encoded with a newline: formatted directly
    (``json.dumps`` of a dict costs several times more, per file of a batch), and what
    depends on the header only (dtype, shape, sizes) formatted once per distinct header
    (the files of a folder share a few; found by identity first: a plan shares one header
    object between the files with the same header bytes, and hashing a header costs more
    than the rest of the line). ``fingerprint``: the source's fingerprint as JSON members
    (``SourceFile.fingerprint_json``)."""
    global _LAST_DESCRIBED
    last = _LAST_DESCRIBED  # one tuple, replaced whole: consistent for a copy thread too
    if last is not None and last[0] is header:
        described = last[1]
    else:
        described = _described(header)
        _LAST_DESCRIBED = (header, described)
    source = _json_text(source)
    return (
        f'{{"key":"{key}",{described}{crc:08x}","source":"{source}","source_fingerprint":{{{fingerprint}}}}}\n'
    ).encode()


def _described(header: NpyHeader) -> str:
    """:func:`_describe` of ``header``, remembered."""
    known = _DESCRIBED.get(header)
    return _describe(header) if known is None else known


def _describe(header: NpyHeader) -> str:
    """The members of an array line that depend on the header alone, up to the checksum's
    digits; remembered."""
    shape = ",".join(map(str, header.shape))
    nbytes = header.nbytes
    described = (
        f'"dtype":{_dtype_json(header.dtype)},"shape":[{shape}],'
        f'"fortran_order":{"true" if header.fortran_order else "false"},'
        f'"nbytes":{nbytes},"size":{header.data_offset + nbytes},"checksum":"crc32:data='
    )
    if len(_DESCRIBED) > 1024:
        _DESCRIBED.clear()
    _DESCRIBED[header] = described
    return described


_DESCRIBED: dict[NpyHeader, str] = {}
_LAST_DESCRIBED: tuple[NpyHeader, str] | None = None  # the last one described, found by identity


def _dtype_json(dtype: np.dtype) -> str:
    """The JSON string of :func:`_dtype_name` (keys are plain: ``keys`` allows no quote)."""
    name = _DTYPE_JSON.get(dtype)
    if name is None:
        name = _DTYPE_JSON[dtype] = json.dumps(_dtype_name(dtype))
        if len(_DTYPE_JSON) > 1024:
            _DTYPE_JSON.clear()
    return name


_DTYPE_JSON: dict[np.dtype, str] = {}

_TREE_ROOTS: set[str] = set()
"""Roots this process has seen in the tree format (checked once per root)."""


def ensure_tree_format(layout: Layout) -> None:
    """Migrate a format 1 root's flat links into the tree before the first publish in it
    (under the publish lock exclusive: no other writer copies or links meanwhile)."""
    root = str(layout.root)
    if root in _TREE_ROOTS:
        return
    if not layout.format_file.exists():
        with publish_lock(layout, shared=False):
            moved = migrate_flat_links(layout)
        if moved:
            logger.info("moved %d entry links of %s to the tree format", moved, root)
    _TREE_ROOTS.add(root)


def write_container(
    writer: VersionWriter,
    item: Planned,
    pin: bool,
    advance: Callable[[int], None],
    copy: Callable[[Planned, int, str, Callable[[int], None]], int] | None = None,
    *,
    with_meta_file: bool = True,
) -> dict[str, Any]:
    """Write ``item.container``'s files and ``meta.json`` into ``item.version``; returns
    the metadata (``with_meta_file=False``: not written, an entry of a directory put's batch
    is described by its manifest). Its arrays were decoded from the checked file; the file
    must still be that file, unchanged. Its ``copied`` files are written by ``copy``
    (``_sources.files.copy_planned``)."""
    assert item.container is not None
    src = reopen(item.file)
    try:
        check_unchanged(src, item.file)
    finally:
        os.close(src)
    kind, crcs, headers = item.container.kind, {}, {}
    for name, array in item.container.files.items():
        crcs[name], headers[name] = writer.write_array(item.version, f"{name}.npy", array)
        advance(headers[name].file_size)
    for name, part in item.container.copied.items():
        assert copy is not None, "a container with copied files needs copy="
        target = str(writer.path(item.version, f"{name}.npy"))
        dst = writer.create_file(item.version, f"{name}.npy")
        try:
            crcs[name] = copy(part, dst, target, advance)
        finally:
            os.close(dst)
        headers[name] = part.header
    meta = version_meta(item.key, kind, item.version, headers, crcs, pin) | dict(item.container.extra)
    meta["shape"] = [meta.get("length", 0)]  # what `ls` shows, as for every container
    meta.setdefault("dtype", ITEM_TYPES.get(kind))
    meta["source"] = item.source
    meta["source_fingerprint"] = item.fingerprint
    if with_meta_file:
        writer.write_meta(item.version, meta)
    return meta


def pack_blobs(
    writer: VersionWriter,
    key: str,
    plan: BlobSources,
    pin: bool,
    progress: Progress | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write a new version holding ``plan`` (room reserved already); returns its meta."""
    version = writer.new_version()
    crcs, headers = {}, {}
    for name, array in plan.arrays.items():
        crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
    crcs["bytes"], headers["bytes"] = write_bytes(writer, version, plan, progress, threads)
    meta = version_meta(key, "blobs", version, headers, crcs, pin)
    meta |= {"length": len(plan.names), "shape": [len(plan.names)], "dtype": ITEM_TYPES["blobs"]}
    meta["source"] = plan.source
    if plan.source is not None and plan.files is not None:  # a shard once, not once per member
        files = plan.files if plan.spans is None else list(dict.fromkeys(plan.files))
        meta["source_fingerprint"] = tree_fingerprint(files)
    writer.write_meta(version, meta)
    return meta
