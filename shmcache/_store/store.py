"""The store: publish, open, evict, list, account for and clean up entries in a root.

On-disk layout (all 0700/0600, see README "On-disk layout")::

    <root>/generation            8 bytes that change on every publish/evict
    <root>/entries/<key>         symlink -> ../objects/<version>   ("/" in keys is "~")
    <root>/objects/<version>/    data.npy + meta.json, immutable once published
    <root>/tmp/                  partial writes and the lock of each live writer
    <root>/locks/                per-key and space locks

Publishing renames a finished version into ``objects/`` and then swaps the entry's
symlink in one ``rename``: a reader sees the old version or the new one, never a
partial one. Replaced and evicted versions are unlinked, never rewritten, so processes
that still map them keep reading them.
"""

from __future__ import annotations

import builtins
import gc
import json
import logging
import mmap
import os
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from .._containers.encode import (
    content_digest,
    encode_any,
    encode_mapping,
    encode_ragged,
    encode_records,
    encode_strings,
)
from .._containers.group import SharedGroup
from .._containers.shared import SharedMapping, SharedRagged, SharedRecords, SharedStrings, open_version
from .._disk.attach import attach_array
from .._disk.checksum import BackgroundCrc, crc_of_range, format_checksums, parse_checksums
from .._disk.fs import FileLockProbe, copy_range, free_bytes, remove_tree, total_bytes
from .._disk.keys import key_in_prefix, validate_key
from .._disk.layout import ARRAY_FILE, META_FILE, Layout, decode_key, default_root, encode_key, prepare_root
from .._disk.npy import NpyHeader, check_storable_dtype, iter_npz_members, read_source_header
from .._disk.procmaps import MappingScan, mapped_versions, scan_mappings
from .._disk.writer import STAGING_SUFFIX, VersionWriter, writer_of
from .._units import human_bytes
from ..errors import (
    CacheFullError,
    CacheRootError,
    CorruptEntryError,
    CorruptSourceError,
    InvalidSourceError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    ShmCacheError,
    SourceNotFoundError,
    UnsupportedDataError,
)
from .records import EntryInfo, PlannedEntry, StoreStats

__all__ = ["Store"]

logger = logging.getLogger(__name__)

META_FORMAT = 1
_RESOLVE_RETRIES = 100
_SWEEP_INTERVAL_S = 1.0
_STAGING_GRACE_S = 60.0
_ITEM_TYPES = {"strings": "str", "records": "json"}
_STORES: weakref.WeakSet[Store] = weakref.WeakSet()


def _forget_attachments(root: str) -> None:
    """Drop every store's cached attachments of ``root`` in this process, so that only
    arrays the program still holds keep entries mapped (and unevictable)."""
    for store in list(_STORES):
        if store._root_str == root:
            store._attached.clear()
            store._handles.clear()
    gc.collect()  # cycles could keep a dropped array (and its mapping) alive


@dataclass
class _Planned:
    """One entry a ``put_file`` call will write, validated before any byte is copied."""

    key: str
    header: NpyHeader
    source: str
    fingerprint: dict[str, int]
    copy_from: str
    copy_offset: int | None  # None: the member is compressed and must be inflated
    member: str | None = None
    version: str = field(default="")


class Store:
    """A cache root: put, open, evict, list, stats, cleanup.

    ``max_bytes`` is this store's budget: a put that would exceed it first evicts
    least-recently-used entries that are neither pinned nor mapped by a live process.
    ``lock_timeout`` bounds waits on other processes' locks (None waits forever).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root if root is not None else default_root()))
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
        ):
            raise ValueError(f"max_bytes must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.layout = Layout(self.root)
        self._root_str = str(self.root)
        self._entries_str = str(self.layout.entries)
        self._prepared = False
        self._generation: memoryview | None = None
        self._attached: dict[str, tuple[int, str, np.ndarray]] = {}
        self._handles: dict[str, tuple[int, str, Any]] = {}
        self._generation_inode = -1
        _STORES.add(self)
        self._last_sweep = 0.0

    def __repr__(self) -> str:
        return f"Store({self._root_str!r}, max_bytes={self.max_bytes!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Store, (self._root_str,), {"max_bytes": self.max_bytes, "lock_timeout": self.lock_timeout})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.max_bytes = state["max_bytes"]
        self.lock_timeout = state["lock_timeout"]

    # ------------------------------------------------------------------ reading

    def open_array(self, key: str) -> np.ndarray:
        """A read-only array over the entry's shared mapping (a plain ``ndarray``).

        Repeated opens in one process return the attached array in well under a
        microsecond until any entry of the root changes.
        """
        try:
            hit = self._attached.get(key)
        except TypeError:  # unhashable: let validation explain
            hit = None
        if hit is not None and self._generation is not None and hit[0] == self._generation[0]:
            return hit[2]
        return self._open_array_slowly(key)

    def _open_array_slowly(self, key: str) -> np.ndarray:
        # Links exist only for validated keys, and "/" <-> "~" is the only renaming, so
        # a key without "~" that resolves is valid: validate only when it does not.
        if not isinstance(key, str) or "~" in key:
            validate_key(key)
        generation = self._read_generation()
        if time.monotonic() - self._last_sweep >= _SWEEP_INTERVAL_S:
            self._sweep_stale()
        link = f"{self._entries_str}/{key.replace('/', '~')}"
        for _ in range(_RESOLVE_RETRIES):
            try:
                version = os.readlink(link).rpartition("/")[2]
            except (OSError, ValueError):  # missing, or no valid key: "", ".", NUL, too long
                validate_key(key)
                raise self._not_found(key) from None
            hit = self._attached.get(key)
            if hit is not None and hit[1] == version:
                array = hit[2]
            else:
                try:
                    array = attach_array(self._root_str, version, ARRAY_FILE, key)
                except FileNotFoundError:
                    if self.layout.objects.joinpath(version, META_FILE).exists():
                        raise self._wrong_kind(key, version, "array") from None
                    if _read_version(Path(link)) == version:
                        raise CorruptEntryError(
                            f"entry {key!r}: its data ({version}) is missing from "
                            f"{self.layout.objects}; run `shmcache cleanup` and put it again"
                        ) from None
                    continue  # replaced or evicted between readlink and open: resolve again
            self._attached[key] = (generation, version, array)
            return array
        raise ShmCacheError(f"entry {key!r} kept changing while being opened; try again")

    # Containers (strings, ragged, records, mapping) and any-kind opens.

    def open(self, key: str) -> Any:
        """Open an entry of any kind: an array, or the shared container its kind names."""
        kind = self._kind_of(key)
        return self.open_array(key) if kind == "array" else self._open_container(key, kind)

    def open_strings(self, key: str) -> SharedStrings:
        """Read-only ``Sequence[str]`` over a ``put_strings`` entry."""
        return self._open_container(key, "strings")  # type: ignore[no-any-return]

    def open_ragged(self, key: str) -> SharedRagged:
        """Read-only sequence of arrays over a ``put_ragged`` entry."""
        return self._open_container(key, "ragged")  # type: ignore[no-any-return]

    def open_records(self, key: str) -> SharedRecords:
        """Read-only sequence of freshly decoded records over a ``put_records`` entry."""
        return self._open_container(key, "records")  # type: ignore[no-any-return]

    def open_mapping(self, key: str) -> SharedMapping:
        """Read-only ``Mapping[str, X]`` over a ``put_mapping`` entry."""
        return self._open_container(key, "mapping")  # type: ignore[no-any-return]

    def open_group(self, prefix: str) -> SharedGroup:
        """Lazy read-only ``Mapping`` of every entry under ``prefix`` (relative names)."""
        validate_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)
        return SharedGroup(self, prefix.rstrip("/"))

    def _kind_of(self, key: str) -> str:
        validate_key(key)
        version = _read_version(self.layout.entries / encode_key(key))
        if version is None:
            raise self._not_found(key)
        return str(self._read_meta(version).get("kind", "array"))

    def _open_container(self, key: str, kind: str) -> Any:
        hit = self._handles.get(key) if isinstance(key, str) else None
        if (
            hit is not None
            and self._generation is not None
            and hit[0] == self._generation[0]
            and hit[2]._ref.kind == kind
        ):
            return hit[2]
        validate_key(key)
        generation = self._read_generation()
        link = self.layout.entries / encode_key(key)
        for _ in range(_RESOLVE_RETRIES):
            version = _read_version(link)
            if version is None:
                raise self._not_found(key)
            if hit is not None and hit[1] == version and hit[2]._ref.kind == kind:
                handle = hit[2]
            else:
                try:
                    handle = self.open_version(key, version, kind)
                except KeyNotFoundError:
                    continue  # replaced or evicted meanwhile: resolve again
            self._handles[key] = (generation, version, handle)
            return handle
        raise ShmCacheError(f"entry {key!r} kept changing while being opened; try again")

    def open_version(self, key: str, version: str, kind: str) -> Any:
        """Attach one version of a container entry."""
        return open_version(self._root_str, key, version, kind)

    def _read_generation(self) -> int:
        if self._generation is None:
            try:
                fd = os.open(self.layout.generation, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return -1  # nothing was ever published here
            try:
                st = os.fstat(fd)
                if st.st_size < 8:
                    return -1  # not initialised yet (prepare_root writes it atomically)
                self._generation = memoryview(mmap.mmap(fd, 8, prot=mmap.PROT_READ)).cast("Q")
                self._generation_inode = st.st_ino
            finally:
                os.close(fd)
        return int(self._generation[0])

    def _check_root_identity(self) -> None:
        """Start afresh if the root was deleted and recreated under us (the mapped
        generation file would otherwise never change again)."""
        try:
            inode = os.stat(self.layout.generation).st_ino
        except OSError:  # missing, or the root is not a directory (prepare explains)
            inode = -1
        if self._generation is not None and inode != self._generation_inode:
            self._generation = None
            self._attached.clear()
            self._handles.clear()
            self._prepared = False

    def _sweep_stale(self) -> None:
        """Drop this process's attachments to versions that are no longer current.

        Their memory can only return to the system once no process maps them.
        """
        self._last_sweep = time.monotonic()
        self._check_root_identity()
        for cache in (self._attached, self._handles):
            for key, (_, version, _) in list(cache.items()):
                if _read_version(self.layout.entries / encode_key(key)) != version:
                    cache.pop(key, None)

    def _not_found(self, key: str) -> KeyNotFoundError:
        return KeyNotFoundError(
            f"no entry {key!r} in cache {self._root_str}; put it first "
            "(shmcache.put_array / put_file, or `shmcache put`)"
        )

    def _wrong_kind(self, key: str, version: str, wanted: str) -> UnsupportedDataError:
        kind = self._read_meta(version).get("kind", "unknown")
        opener = "open_array" if kind == "array" else f"open_{kind}"
        return UnsupportedDataError(
            f"entry {key!r} holds {kind}, not {wanted}; open it with shmcache.{opener} (or shmcache.open)"
        )

    def exists(self, key: str) -> bool:
        validate_key(key)
        return os.path.lexists(f"{self._entries_str}/{encode_key(key)}")

    # ------------------------------------------------------------------ writing

    def put_array(
        self, key: str, array: Any, *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish ``array`` under ``key`` atomically; returns the new entry's info."""
        validate_key(key)
        array = _as_storable_array(array, f"array for key {key!r}")
        return self._put_entry(key, "array", {"data": array}, {}, overwrite=overwrite, pin=pin)

    def put_strings(
        self, key: str, strings: Iterable[str], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish a list of ``str`` (one UTF-8 buffer + offsets + a hash index)."""
        validate_key(key)
        files = encode_strings(strings, f"strings for key {key!r}")
        meta = {"length": len(files["offsets"]) - 1}
        return self._put_entry(key, "strings", files, meta, overwrite=overwrite, pin=pin)

    def put_ragged(
        self, key: str, arrays: Iterable[Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish arrays of one dtype that differ in their first dimension."""
        validate_key(key)
        files, meta = encode_ragged(arrays, f"arrays for key {key!r}")
        meta["length"] = len(files["offsets"]) - 1
        return self._put_entry(key, "ragged", files, meta, overwrite=overwrite, pin=pin)

    def put_records(
        self,
        key: str,
        records: Iterable[Any],
        *,
        overwrite: bool = False,
        pin: bool = False,
        allow_nan: bool = False,
    ) -> EntryInfo:
        """Publish JSON-compatible records (dicts, lists, str, numbers, bools, None).

        numpy scalars become Python numbers and tuples become lists; anything else
        (sets, bytes, arrays, custom objects, non-str keys, NaN unless ``allow_nan``)
        raises :class:`UnsupportedDataError` naming where it is in the record.
        """
        validate_key(key)
        files = encode_records(records, f"records for key {key!r}", allow_nan=allow_nan)
        meta = {"length": len(files["offsets"]) - 1}
        return self._put_entry(key, "records", files, meta, overwrite=overwrite, pin=pin)

    def put_mapping(
        self, key: str, mapping: Mapping[str, Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish a ``dict`` from str to arrays/numbers (rows or ragged), str, or records."""
        validate_key(key)
        _, files, meta = encode_mapping(mapping, f"mapping for key {key!r}")
        return self._put_entry(key, "mapping", files, meta, overwrite=overwrite, pin=pin)

    def share(self, key: str, obj: Any) -> Any:
        """Put ``obj`` in the form that fits it and return the opened shared object.

        ndarray -> array; list of str -> strings; list of equal-dtype arrays -> ragged;
        list of dicts/lists -> records; dict -> mapping. If ``key`` already holds the
        same content (many experiments sharing one dataset), it is reused, not written
        again; different content replaces it (processes reading the old version keep it).
        """
        validate_key(key)
        kind, files, meta = encode_any(obj, f"object for key {key!r}")
        digest = content_digest(kind, files)
        with self._key_lock(key, self.lock_timeout):
            version = _read_version(self.layout.entries / encode_key(key))
            if version is None or self._read_meta(version).get("content_hash") != digest:
                meta["content_hash"] = digest
                self._put_entry(key, kind, files, meta, overwrite=True, pin=False)
        return self.open(key)

    def _put_entry(
        self,
        key: str,
        kind: str,
        files: Mapping[str, np.ndarray],
        extra: Mapping[str, Any],
        *,
        overwrite: bool,
        pin: bool,
    ) -> EntryInfo:
        """Write ``files`` as ``<name>.npy`` in a new version and publish it atomically."""
        self._refuse_existing([key], overwrite)
        nbytes = sum(int(a.nbytes) for a in files.values())
        with self._writer() as writer:
            self._reserve(writer, nbytes + 4096 * (len(files) + 1), [key] if overwrite else ())
            version = writer.new_version()
            crcs = {name: writer.write_array(version, f"{name}.npy", array) for name, array in files.items()}
            meta = self._entry_meta(key, kind, version, writer, crcs, pin) | dict(extra)
            if kind != "array":  # what `ls` shows: item count, and the item type
                meta["shape"] = [meta.get("length", 0)]
                meta.setdefault("dtype", _ITEM_TYPES.get(kind))
            writer.write_meta(version, meta)
            self._publish(writer, key, version, overwrite)
        logger.info("put %s (%s, %d bytes, version %s)", key, kind, nbytes, version)
        return _entry_info(meta, meta["created"])

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[str]:
        """Publish a ``.npy`` (as ``key``), an ``.npz`` (as ``key/<member>``) or a
        directory of them (as ``key/<relative path without suffix>``).

        Everything is validated before anything is copied: a truncated or corrupt file
        raises a typed error naming it and publishes nothing. Payloads are copied by the
        kernel, never through Python memory. ``progress(bytes_done, bytes_total)`` is
        called as data is copied; an exception it raises cancels the load, and nothing
        is published. Returns the published keys.
        """
        validate_key(key)
        plan = _plan_sources(key, Path(path))
        self._refuse_existing([p.key for p in plan], overwrite)
        total = sum(p.header.file_size for p in plan)
        done = 0

        def advance(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if progress is not None:
                progress(done, total)

        with self._writer() as writer:
            self._reserve(writer, total + 4096 * len(plan), [p.key for p in plan] if overwrite else ())
            if progress is not None:
                progress(0, total)
            for item in plan:
                item.version = writer.new_version()
                crc = self._copy_planned(writer, item, advance)
                meta = self._entry_meta(item.key, "array", item.version, writer, {"data": crc}, pin)
                meta["source"] = item.source
                meta["source_fingerprint"] = item.fingerprint
                writer.write_meta(item.version, meta)
            for item in plan:
                self._publish(writer, item.key, item.version, overwrite)
        logger.info("put %s from %s (%d entries, %d bytes)", key, path, len(plan), total)
        return [p.key for p in plan]

    def plan_file(self, key: str, path: str | os.PathLike[str]) -> builtins.list[PlannedEntry]:
        """What ``put_file(key, path)`` would publish, validated (headers, dtypes, key
        names) without copying anything: a dry run for callers that must answer early."""
        validate_key(key)
        return [
            PlannedEntry(p.key, p.source, p.copy_from, p.header.file_size)
            for p in _plan_sources(key, Path(path))
        ]

    def prepare(self) -> None:
        """Create the root and its directories (0700) now rather than on the first put."""
        self._check_root_identity()
        self._prepare()

    def cache(
        self, key: str, loader: Callable[[], Any], *, timeout: float | None = None
    ) -> np.ndarray:
        """Get-or-create: open ``key``, or run ``loader`` once across all processes.

        Concurrent callers wait on the key's lock and then open what the first one
        published. If the loading process dies, the kernel releases its lock and the
        next waiter loads instead; nothing partial is ever visible.
        """
        try:
            return self.open_array(key)
        except KeyNotFoundError:
            pass
        with self._key_lock(key, timeout):
            try:
                return self.open_array(key)
            except KeyNotFoundError:
                pass
            self.put_array(key, loader())
        return self.open_array(key)

    def _refuse_existing(self, keys: list[str], overwrite: bool) -> None:
        if overwrite:
            return
        for key in keys:
            if self.exists(key):
                raise KeyExistsError(
                    f"entry {key!r} already exists in {self._root_str}; pass overwrite=True "
                    "(--overwrite) to replace it, or evict it first"
                )

    def _entry_meta(
        self, key: str, kind: str, version: str, writer: VersionWriter, crcs: dict[str, int], pin: bool
    ) -> dict[str, Any]:
        """Metadata of a version, read back from the headers of the files as written."""
        headers = {}
        size = 0
        names = sorted(crcs)
        for name in names:
            path = writer.path(version, f"{name}.npy")
            with open(path, "rb") as fp:
                file_size = os.fstat(fp.fileno()).st_size
                headers[name] = read_source_header(fp, file_size, str(path))
            size += file_size
        meta: dict[str, Any] = {
            "format": META_FORMAT,
            "key": key,
            "kind": kind,
            "version": version,
            "files": names,
            "nbytes": sum(h.nbytes for h in headers.values()),
            "size": size,
            "created": time.time(),
            "pinned": pin,
            "source": None,
            "source_fingerprint": None,
            "checksum": format_checksums(crcs),
        }
        if kind == "array":
            data = headers["data"]
            meta |= {"dtype": str(data.dtype), "shape": list(data.shape), "fortran_order": data.fortran_order}
        return meta

    def _copy_planned(self, writer: VersionWriter, item: _Planned, advance: Callable[[int], None]) -> int:
        """Copy one planned ``.npy`` into the version; returns its CRC-32."""
        target = writer.path(item.version, ARRAY_FILE)
        dst = writer.create_file(item.version, ARRAY_FILE)
        try:
            if item.copy_offset is None:
                return _inflate_member(item, dst, target, advance)
            # The kernel copies while another thread checksums the same (cached) bytes.
            crc = BackgroundCrc(item.copy_from, item.copy_offset, item.header.file_size)
            src = os.open(item.copy_from, os.O_RDONLY | os.O_CLOEXEC)
            try:
                copy_range(src, dst, item.copy_offset, item.header.file_size, target, advance)
                return crc.result()
            except EOFError as exc:
                raise CorruptSourceError(f"{item.source}: {exc} (did it change while loading?)") from exc
            finally:
                os.close(src)
                with suppress(BaseException):
                    crc.result()
        finally:
            os.close(dst)

    def verify(self, key: str) -> bool:
        """Check an entry against the checksums recorded when it was put.

        True if they match, False if none were recorded; raises CorruptEntryError if
        the entry's bytes changed.
        """
        info = self.info(key)
        if not info.checksum:
            return False
        expected = parse_checksums(info.checksum)
        for name, crc in sorted(expected.items()):
            path = self.layout.objects / info.version / f"{name}.npy"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise KeyNotFoundError(f"entry {key!r} was replaced or evicted while verifying") from None
            try:
                actual = crc_of_range(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            if actual != crc:
                raise CorruptEntryError(
                    f"entry {key!r}: {name}.npy has checksum {actual:08x}, {crc:08x} was recorded "
                    "when it was put; its bytes changed in memory. Evict it and put it again"
                )
        return True

    @contextmanager
    def _writer(self) -> Iterator[VersionWriter]:
        self._check_root_identity()
        self._prepare()
        try:
            writer = VersionWriter(self.layout)
        except FileNotFoundError:  # the root was removed after we prepared it
            self._prepared = False
            self._prepare()
            writer = VersionWriter(self.layout)
        with writer:
            yield writer

    def _prepare(self) -> None:
        if not self._prepared:
            prepare_root(self.root)
            self._prepared = True

    def _key_lock(self, key: str, timeout: float | None) -> Any:
        self._prepare()
        lock = FileLock(self.layout.locks / f"{encode_key(key)}.lock", mode=0o600, is_singleton=True)
        return _acquired(lock, -1 if timeout is None else timeout, f"key {key!r}")

    def _space_lock(self) -> Any:
        lock = FileLock(self.layout.locks / "space.lock", mode=0o600, is_singleton=True)
        return _acquired(lock, -1 if self.lock_timeout is None else self.lock_timeout, "space accounting")

    def _publish(self, writer: VersionWriter, key: str, version: str, overwrite: bool) -> None:
        """Make ``version`` the entry of ``key`` with one atomic rename."""
        link = self.layout.entries / encode_key(key)
        target = f"../objects/{version}"
        with self._key_lock(key, self.lock_timeout):
            writer.promote(version)
            old = _read_version(link)
            if old is not None and not overwrite:
                raise KeyExistsError(f"entry {key!r} was published by another process meanwhile")
            staged = self.layout.tmp / f"{version}.link"
            os.symlink(target, staged)
            os.replace(staged, link)
            writer.mark_published(version)
            self._bump_generation()
            if old is not None:
                remove_tree(self.layout.objects / old)

    def _bump_generation(self) -> None:
        fd = os.open(self.layout.generation, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, os.urandom(8), 0)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ space

    def _reserve(self, writer: VersionWriter, nbytes: int, replacing: Collection[str] = ()) -> None:
        """Check room for ``nbytes`` (evicting for the budget if needed), then record it.

        Entries under ``replacing`` keys are about to be replaced: their bytes do not
        count against the budget.
        """
        with self._space_lock():
            if self.max_bytes is not None:
                self._make_room_in_budget(nbytes, writer, set(replacing))
            free = free_bytes(self.root)
            if nbytes > free:
                raise CacheFullError(
                    f"need {human_bytes(nbytes)} but the file system of {self._root_str} has only "
                    f"{human_bytes(free)} free (of {human_bytes(total_bytes(self.root))}); evict entries "
                    "(`shmcache evict`) or enlarge /dev/shm (Docker: --shm-size or --ipc=host)"
                )
            writer.reserve(nbytes)

    def _make_room_in_budget(self, nbytes: int, writer: VersionWriter, replacing: set[str]) -> None:
        assert self.max_bytes is not None
        entries = [e for e in self._iter_infos() if e.key not in replacing]
        used = sum(e.size for e in entries) + self._reserved_by_others(writer)
        excess = used + nbytes - self.max_bytes
        if excess <= 0:
            return
        _forget_attachments(self._root_str)  # our cache alone must not pin entries
        mapped = mapped_versions(self.layout.objects)
        candidates = sorted(
            (e for e in entries if not e.pinned and e.version not in mapped),
            key=lambda e: e.last_used,
        )
        if sum(e.size for e in candidates) < excess:
            pinned = [e.key for e in entries if e.pinned]
            busy = [e.key for e in entries if e.version in mapped]
            raise CacheFullError(
                f"need {human_bytes(nbytes)} within the budget of {human_bytes(self.max_bytes)}, "
                f"{human_bytes(used)} used; only {human_bytes(sum(e.size for e in candidates))} could be "
                f"evicted. Pinned: {_names(pinned)}; mapped by live processes: {_names(busy)}"
            )
        for entry in candidates:
            if excess <= 0:
                break
            # Never wait for a key lock while holding the space lock: a cache() loader holds
            # its key lock and then waits for the space lock (lock-order deadlock).
            if self._evict_version(entry.key, entry.version, wait=False) is not None:
                logger.info("evicted %s (%d bytes) to stay within the budget", entry.key, entry.size)
                excess -= entry.size
        if excess > 0:
            raise CacheFullError(
                f"need {human_bytes(nbytes)} within the budget of {human_bytes(self.max_bytes)}; "
                f"{human_bytes(excess)} could not be freed because the entries to evict were being "
                "replaced or loaded by other processes; try again"
            )

    def _reserved_by_others(self, writer: VersionWriter) -> int:
        reserved = 0
        for lock in self.layout.tmp.glob("*.lock"):
            if lock == writer.lock_path or not FileLockProbe.holder_alive(lock):
                continue
            with suppress(OSError, ValueError):
                reserved += int(lock.read_text() or 0)
        return reserved

    # ------------------------------------------------------------------ evict, list, stats

    def evict(self, key: str) -> int:
        """Remove an entry (pinned or not); returns the bytes released.

        Processes that map it keep reading their version; its memory returns to the
        system when the last of them lets go.
        """
        validate_key(key)
        version = _read_version(self.layout.entries / encode_key(key))
        freed = None if version is None else self._evict_version(key, version)
        if freed is None:
            raise self._not_found(key)
        logger.info("evicted %s (%d bytes)", key, freed)
        return freed

    def _evict_version(self, key: str, version: str, wait: bool = True) -> int | None:
        """Unlink ``key`` if it still points at ``version`` and return the bytes freed;
        None if it no longer does (or, with ``wait=False``, if its lock is taken)."""
        link = self.layout.entries / encode_key(key)
        try:
            lock = self._key_lock(key, self.lock_timeout if wait else 0)
            lock.__enter__()
        except LockTimeoutError:
            if wait:
                raise
            return None
        try:
            if _read_version(link) != version:
                return None
            os.unlink(link)
            self._bump_generation()
            return remove_tree(self.layout.objects / version)
        finally:
            lock.__exit__(None, None, None)

    def list(self, prefix: str | None = None) -> list[EntryInfo]:
        """Entries whose key is ``prefix`` or lies under it, sorted by key."""
        if prefix is not None and not isinstance(prefix, str):
            validate_key(prefix)  # raises InvalidKeyError naming the type
        if prefix:
            validate_key(prefix.rstrip("/"))
        return sorted(
            (e for e in self._iter_infos() if key_in_prefix(e.key, prefix)), key=lambda e: e.key
        )

    def info(self, key: str) -> EntryInfo:
        validate_key(key)
        version = _read_version(self.layout.entries / encode_key(key))
        if version is None:
            raise self._not_found(key)
        info = self._info_of(version)
        if info is None:
            raise self._not_found(key)
        return info

    def mapped_by(self, key: str) -> builtins.list[int]:
        """PIDs of live processes that map the current version of ``key`` (a ``/proc`` scan)."""
        version = self.info(key).version
        return sorted(mapped_versions(self.layout.objects).get(version, ()))

    def scan_mappings(self) -> MappingScan:
        """Which processes map which versions, and bytes still held by unlinked ones."""
        return scan_mappings(self.layout.objects)

    def stats(self) -> StoreStats:
        entries = list(self._iter_infos())
        probe = self.root
        while not probe.exists() and probe != probe.parent:  # report the file system it would be on
            probe = probe.parent
        return StoreStats(
            root=self._root_str,
            capacity=total_bytes(probe),
            used=sum(e.size for e in entries),
            free=free_bytes(probe),
            budget=self.max_bytes,
            entries=len(entries),
        )

    def _iter_infos(self) -> Iterator[EntryInfo]:
        try:
            names = os.listdir(self.layout.entries)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CacheRootError(f"cannot read cache root {self._root_str}: {exc.strerror}") from exc
        for name in names:
            version = _read_version(self.layout.entries / name)
            if version is None:
                continue
            info = self._info_of(version)
            if info is not None and info.key == decode_key(name):
                yield info

    def _info_of(self, version: str) -> EntryInfo | None:
        meta = self._read_meta(version)
        if not meta:
            return None
        first = (meta.get("files") or ["data"])[0]
        try:
            last_used = os.stat(self.layout.objects / version / f"{first}.npy").st_atime
        except FileNotFoundError:
            last_used = meta.get("created", 0.0)
        return _entry_info(meta, max(last_used, meta.get("created", 0.0)))

    def _read_meta(self, version: str) -> dict[str, Any]:
        try:
            with open(self.layout.objects / version / META_FILE, "rb") as fp:
                meta: dict[str, Any] = json.load(fp)
                return meta
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    # ------------------------------------------------------------------ cleanup

    def cleanup(self) -> int:
        """Remove what dead writers left behind; returns the bytes freed.

        Partial writes of live writers are never touched: a writer's flock tells the two
        apart, whatever PID namespace the writer runs in.
        """
        if not self.layout.tmp.is_dir():
            return 0
        self._prepare()
        freed = 0
        live: dict[str, bool] = {}

        def alive(writer: str) -> bool:
            if writer not in live:
                live[writer] = FileLockProbe.holder_alive(self.layout.tmp / f"{writer}.lock")
            return live[writer]

        for name in os.listdir(self.layout.tmp):
            path = self.layout.tmp / name
            if name.endswith(STAGING_SUFFIX):  # a writer between creating and locking it
                if not FileLockProbe.holder_alive(path) and _age(path) > _STAGING_GRACE_S:
                    freed += remove_tree(path)
            elif not alive(writer_of(name)):
                freed += remove_tree(path)
        dead_unreferenced = [
            v for v in os.listdir(self.layout.objects) if not alive(writer_of(v))
        ]
        # Read the links only now: a dead writer can no longer link anything.
        referenced = self._referenced_versions()
        for version in dead_unreferenced:
            if version not in referenced:
                freed += remove_tree(self.layout.objects / version)
        self._unlink_dangling_entries()
        if freed:
            logger.info("cleanup freed %d bytes in %s", freed, self._root_str)
        return freed

    def _unlink_dangling_entries(self) -> None:
        """Drop entry links whose version directory vanished (removed by hand)."""
        for name in os.listdir(self.layout.entries):
            version = _read_version(self.layout.entries / name)
            if version is None or (self.layout.objects / version).is_dir():
                continue
            with suppress(KeyNotFoundError, OSError):
                key = decode_key(name)
                if self._evict_version(key, version) is not None:
                    logger.warning("removed entry %s: its data had vanished", key)

    def _referenced_versions(self) -> set[str]:
        versions = set()
        for name in os.listdir(self.layout.entries):
            version = _read_version(self.layout.entries / name)
            if version is not None:
                versions.add(version)
        return versions


# ---------------------------------------------------------------------- helpers


@contextmanager
def _acquired(lock: FileLock, timeout: float, what: str) -> Iterator[None]:
    try:
        lock.acquire(timeout=timeout)
    except FileLockTimeout:
        raise LockTimeoutError(
            f"gave up after {timeout:g} s waiting for the lock on {what} held by another "
            "process; raise the timeout, or look for a stuck loading process"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _age(path: Path) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def _read_version(link: Path) -> str | None:
    try:
        return os.readlink(link).rpartition("/")[2]
    except (FileNotFoundError, OSError):
        return None


def _as_storable_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, np.ma.MaskedArray):
        raise UnsupportedDataError(f"{what} is a masked array; store .data and .mask separately")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise UnsupportedDataError(f"{what} cannot be converted to an array: {exc}") from exc
    check_storable_dtype(array.dtype, what)
    return array


def _entry_info(meta: dict[str, Any], last_used: float) -> EntryInfo:
    shape = meta.get("shape")
    return EntryInfo(
        key=meta["key"],
        kind=meta.get("kind", "array"),
        dtype=meta.get("dtype"),
        shape=tuple(shape) if shape is not None else None,
        nbytes=int(meta.get("nbytes", 0)),
        size=int(meta.get("size", 0)),
        created=float(meta.get("created", 0.0)),
        pinned=bool(meta.get("pinned", False)),
        source=meta.get("source"),
        version=meta["version"],
        last_used=last_used,
        source_fingerprint=meta.get("source_fingerprint"),
        checksum=meta.get("checksum"),
    )


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _plan_sources(key: str, path: Path) -> list[_Planned]:
    """Validate every source file under ``path`` and name the entries they become."""
    path = Path(os.path.abspath(path))
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SourceNotFoundError(f"source {path} does not exist") from None
    except OSError as exc:
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    plan = _plan_sources_unchecked(key, path, st)
    seen: dict[str, str] = {}
    for item in plan:
        if item.key in seen:
            raise InvalidSourceError(
                f"{seen[item.key]} and {item.source} would both become key {item.key!r}; "
                "rename one of them"
            )
        seen[item.key] = item.source
    return plan


def _plan_sources_unchecked(key: str, path: Path, st: os.stat_result) -> list[_Planned]:
    if path.is_dir():
        plan: list[_Planned] = []
        for file in sorted(path.rglob("*")):
            if file.suffix in (".npy", ".npz") and file.is_file():
                relative = file.relative_to(path).with_suffix("").as_posix()
                plan.extend(_plan_file(_child_key(key, relative, file), file))
        if not plan:
            raise InvalidSourceError(f"directory {path} holds no .npy or .npz files")
        return plan
    return _plan_file(key, path, st)


def _child_key(key: str, relative: str, file: Path) -> str:
    child = f"{key}/{relative}"
    try:
        return validate_key(child)
    except ShmCacheError as exc:
        raise type(exc)(f"{file}: its path does not make a valid key ({exc})") from None


def _plan_file(key: str, path: Path, st: os.stat_result | None = None) -> list[_Planned]:
    st = st or path.stat()
    if path.suffix == ".npz":
        members = [
            _Planned(
                key=_child_key(key, member.name, path),
                header=member.header,
                source=f"{path}[{member.name}.npy]",
                fingerprint=_fingerprint(st),
                copy_from=str(path),
                copy_offset=member.stored_offset,
                member=member.name,
            )
            for member in iter_npz_members(str(path))
        ]
        if not members:
            raise InvalidSourceError(f"{path}: the .npz archive holds no .npy arrays")
        return members
    if path.suffix != ".npy":
        raise CorruptSourceError(f"{path}: not a .npy or .npz file (or a directory of them)")
    try:
        with open(path, "rb") as fp:
            header = read_source_header(fp, st.st_size, str(path))
    except PermissionError as exc:
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    return [_Planned(key, header, str(path), _fingerprint(st), str(path), 0)]


def _inflate_member(item: _Planned, dst: int, target: Path, advance: Callable[[int], None]) -> int:
    """Copy a compressed ``.npz`` member (zipfile checks its CRC while inflating);
    returns the CRC-32 of what was written."""
    import zipfile
    import zlib

    from .._disk.fs import write_all

    written = 0
    crc = 0
    try:
        with zipfile.ZipFile(item.copy_from) as archive, archive.open(f"{item.member}.npy") as member:
            while chunk := member.read(16 << 20):
                piece = chunk[: item.header.file_size - written]
                write_all(dst, piece, target)
                crc = zlib.crc32(piece, crc)
                written += len(piece)
                advance(len(piece))
                if written >= item.header.file_size:
                    break
    except (zipfile.BadZipFile, EOFError, KeyError, zlib.error) as exc:
        raise CorruptSourceError(f"{item.source}: {exc}") from exc
    if written < item.header.file_size:
        raise CorruptSourceError(f"{item.source}: truncated member ({written} bytes)")
    return crc


def _names(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
