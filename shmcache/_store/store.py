"""The store: one cache root's public operations, as a thin facade over the modules that
do the work (``reading``, ``writing``, ``sources``, ``space``, ``catalog``,
``maintenance``). The on-disk format is ``_disk/layout``'s.

Publishing renames a finished version into ``objects/`` and then swaps the entry's
symlink in one ``rename``: a reader sees the old version or the new one, never a
partial one. Replaced and evicted versions are unlinked, never rewritten, so processes
that still map them keep reading them.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .._containers.encode import (
    content_digest,
    encode_any,
    encode_mapping,
    encode_ragged,
    encode_records,
    encode_strings,
)
from .._containers.group import SharedGroup, read_group
from .._containers.shared import (
    SharedBlobs,
    SharedMapping,
    SharedRagged,
    SharedRecords,
    SharedStrings,
    open_version,
)
from .._containers.table import SharedTable
from .._containers.table_arrow import encode_table
from .._disk.fs import descriptors_typed, remove_tree
from .._disk.generations import bump_generations
from .._disk.keys import key_in_prefix, validate_key
from .._disk.layout import ARRAY_FILE, Layout, default_root, prepare_root
from .._disk.meta import read_entry_meta, read_meta
from .._disk.npy import check_storable_dtype
from .._disk.procmaps import MappingScan, mapped_versions, scan_mappings
from .._disk.urls import is_url, local_path_of, redact_url
from .._disk.writer import VersionWriter
from ..errors import (
    InvalidRequestError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    UnsupportedDataError,
)
from .blobs import BlobSource, pack_blobs, plan_blobs, put_kind
from .budget import checked_budget, write_budget
from .catalog import info_of, iter_infos, store_stats
from .loading import CacheVersion, cache_version_token, last_failure, recording_failure
from .locks import DEFAULT_LOCK_TIMEOUT, STORE_TIMEOUT, StoreTimeout, key_lock, publish_lock, snapshot_lock
from .maintenance import remove_dead_writers_leftovers, verify_entry
from .planned import write_container
from .reading import Reader, release_version
from .records import EntryInfo, PlannedEntry, StoreStats, entry_info
from .sources import copy_planned, plan_sources
from .space import budget_in_force, reserve
from .tables import is_table_file, plan_table_file, read_table_source
from .writing import ITEM_TYPES, publish, version_meta

__all__ = ["Store"]

logger = logging.getLogger(__name__)

_PAGE = 4096  # reserved per file beyond its bytes: headers, meta.json, directory blocks


class Store:
    """A cache root: put, open, evict, list, stats, cleanup.

    Nothing is read from, or written to, a root that is a symlink, another user's, or
    writable by others: :class:`CacheRootError` says why and what to do.

    Every put keeps the root's budget (:meth:`set_budget`, ``shmcache budget``, ``shmcache
    serve --max-bytes``; recorded in the root): one that would exceed it first evicts
    least-recently-used entries that are neither pinned nor mapped by a live process, or
    raises :class:`CacheFullError` naming what holds the space. ``max_bytes`` is a lower
    limit of this store's own on top of it (not recorded; other writers do not see it).
    ``lock_timeout`` bounds, in seconds, a wait on a lock that another process (or thread)
    holds and is still running with: an hour by default, as a ``cache()`` loader may run
    for many minutes; None waits as long as it takes. A holder that stays stopped
    (SIGSTOP, Ctrl+Z) fails the wait after a few seconds whatever the bound (unless it is
    None), with :class:`LockTimeoutError` naming its pid and ``kill -CONT``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
    ) -> None:
        self.root = Path(os.path.abspath(root if root is not None else default_root()))
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
        ):
            raise InvalidRequestError(f"max_bytes must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.layout = Layout(self.root)
        self._root_str = str(self.root)
        self._prepared = False
        self._reader = Reader(self.layout)
        # The warm open is the hot path of every DataLoader worker: no extra call frame.
        self.open_array = self._reader.open_array  # type: ignore[method-assign]

    def _share_reader(self, reader: Reader) -> None:
        """Open through ``reader``, the module functions' one for this root (``get_store``):
        ``shmcache.open_array(k) is get_store().open_array(k)``, one mapping per entry."""
        self._reader = reader
        self.open_array = reader.open_array  # type: ignore[method-assign]

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
        microsecond until this key is published or evicted again. numpy refuses writes;
        one that gets past it (an in-place op on a ``torch.from_numpy`` tensor of it)
        lands in this process's private copy of the touched pages, never in the cache
        (and this array shows it); ``shmcache.torch.as_tensor`` makes tensors of their own.
        """
        return self._reader.open_array(key)

    def open_private_array(self, key: str) -> np.ndarray:
        """A writable copy-on-write array over the entry (a mapping of its own, no copy):
        writes stay in this array. What ``shmcache.torch`` builds tensors on.
        ``MappingRefusedError`` where the kernel refuses the mapping (strict overcommit)."""
        return self._reader.open_private_array(key)

    @descriptors_typed
    def open(self, key: str) -> Any:
        """Open an entry of any kind: an array, or the shared container its kind names."""
        return self._reader.open(key)

    def open_strings(self, key: str) -> SharedStrings:
        """Read-only ``Sequence[str]`` over a ``put_strings`` entry."""
        return self._reader.open(key, "strings")  # type: ignore[no-any-return]

    def open_ragged(self, key: str) -> SharedRagged:
        """Read-only sequence of arrays over a ``put_ragged`` entry."""
        return self._reader.open(key, "ragged")  # type: ignore[no-any-return]

    def open_records(self, key: str) -> SharedRecords:
        """Read-only sequence of freshly decoded records over a ``put_records`` entry."""
        return self._reader.open(key, "records")  # type: ignore[no-any-return]

    def open_mapping(self, key: str) -> SharedMapping:
        """Read-only ``Mapping[str, X]`` over a ``put_mapping`` entry."""
        return self._reader.open(key, "mapping")  # type: ignore[no-any-return]

    def open_blobs(self, key: str) -> SharedBlobs:
        """Read-only blobs (uint8 views by position or name) over a ``put_blobs`` entry."""
        return self._reader.open(key, "blobs")  # type: ignore[no-any-return]
    def open_table(self, key: str) -> SharedTable:
        """Read-only table over a ``put_table`` entry: rows as fresh dicts, zero-copy columns."""
        return self._reader.open(key, "table")  # type: ignore[no-any-return]

    @descriptors_typed
    def open_group(self, prefix: str) -> SharedGroup:
        """Lazy read-only ``Mapping`` of every entry under ``prefix`` (relative names)."""
        validate_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)
        prefix = prefix.rstrip("/")
        self._reader.trust_root()
        with snapshot_lock(self.layout):  # a directory being republished: all old or all new
            versions = read_group(self.layout, prefix)
        if not versions:  # a typo would otherwise be an empty group
            hint = " (it is a single entry: open it with open_array/open)" if self.exists(prefix) else ""
            raise KeyNotFoundError(f"no entries under {prefix + '/'!r} in cache {self.root}{hint}")
        return SharedGroup(self, prefix, versions)

    def open_version(self, key: str, version: str, kind: str) -> Any:
        """Attach one version of a container entry."""
        return open_version(self._root_str, key, version, kind)

    @descriptors_typed
    def exists(self, key: str) -> bool:
        validate_key(key)
        self._reader.trust_root()
        return self.layout.has_entry(key)

    # ------------------------------------------------------------------ writing

    @descriptors_typed
    def put_array(self, key: str, array: Any, *, overwrite: bool = False, pin: bool = False) -> EntryInfo:
        """Publish ``array`` under ``key`` atomically; returns the new entry's info."""
        validate_key(key)
        array = _as_storable_array(array, f"array for key {key!r}")
        return self._put_entry(key, "array", {"data": array}, {}, overwrite=overwrite, pin=pin)

    @descriptors_typed
    def put_strings(
        self, key: str, strings: Iterable[str], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish a list of ``str`` (one UTF-8 buffer + offsets + a hash index)."""
        validate_key(key)
        files = encode_strings(strings, f"strings for key {key!r}")
        meta = {"length": len(files["offsets"]) - 1}
        return self._put_entry(key, "strings", files, meta, overwrite=overwrite, pin=pin)

    @descriptors_typed
    def put_ragged(
        self, key: str, arrays: Iterable[Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish arrays of one dtype that differ in their first dimension."""
        validate_key(key)
        files, meta = encode_ragged(arrays, f"arrays for key {key!r}")
        meta["length"] = len(files["offsets"]) - 1
        return self._put_entry(key, "ragged", files, meta, overwrite=overwrite, pin=pin)

    @descriptors_typed
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

        numpy scalars become Python numbers, tuples lists, UUIDs strings and enum members
        their values (orjson's encoding); anything else
        (sets, bytes, arrays, custom objects, non-str keys, NaN unless ``allow_nan``)
        raises :class:`UnsupportedDataError` naming where it is in the record.
        """
        validate_key(key)
        files = encode_records(records, f"records for key {key!r}", allow_nan=allow_nan)
        meta = {"length": len(files["offsets"]) - 1}
        return self._put_entry(key, "records", files, meta, overwrite=overwrite, pin=pin)

    @descriptors_typed
    def put_mapping(
        self, key: str, mapping: Mapping[str, Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish a ``dict`` from str to arrays/numbers (rows or ragged), str, or records."""
        validate_key(key)
        _, files, meta = encode_mapping(mapping, f"mapping for key {key!r}")
        return self._put_entry(key, "mapping", files, meta, overwrite=overwrite, pin=pin)

    @descriptors_typed
    def put_blobs(
        self,
        key: str,
        source: BlobSource,
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
        allowed_dirs: Collection[str | os.PathLike[str]] = (),
    ) -> EntryInfo:
        """Publish many files (a directory, an iterable of paths, or one file) or byte strings
        (a mapping name -> bytes-like) as one entry; ``open_blobs(key)[i or name]`` gives
        them back. Names: see :mod:`shmcache._store.blobs`.

        Every file is checked before any byte is copied, then copied by the kernel from a
        few threads; a file that changes meanwhile raises :class:`CorruptSourceError` and
        nothing is published. ``progress`` and ``allowed_dirs`` are as for ``put_file``.
        """
        validate_key(key)
        plan = plan_blobs(source, f"blobs for key {key!r}", builtins.list(allowed_dirs))
        with plan, self._writer() as writer:
            self._refuse_existing([key], overwrite)
            self._reserve(writer, plan.size + _PAGE * (len(plan.arrays) + 2), [key] if overwrite else ())
            meta = pack_blobs(writer, key, plan, pin, progress)
            versions = [(key, meta["version"])]
            publish(self.layout, writer, versions, overwrite=overwrite, lock_timeout=self.lock_timeout)
        logger.info("put %s (blobs, %d files, %d bytes)", key, len(plan.names), plan.size)
        return entry_info(meta, meta["created"])
    @descriptors_typed
    def put_table(
        self, key: str, data: Any, *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        """Publish a table: a pyarrow Table, a pandas DataFrame, a dict of columns, a list of
        dicts with one set of keys, or a path to a .parquet/.feather/.arrow/.csv/.jsonl file."""
        validate_key(key)
        if isinstance(data, (str, os.PathLike)):
            if not is_table_file(data):
                raise UnsupportedDataError(
                    f"{data}: put_table reads .parquet, .feather, .arrow, .csv or .jsonl files"
                )
            files, meta = read_table_source(Path(data))
        else:
            files, meta = encode_table(data, f"table for key {key!r}")
        return self._put_entry(key, "table", files, meta, overwrite=overwrite, pin=pin)

    @descriptors_typed
    def share(self, key: str, obj: Any, *, overwrite: bool = False) -> Any:
        """Put ``obj`` in the form that fits it and return the opened shared object.

        ndarray, or a list of numbers (labels) -> array; list of str -> strings; list of
        equal-dtype arrays -> ragged; list of dicts with one set of keys and plain values
        (int, float, bool, str, lists of numbers, None) -> table (``SharedTable``: rows come
        back equal, same types); other lists of dicts/lists -> records; dict -> mapping. If
        ``key`` already holds the same content (many experiments sharing one dataset), it
        is reused, not written again. Different content under ``key`` is refused with
        :class:`~shmcache.errors.KeyExistsError` unless ``overwrite=True`` (which replaces
        it; processes reading the old version keep it): another experiment may be sharing
        its own object under that key.
        """
        validate_key(key)
        kind, files, meta = encode_any(obj, f"object for key {key!r}")
        digest = content_digest(kind, files)
        with self._key_lock(key, self.lock_timeout):
            version = self.layout.entry_version(key)
            if version is not None and read_meta(self.layout, version).get("content_hash") == digest:
                return self.open(key)
            if version is not None and not overwrite:
                raise KeyExistsError(
                    f"entry {key!r} in {self._root_str} holds other content than this object "
                    "(share() reuses an entry only when the content is identical); pass "
                    "overwrite=True to replace it (processes reading it keep their version), "
                    "or share under another key"
                )
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
        """Write ``files`` as ``<name>.npy`` in a new version and publish it atomically
        (``key`` is valid)."""
        self._refuse_existing([key], overwrite)
        nbytes = sum(int(a.nbytes) for a in files.values())
        with self._writer() as writer:
            self._reserve(writer, nbytes + _PAGE * (len(files) + 1), [key] if overwrite else ())
            version = writer.new_version()
            crcs, headers = {}, {}
            for name, array in files.items():
                crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
            meta = version_meta(key, kind, version, headers, crcs, pin) | dict(extra)
            if kind != "array":  # what `ls` shows: item count, and the item type
                meta["shape"] = [meta.get("length", 0)]
                meta.setdefault("dtype", ITEM_TYPES.get(kind))
            writer.write_meta(version, meta)
            publish(
                self.layout, writer, [(key, version)], overwrite=overwrite, lock_timeout=self.lock_timeout
            )
        logger.info("put %s (%s, %d bytes, version %s)", key, kind, nbytes, version)
        return entry_info(meta, meta["created"])

    @descriptors_typed
    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
        allowed_dirs: Collection[str | os.PathLike[str]] = (),
        as_: str = "auto",
        storage_options: Mapping[str, Any] | None = None,
        part_size: int | None = None,
    ) -> list[str]:
        """Publish a ``.npy`` (as ``key``), an ``.npz`` (as ``key/<member>``), a
        ``.safetensors``, torch ``.pt``/``.pth`` state dict or ``.h5``/``.hdf5`` (as
        ``key/<tensor or dataset name>``), or a directory of them (as ``key/<relative path
        without suffix>``; see ``sources.PLANNERS``); a ``.parquet``, ``.feather``/``.arrow``,
        ``.csv`` or ``.jsonl`` file as one table entry.

        ``path`` may be an fsspec URL (``s3://``, ``gs://``, ``az://``, ``hf://``,
        ``http(s)://``; ``file://`` is a local path): ``.npy`` objects, or a prefix of them,
        streamed into the cache in parallel ranged reads of ``part_size`` bytes (default:
        8 to 64 MiB, 16 parts per object where they fit; see :mod:`shmcache._store.remote`);
        ``storage_options`` go to the filesystem and are never recorded or shown.

        ``as_="blobs"`` stores every file of a directory as bytes in one blobs entry (see
        :meth:`put_blobs`); ``"auto"`` (the default) does so for a directory that holds no
        array files, and refuses one that mixes both; ``"arrays"`` takes the array files only.

        Everything is validated before anything is copied: a truncated or corrupt file
        raises a typed error naming it and publishes nothing. Payloads are copied by the
        kernel, never through Python memory (but what must be decoded: compressed ``.npz``
        members, HDF5 datasets, strided torch tensors). ``progress(bytes_done, bytes_total)`` is
        called as data is copied; an exception it raises cancels the load, and nothing
        is published. Returns the published keys.

        With ``allowed_dirs``, every file must lie beneath one of them (links resolved) and
        is opened without following any link: what the daemon loads for ``--allow-source``.
        A file that changes while it is loaded raises :class:`CorruptSourceError`.
        """
        validate_key(key)
        if is_url(path):
            local = local_path_of(str(path))
            if local is None:
                return self._put_remote(key, str(path), overwrite, pin, progress, storage_options, part_size)
            path = local
        kind = put_kind(Path(path), as_)
        if kind != "blobs" and is_table_file(path) and not os.path.isdir(path):  # one table entry
            files, meta = read_table_source(Path(path), builtins.list(allowed_dirs))
            size = int(meta["source_fingerprint"]["size"])
            if progress is not None:
                progress(0, size)
            self._put_entry(key, "table", files, meta, overwrite=overwrite, pin=pin)
            if progress is not None:
                progress(size, size)
            return [key]
        if kind == "blobs":
            info = self.put_blobs(
                key, path, overwrite=overwrite, pin=pin, progress=progress, allowed_dirs=allowed_dirs
            )
            return [info.key]
        plan = plan_sources(key, Path(path), builtins.list(allowed_dirs))
        keys = [item.key for item in plan]
        self._refuse_existing(keys, overwrite)
        total = sum(item.header.file_size for item in plan)
        advance = _progress_counter(progress, total)
        with self._writer() as writer:
            self._reserve(writer, total + _PAGE * len(plan), keys if overwrite else ())
            if progress is not None:
                progress(0, total)
            for item in plan:
                item.version = writer.new_version()
                if item.container is not None:  # decoded when checked: HDF5 variable-length strings
                    write_container(writer, item, pin, advance)
                    continue
                target = writer.path(item.version, ARRAY_FILE)
                dst = writer.create_file(item.version, ARRAY_FILE)
                try:
                    crc = copy_planned(item, dst, target, advance)
                finally:
                    os.close(dst)
                meta = version_meta(
                    item.key, "array", item.version, {"data": item.header}, {"data": crc}, pin
                )
                meta["source"] = item.source
                meta["source_fingerprint"] = item.fingerprint
                writer.write_meta(item.version, meta)
            publish(
                self.layout,
                writer,
                [(item.key, item.version) for item in plan],
                overwrite=overwrite,
                lock_timeout=self.lock_timeout,
            )
        logger.info("put %s from %s (%d entries, %d bytes)", key, path, len(plan), total)
        return keys

    def _put_remote(
        self,
        key: str,
        url: str,
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
        storage_options: Mapping[str, Any] | None,
        part_size: int | None,
    ) -> list[str]:
        """``put_file`` of a URL: every object planned and validated, then streamed in."""
        from .remote import fetch_remote, plan_remote  # here: threads and hashing only for URLs

        plan = plan_remote(key, url, storage_options, read_headers=False)  # validated as fetched
        keys = [item.key for item in plan.items]
        self._refuse_existing(keys, overwrite)
        total = plan.object_bytes
        advance = _progress_counter(progress, total)
        with self._writer() as writer:
            self._reserve(writer, total + _PAGE * len(keys), keys if overwrite else ())
            if progress is not None:
                progress(0, total)
            fetch_remote(plan, writer, advance, part_size)
            for item in plan.items:
                header = {"data": item.checked_header}
                meta = version_meta(item.key, "array", item.version, header, {"data": item.crc}, pin)
                meta["source"] = item.url  # redacted: no user information, no query
                meta["source_fingerprint"] = {"size": item.size}
                meta["source_identity"] = item.identity
                writer.write_meta(item.version, meta)
            publish(
                self.layout,
                writer,
                [(item.key, item.version) for item in plan.items],
                overwrite=overwrite,
                lock_timeout=self.lock_timeout,
            )
        logger.info("put %s from %s (%d entries, %d bytes)", key, plan.url, len(keys), total)
        return keys

    @descriptors_typed
    def plan_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        allowed_dirs: Collection[str | os.PathLike[str]] = (),
        as_: str = "auto",
        storage_options: Mapping[str, Any] | None = None,
    ) -> builtins.list[PlannedEntry]:
        """What ``put_file(key, path)`` would publish, validated (headers, dtypes, key
        names) without copying anything: a dry run for callers that must answer early."""
        validate_key(key)
        if is_url(path):
            local = local_path_of(str(path))
            if local is None:
                from .remote import plan_remote

                plan = plan_remote(key, str(path), storage_options)
                return [PlannedEntry(i.key, i.url, i.url, i.checked_header.file_size) for i in plan.items]
            path = local
        kind = put_kind(Path(path), as_)
        if kind != "blobs" and is_table_file(path) and not os.path.isdir(path):
            return [plan_table_file(key, Path(path), builtins.list(allowed_dirs))]
        if kind == "blobs":
            with plan_blobs(path, f"blobs for key {key!r}", builtins.list(allowed_dirs)) as blobs:
                pass
            return [PlannedEntry(key, str(path), str(path), blobs.size)]
        return [
            PlannedEntry(p.key, p.source, p.copy_from, p.header.file_size)
            for p in plan_sources(key, Path(path), builtins.list(allowed_dirs))
        ]

    @descriptors_typed
    def prepare(self) -> None:
        """Create the root and its directories (0700) now rather than on the first put."""
        self._check_root_identity()
        self._prepare()

    @descriptors_typed
    def cache(
        self,
        key: str,
        loader: Callable[[], Any],
        *,
        version: CacheVersion = None,
        timeout: float | StoreTimeout | None = STORE_TIMEOUT,
    ) -> np.ndarray:
        """Get-or-create: open ``key``, or run ``loader`` once across all processes.

        ``version`` (a str, an int, a file path, or a tuple of those) is recorded with the
        entry: a call with another version runs the loader again and replaces the entry
        (processes reading the old one keep it), so a changed loader or input is never
        answered with a stale value. ``None`` accepts whatever the key holds.

        Concurrent callers wait on the key's lock and then open what the first one
        published. If the load fails (the loader raises, or its result cannot be
        stored), the callers that were waiting for it raise the same error, caused by
        the loader's traceback, rather than each running it again; a later call tries
        again. If the loading process dies, the kernel releases its lock and the next
        waiter loads instead; nothing partial is ever visible. ``timeout`` bounds the wait
        for another caller's load (default: the store's ``lock_timeout``; see :class:`Store`).
        """
        wanted = None if version is None else cache_version_token(version)
        found = self._open_cached_version(key, wanted)
        if found is not None:
            return found
        seen = last_failure(self.layout, key)  # a different one after the wait failed meanwhile
        with self._key_lock(key, timeout):
            found = self._open_cached_version(key, wanted)
            if found is not None:
                return found
            failed = last_failure(self.layout, key)
            if failed is not None and (seen is None or failed.id != seen.id):
                raise failed.error(key)
            with recording_failure(self.layout, key):
                array = _as_storable_array(loader(), f"the value that cache()'s loader returned for {key!r}")
                extra = {} if wanted is None else {"cache_version": wanted}
                self._put_entry(key, "array", {"data": array}, extra, overwrite=wanted is not None, pin=False)
        return self.open_array(key)

    def _open_cached_version(self, key: str, wanted: str | None) -> np.ndarray | None:
        """``key``'s array if it exists and was made for version ``wanted`` (any, if None)."""
        try:
            array = self.open_array(key)
        except KeyNotFoundError:
            return None
        if wanted is None:
            return array
        version = self.layout.entry_version(key)
        if version is None or read_meta(self.layout, version).get("cache_version") != wanted:
            return None
        return array

    @descriptors_typed
    def cache_remote(
        self,
        key: str,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        timeout: float | StoreTimeout | None = STORE_TIMEOUT,
    ) -> np.ndarray | SharedGroup:
        """Get-or-create from a URL: open ``key``, or load ``url`` once per machine.

        The per-node form of :meth:`cache`: every rank of a node calls it, one takes the
        key's lock and downloads, the others wait and open what it published (an array for
        one ``.npy`` object, a group for a prefix of them). A failed load is raised by the
        callers that waited for it too, rather than each downloading again.
        """
        validate_key(key)
        found = self._open_cached(key)
        if found is not None:
            return found
        seen = last_failure(self.layout, key)
        with self._key_lock(key, timeout):
            found = self._open_cached(key)
            if found is not None:
                return found
            failed = last_failure(self.layout, key)
            if failed is not None and (seen is None or failed.id != seen.id):
                raise failed.error(key)
            with recording_failure(self.layout, key):
                self._put_remote(key, url, False, False, None, storage_options, None)
        found = self._open_cached(key)
        if found is None:  # evicted between the publish and the open
            raise KeyNotFoundError(f"{key!r} was evicted right after it was loaded from {redact_url(url)}")
        return found

    def _open_cached(self, key: str) -> np.ndarray | SharedGroup | None:
        """The array under ``key``, or the group of entries under it, or None."""
        try:
            return self.open_array(key)
        except KeyNotFoundError:
            pass
        try:
            return self.open_group(key)
        except KeyNotFoundError:
            return None

    def _refuse_existing(self, keys: builtins.list[str], overwrite: bool) -> None:
        if overwrite:
            return
        for key in keys:  # valid already: validated once, by the caller or the planner
            if self.layout.has_entry(key):
                raise KeyExistsError(
                    f"entry {key!r} already exists in {self._root_str}; pass overwrite=True "
                    "to replace it, or evict it first"
                )

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

    def _key_lock(self, key: str, timeout: float | StoreTimeout | None) -> AbstractContextManager[None]:
        self._prepare()
        return key_lock(self.layout, key, self.lock_timeout if timeout is STORE_TIMEOUT else timeout)

    def _check_root_identity(self) -> None:
        if self._reader.check_root_identity():
            self._prepared = False

    def _reserve(self, writer: VersionWriter, nbytes: int, replacing: Collection[str] = ()) -> None:
        reserve(
            self.layout,
            writer,
            nbytes,
            budget=self.max_bytes,
            lock_timeout=self.lock_timeout,
            evict_version=lambda key, version: self._evict_version(key, version, wait=False),
            replacing=replacing,
        )

    # ------------------------------------------------------------------ evict, list, stats

    @descriptors_typed
    def evict(self, key: str) -> int:
        """Remove an entry (pinned or not); returns the bytes released.

        Processes that map it keep reading their version; its memory returns to the
        system when the last of them lets go. This process lets go at once of what it
        kept attached: only arrays the program still holds keep the version mapped.
        """
        validate_key(key)
        self._reader.trust_root()
        version = self.layout.entry_version(key)
        freed = None if version is None else self._evict_version(key, version)
        if freed is None:
            raise self._reader.not_found(key)
        logger.info("evicted %s (%d bytes)", key, freed)
        return freed

    def _evict_version(self, key: str, version: str, wait: bool = True) -> int | None:
        """Unlink ``key`` if it still points at ``version`` and return the bytes freed;
        None if it no longer does (or, with ``wait=False``, if its lock is taken)."""
        try:
            lock = self._key_lock(key, self.lock_timeout if wait else 0)
            lock.__enter__()
        except LockTimeoutError:
            if wait:
                raise
            return None
        try:
            with publish_lock(self.layout, shared=True):  # not while a directory put copies
                found = self.layout.find_entry(key)
                if found is None or found[1] != version:
                    return None
                os.unlink(found[0])
            bump_generations(self.layout, [key])
            if read_meta(self.layout, version).get("key", key) != key:
                return 0  # a damaged link to another entry's data: that data stays
            freed = remove_tree(self.layout.version_dir(version))
            release_version(self.root, key, version)  # this process lets go at once
            return freed
        finally:
            lock.__exit__(None, None, None)

    @descriptors_typed
    def list(self, prefix: str | None = None) -> builtins.list[EntryInfo]:
        """Entries whose key is ``prefix`` or lies under it, sorted by key."""
        if prefix is not None and not isinstance(prefix, str):
            validate_key(prefix)  # raises InvalidKeyError naming the type
        if prefix:
            validate_key(prefix.rstrip("/"))
        self._reader.trust_root()
        with snapshot_lock(self.layout):  # a directory being republished: all old or all new
            infos = [e for e in iter_infos(self.layout) if key_in_prefix(e.key, prefix)]
        return sorted(infos, key=lambda e: e.key)

    @descriptors_typed
    def info(self, key: str) -> EntryInfo:
        validate_key(key)
        self._reader.trust_root()
        found = self.layout.find_entry(key)
        version = None if found is None else found[1]
        info = None if version is None else info_of(self.layout, version)
        if info is None or info.key != key:
            if found is not None:
                read_entry_meta(self.layout, key, found[1])  # names damage: CorruptEntryError
            raise self._reader.not_found(key)
        return info

    def mapped_by(self, key: str) -> builtins.list[int]:
        """PIDs of live processes that map the current version of ``key`` (a ``/proc`` scan)."""
        version = self.info(key).version
        return sorted(mapped_versions(self.layout.objects).get(version, ()))

    def scan_mappings(self) -> MappingScan:
        """Which processes map which versions, and bytes still held by unlinked ones."""
        return scan_mappings(self.layout.objects)

    @descriptors_typed
    def stats(self) -> StoreStats:
        """Capacity, use, the budget in force (see :attr:`budget`) and entry count."""
        self._reader.trust_root()
        return store_stats(self.layout, builtins.list(iter_infos(self.layout)), self.budget)

    # ------------------------------------------------------------------ the budget

    @property
    def budget(self) -> int | None:
        """The byte budget every put of this store keeps: the root's (see
        :meth:`set_budget`), or ``max_bytes`` where that is lower; None for none."""
        self._reader.trust_root()
        limit = budget_in_force(self.layout, self.max_bytes)
        return None if limit is None else limit[0]

    def set_budget(self, max_bytes: int | str | None, *, set_by: str = "Store.set_budget") -> None:
        """Record the root's byte budget (bytes, or a size such as ``"100GiB"``; None removes
        it), honoured from now on by every writer of the root: this and other processes,
        the CLI, the daemon. A budget below what the root holds evicts nothing now: the
        next put evicts least-recently-used entries (neither pinned nor mapped) to fit,
        and ``shmcache doctor`` fails until then."""
        nbytes = checked_budget(max_bytes)
        self._check_root_identity()
        self._prepare()
        write_budget(self.layout, nbytes, set_by)
        logger.info("budget of %s: %s (set by %s)", self.root, "none" if nbytes is None else nbytes, set_by)

    # ------------------------------------------------------------------ cleanup, verify

    @descriptors_typed
    def cleanup(self) -> int:
        """Remove what dead writers left behind; returns the bytes freed.

        Partial writes of live writers are never touched: a writer's flock tells the two
        apart, whatever PID namespace the writer runs in.
        """
        if not self.layout.tmp.is_dir():
            return 0
        self._prepare()
        return remove_dead_writers_leftovers(self.layout, self._evict_version)

    @descriptors_typed
    def verify(self, key: str) -> bool:
        """Check an entry against the checksums recorded when it was put, its metadata
        against its files, its link against its key, and open it as a reader does.

        True if the checksums match, False if none were recorded; raises CorruptEntryError
        (naming the fix) if anything is damaged.
        """
        validate_key(key)
        self._reader.trust_root()
        return verify_entry(self.layout, key)




def _progress_counter(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None]:
    """``advance(nbytes)`` for a copy of ``total`` bytes: adds up what was copied and
    reports ``progress(done, total)`` (an exception it raises cancels the put)."""
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    return advance


def _as_storable_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, np.ma.MaskedArray):
        raise UnsupportedDataError(f"{what} is a masked array; store .data and .mask separately")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise UnsupportedDataError(f"{what} cannot be converted to an array: {exc}") from exc
    check_storable_dtype(array.dtype, what)
    return array
