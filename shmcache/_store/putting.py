"""The put side of :class:`~shmcache._store.store.Store`: every write of an entry (arrays,
containers, tables, blobs, files, directories, URLs), the room each reserves, and its
publish. ``Store`` inherits these methods; the sources are checked and planned by
``_sources`` before any byte is written here."""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .._containers.encode import encode_mapping, encode_ragged, encode_records, encode_strings
from .._containers.table_arrow import encode_table
from .._disk.array_parts import FileArray
from .._disk.dtypes import storable
from .._disk.entry_tree import common_prefix, crash_point
from .._disk.fs import descriptors_typed
from .._disk.generations import bump_generations
from .._disk.keys import validate_key
from .._disk.layout import ARRAY_FILE, Layout, prepare_root
from .._disk.meta import EntryMeta, read_meta
from .._disk.npy import check_storable_dtype
from .._disk.trust import describe_uid
from .._disk.writer import VersionWriter
from .._sources.blobs import BlobSource, BlobSources, plan_blobs
from .._sources.dispatch import classify_source, plan_source
from .._sources.files import copy_planned, plan_sources, planned_bytes, release_planned
from .._sources.hf_datasets import arrow_of_dataset, open_hf_split, plan_hf_folder
from .._sources.planned import Planned
from .._sources.tables import is_table_file, read_table_source
from .._sources.tar_shards import ShardSource, plan_shards
from ..errors import CacheRootError, KeyExistsError, LockTimeoutError, UnsupportedDataError
from .gc_pause import gc_paused
from .locks import STORE_TIMEOUT, StoreTimeout, key_lock, publish_lock
from .reading import Reader, release_version
from .records import EntryInfo, PlannedEntry, entry_info
from .space import reserve
from .writing import (
    ITEM_TYPES,
    pack_blobs,
    publish,
    publish_batch,
    remove_versions,
    version_meta,
    write_batch,
    write_container,
)

__all__ = ["Putting"]

logger = logging.getLogger("shmcache._store.store")

_PAGE = 4096  # reserved per file beyond its bytes: headers, meta.json, directory blocks
_FEW_KEYS = 8  # more keys are checked against one walk of their prefix directory


class Putting:
    """The put methods of ``Store`` (its state, set by ``Store.__init__``, is declared here)."""

    root: Path
    layout: Layout
    max_bytes: int | None
    lock_timeout: float | None
    _root_str: str
    team: str | None
    _prepared: bool
    _reader: Reader

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
        them back. Names: see :mod:`shmcache._sources.blobs`.

        Every file is checked before any byte is copied, then copied by the kernel from a
        few threads; a file that changes meanwhile raises :class:`CorruptSourceError` and
        nothing is published. ``progress`` and ``allowed_dirs`` are as for ``put_file``.
        """
        validate_key(key)
        plan = plan_blobs(source, f"blobs for key {key!r}", builtins.list(allowed_dirs))
        return self._put_blob_sources(key, plan, overwrite, pin, progress)

    def _put_blob_sources(
        self,
        key: str,
        plan: BlobSources,
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
    ) -> EntryInfo:
        """Write and publish the checked blobs ``plan`` (files, buffers or tar members)."""
        with plan, self._writer() as writer:
            self._refuse_existing([key], overwrite)
            self._reserve(writer, plan.size + _PAGE * (len(plan.arrays) + 2), [key] if overwrite else ())
            meta = pack_blobs(writer, key, plan, pin, progress)
            versions = [(key, meta["version"])]
            publish(self.layout, writer, versions, overwrite=overwrite, lock_timeout=self.lock_timeout)
        logger.info("put %s (blobs, %d files, %d bytes)", key, len(plan.names), plan.size)
        return _entry_info(meta)

    @descriptors_typed
    def put_table(self, key: str, data: Any, *, overwrite: bool = False, pin: bool = False) -> EntryInfo:
        """Publish a table: a pyarrow Table, a pandas DataFrame, a ``datasets.Dataset`` (its
        Arrow data, rows as selected), a dict of columns, a list of dicts with one set of
        keys, or a path to a .parquet/.feather/.arrow/.csv/.jsonl file."""
        validate_key(key)
        if type(data).__module__.partition(".")[0] == "datasets":
            data = arrow_of_dataset(data, f"table for key {key!r}")
        if isinstance(data, (str, os.PathLike)):
            if not is_table_file(data):
                raise UnsupportedDataError(
                    f"{data}: put_table reads .parquet, .feather, .arrow, .csv or .jsonl files"
                )
            parts, meta = read_table_source(Path(data))
            return self._put_entry(key, "table", parts, meta, overwrite=overwrite, pin=pin)
        files, meta = encode_table(data, f"table for key {key!r}")
        return self._put_entry(key, "table", files, meta, overwrite=overwrite, pin=pin)

    def _put_entry(
        self,
        key: str,
        kind: str,
        files: Mapping[str, FileArray],
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
        return _entry_info(meta)

    @descriptors_typed
    def put_file(
        self,
        key: str,
        path: ShardSource,
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
        allowed_dirs: Collection[str | os.PathLike[str]] = (),
        as_: str = "auto",
        storage_options: Mapping[str, Any] | None = None,
        part_size: int | None = None,
        dtype: Any = None,
    ) -> list[str]:
        """Publish a ``.npy`` (as ``key``), an ``.npz`` (as ``key/<member>``), a
        ``.safetensors``, torch ``.pt``/``.pth`` state dict or ``.h5``/``.hdf5`` (as
        ``key/<tensor or dataset name>``), or a directory of them (as ``key/<relative path
        without suffix>``; see ``_sources/files.PLANNERS``); a ``.parquet``, ``.feather``/``.arrow``,
        ``.csv`` or ``.jsonl`` file as one table entry.

        ``path`` may be an fsspec URL (``s3://``, ``gs://``, ``az://``, ``hf://``,
        ``http(s)://``; ``file://`` is a local path): an object of any format above (a raw
        token file with ``dtype``), or a prefix of them, streamed into the cache in
        parallel ranged reads of ``part_size`` bytes (default: 8 to 64 MiB, 16 parts per
        object where they fit; a table object: one GET unless ``part_size`` is given; see
        :mod:`shmcache._sources.remote` and ``remote_files``);
        ``storage_options`` go to the filesystem and are never recorded or shown.

        ``dtype`` (e.g. ``"uint16"``) makes a raw token file (nanoGPT's ``train.bin``) one 1-D
        array; a Megatron ``.bin``/``.idx`` pair becomes a ragged entry of its documents.

        ``.tar`` shards (WebDataset's layout: one ``.tar``, a glob or brace pattern such as
        ``"shards/{000..099}.tar"``, or a list of paths) become one blobs entry, a blob per
        member with its name (``open_blobs(key).samples()`` groups them by basename), copied by
        the kernel from the shards' byte ranges; see :mod:`shmcache._sources.tar_shards`.

        ``as_="blobs"`` stores every file of a directory as bytes in one blobs entry (see
        :meth:`put_blobs`); ``"auto"`` (the default) does so for a directory that holds no
        array files, and refuses one that mixes both; ``"arrays"`` takes the array files only.

        Everything is validated before anything is copied: a truncated or corrupt file
        raises a typed error naming it and publishes nothing. Payloads are copied once, never
        held whole in memory: by the kernel, or through a reused 1 MiB buffer that the CRC-32
        reads as it passes (files over 4 MiB; what must be decoded: compressed ``.npz``
        members, HDF5 datasets, strided torch tensors, goes through Python in pieces).
        ``progress(bytes_done, bytes_total)`` is called as data is copied, from the calling
        thread (a directory of big files is copied by a few threads: see ``copy_pool``); an
        exception it raises cancels the load, and nothing is published. Returns the published keys.

        With ``allowed_dirs``, every file must lie beneath one of them (links resolved) and
        is opened without following any link: what the daemon loads for ``--allow-source``.
        A file that changes while it is loaded raises :class:`CorruptSourceError`.
        """
        validate_key(key)
        source = classify_source(path, as_, dtype)
        if source.kind == "shards":
            shards = plan_shards(source.location, f"tar shards for key {key!r}", builtins.list(allowed_dirs))
            return [self._put_blob_sources(key, shards, overwrite, pin, progress).key]
        assert isinstance(source.location, (str, os.PathLike)), "only shards come as a list"
        path = source.location
        if source.kind == "remote":
            return self._put_remote(
                key, str(path), overwrite, pin, progress, storage_options, part_size, dtype, as_
            )
        if source.kind == "hf":
            return self._put_hf_folder(key, Path(path), builtins.list(allowed_dirs), overwrite, pin, progress)
        if source.kind == "table":
            files, meta = read_table_source(Path(path), builtins.list(allowed_dirs))
            return self._put_table_file(key, files, meta, overwrite, pin, progress)
        if source.kind == "blobs":
            info = self.put_blobs(
                key, path, overwrite=overwrite, pin=pin, progress=progress, allowed_dirs=allowed_dirs
            )
            return [info.key]
        allowed = builtins.list(allowed_dirs)
        with gc_paused():  # a directory's plan: many objects, no cycles
            plan = plan_sources(key, Path(path), allowed, dtype, hold=True, listing=source.listing)
            try:
                return self._put_planned(key, path, plan, overwrite, pin, progress)
            finally:
                release_planned(plan)  # what a failed put did not copy

    def _put_planned(
        self,
        key: str,
        path: str | os.PathLike[str],
        plan: builtins.list[Planned],
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
    ) -> builtins.list[str]:
        """``put_file`` of planned ``.npy`` sources: one batch version for several."""
        keys = [item.key for item in plan]
        self._refuse_existing(keys, overwrite)
        total = planned_bytes(plan)
        advance = _progress_counter(progress, total)
        with self._writer() as writer:
            self._reserve(writer, total + _PAGE * len(plan), keys if overwrite else ())
            if progress is not None:
                progress(0, total)
            if len(plan) > 1:  # a directory (or an archive): one batch version, one manifest
                batch = write_batch(writer, plan, pin, advance, copy_planned)
                crash_point("batch-written")
                versions = [(item.key, item.version) for item in plan]
                timeout = self.lock_timeout
                publish_batch(self.layout, writer, batch, versions, overwrite=overwrite, lock_timeout=timeout)
                logger.info("put %s from %s (%d entries, %d bytes)", key, path, len(plan), total)
                return keys
            for item in plan:
                item.version = writer.new_version()
                if item.container is not None:  # decoded when checked: HDF5 variable-length strings
                    write_container(writer, item, pin, advance, copy_planned)
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

    def _put_hf_folder(
        self,
        key: str,
        path: Path,
        allowed: builtins.list[str | os.PathLike[str]],
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
    ) -> builtins.list[str]:
        """``put_file`` of a ``save_to_disk`` folder: a table per split, published together."""
        splits = plan_hf_folder(key, path, allowed)
        keys = [split.key for split in splits]
        self._refuse_existing(keys, overwrite)
        total = sum(split.size for split in splits)
        advance = _progress_counter(progress, total)
        if progress is not None:
            progress(0, total)
        with self._writer() as writer:
            versions, held = [], 0
            for i, split in enumerate(splits):
                with open_hf_split(split, allowed) as (files, extra):  # checked unchanged after the writes
                    held += sum(int(a.nbytes) for a in files.values()) + _PAGE * (len(files) + 1)
                    self._reserve(writer, held, keys[: i + 1] if overwrite else ())  # all the writer holds
                    version = writer.new_version()
                    crcs, headers = {}, {}
                    for name, array in files.items():
                        crcs[name], headers[name] = writer.write_array(version, f"{name}.npy", array)
                meta = version_meta(split.key, "table", version, headers, crcs, pin) | dict(extra)
                meta["shape"] = [meta.get("length", 0)]
                meta.setdefault("dtype", ITEM_TYPES.get("table"))
                writer.write_meta(version, meta)
                versions.append((split.key, version))
                advance(split.size)
            publish(self.layout, writer, versions, overwrite=overwrite, lock_timeout=self.lock_timeout)
        logger.info("put %s from %s (%d tables)", key, path, len(keys))
        return keys

    def _put_table_file(
        self,
        key: str,
        files: Mapping[str, FileArray],
        meta: Mapping[str, Any],
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
    ) -> list[str]:
        """``put_file`` of a table file or object, read already (progress: the file's bytes)."""
        size = int(meta["source_fingerprint"]["size"])
        if progress is not None:
            progress(0, size)
        self._put_entry(key, "table", files, meta, overwrite=overwrite, pin=pin)
        if progress is not None:
            progress(size, size)
        return [key]

    def _put_remote(
        self,
        key: str,
        url: str,
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
        storage_options: Mapping[str, Any] | None,
        part_size: int | None,
        dtype: Any = None,
        as_: str = "auto",
    ) -> list[str]:
        """``put_file`` of a URL: every object planned and validated (a table object read),
        then streamed in."""
        from .._sources.remote import fetch_remote  # here: threads and hashing only for URLs
        from .._sources.remote_files import plan_remote

        # .npy headers are validated as fetched; other formats' indexes are read now
        plan = plan_remote(key, url, storage_options, read_headers=False, dtype=dtype, as_=as_)
        if plan.blobs is not None:  # a prefix of other files, or tar shards: one blobs entry
            self._refuse_existing([key], overwrite)
            return [self._put_blob_sources(key, plan.blobs, overwrite, pin, progress).key]
        if plan.is_table:  # streamed into tmp/, decoded from there batch by batch (remote_tables)
            from .._sources.remote_tables import load_remote_table

            self._refuse_existing([key], overwrite)
            advance, replacing = _progress_counter(progress, plan.object_bytes), [key] if overwrite else []
            advance(0)
            with self._writer() as writer:
                reserve = lambda n, evict: self._reserve(writer, n, replacing, evict)  # noqa: E731
                table = load_remote_table(plan, writer, reserve, advance, part_size)
                meta = version_meta(key, "table", table.version, table.headers, table.crcs, pin) | table.extra
                writer.write_meta(table.version, meta | {"shape": [meta.get("length", 0)]})
                publish(
                    self.layout,
                    writer,
                    [(key, table.version)],
                    overwrite=overwrite,
                    lock_timeout=self.lock_timeout,
                )
            logger.info("put %s from %s (table, %d bytes of objects)", key, plan.url, plan.object_bytes)
            return [key]
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
                headers, crcs = item.entry_files()  # data.npy; a Megatron pair's values and offsets
                meta = version_meta(item.key, item.kind, item.version, headers, crcs, pin) | item.extra
                meta["source"] = item.source  # redacted: no user information, no query
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
        path: ShardSource,
        *,
        allowed_dirs: Collection[str | os.PathLike[str]] = (),
        as_: str = "auto",
        storage_options: Mapping[str, Any] | None = None,
        dtype: Any = None,
    ) -> builtins.list[PlannedEntry]:
        """What ``put_file(key, path)`` would publish, validated (headers, dtypes, key
        names) without copying anything: a dry run for callers that must answer early."""
        validate_key(key)
        allowed = builtins.list(allowed_dirs)
        return plan_source(key, path, allowed=allowed, as_=as_, storage_options=storage_options, dtype=dtype)

    def _refuse_existing(self, keys: builtins.list[str], overwrite: bool) -> None:
        if overwrite:
            return
        if len(keys) > _FEW_KEYS:  # one walk of their common prefix, not 1-3 readlinks per key
            prefix = common_prefix(keys)
            start = len(prefix) + 1 if prefix else 0
            present = self.layout.links_under(prefix)
            keys = [key for key in keys if key[start:] in present]
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
            owner = self.layout.owner
            if owner is not None and owner[0] != os.geteuid():
                raise CacheRootError(
                    f"team {self.team}'s root {self._root_str} is written by its daemon alone (it runs as "
                    f"{describe_uid(owner[0])}); members put through it: put_array(..., team={self.team!r}), "
                    f"`shmcache --team {self.team} put KEY PATH`"
                )
            prepare_root(self.root, owner)
            self._prepared = True

    def _key_lock(self, key: str, timeout: float | StoreTimeout | None) -> AbstractContextManager[None]:
        self._prepare()
        return key_lock(self.layout, key, self.lock_timeout if timeout is STORE_TIMEOUT else timeout)

    def _check_root_identity(self) -> None:
        if self._reader.check_root_identity():
            self._prepared = False

    def _reserve(
        self, writer: VersionWriter, nbytes: int, replacing: Collection[str] = (), evict: bool = True
    ) -> None:
        """``evict=False``: CacheFullError rather than evicting (nothing is evicted for slack)."""
        reserve(
            self.layout,
            writer,
            nbytes,
            budget=self.max_bytes,
            lock_timeout=self.lock_timeout,
            evict_version=lambda key, version: (
                self._evict_version(key, version, wait=False) if evict else None
            ),
            replacing=replacing,
        )

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
            crash_point("evict-unlinked")
            bump_generations(self.layout, [key])
            meta = read_meta(self.layout, version)
            if meta is not None and meta.key not in (None, key):
                return 0  # a damaged link to another entry's data: that data stays
            freed = remove_versions(self.layout, [version])  # a batch's entry: its directory
            release_version(self.root, key, version)  # this process lets go at once
            return freed
        finally:
            lock.__exit__(None, None, None)


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


def _entry_info(meta: dict[str, Any]) -> EntryInfo:
    """The record of the version just written with ``meta`` (last used: now, its creation)."""
    written = EntryMeta.from_json(meta)
    return entry_info(written, written.created)


def _as_storable_array(value: Any, what: str) -> np.ndarray:
    bits = storable(value)  # a bfloat16/float8 tensor or ml_dtypes array: its raw bits, typed
    if bits is not None:
        return bits
    if isinstance(value, np.ma.MaskedArray):
        raise UnsupportedDataError(f"{what} is a masked array; store .data and .mask separately")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise UnsupportedDataError(f"{what} cannot be converted to an array: {exc}") from exc
    check_storable_dtype(array.dtype, what)
    return array
