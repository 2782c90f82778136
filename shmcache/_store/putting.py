"""The put side of :class:`~shmcache._store.store.Store`: the writes of in-memory entries
(arrays, containers, tables, blobs), the room each put reserves, its writer and its
publish. ``Store`` inherits these methods through ``putting_files.PuttingFiles``, which adds
the puts of files, directories and URLs; the sources are checked and planned by
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
from .._containers.table_arrow import encode_table_parts
from .._disk.array_parts import FileArray
from .._disk.dtypes import storable
from .._disk.entry_tree import common_prefix, crash_point
from .._disk.fs import descriptors_typed
from .._disk.generations import bump_generations
from .._disk.keys import validate_key
from .._disk.layout import Layout, prepare_root
from .._disk.meta import EntryMeta, read_meta
from .._disk.npy import check_storable_dtype
from .._disk.trust import describe_uid
from .._disk.writer import VersionWriter
from .._sources.blobs import BlobSource, BlobSources, plan_blobs
from .._sources.hf_datasets import arrow_of_dataset
from .._sources.table_batches import LoadedTable, Reserve
from .._sources.tables import is_table_file, load_table_source
from ..errors import CacheRootError, KeyExistsError, LockTimeoutError, UnsupportedDataError
from .locks import STORE_TIMEOUT, StoreTimeout, key_lock, publish_lock
from .reading import Reader, release_version
from .records import EntryInfo, entry_info
from .space import reserve
from .writing import ITEM_TYPES, pack_blobs, publish, remove_versions, version_meta

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
    on_evict: Callable[[str, int, str], None] | None = None
    """Told ``(key, bytes freed, reason)`` after each eviction this store makes; ``reason``:
    ``"request"`` (``evict``), ``"budget"`` (room made for a put), ``"cleanup"`` (a link
    whose data vanished). The daemon counts them in its metrics."""

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
            load = lambda writer, reserve: load_table_source(Path(data), writer, reserve)  # noqa: E731
            return _entry_info(self._put_loaded_table(key, load, overwrite, pin))
        files, meta = encode_table_parts(data, f"table for key {key!r}")  # chunks not joined: no copy
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

    def _put_loaded_table(
        self, key: str, load: Callable[[VersionWriter, Reserve], LoadedTable], overwrite: bool, pin: bool
    ) -> dict[str, Any]:
        """Publish the table entry ``load(writer, reserve)`` writes into a version of the
        writer (``reserve(nbytes, evict)`` grows the writer's reservation as it goes: a table
        file read batch by batch, see ``_sources/table_batches``); returns its meta."""
        self._refuse_existing([key], overwrite)
        replacing = [key] if overwrite else []
        with self._writer() as writer:
            reserve = lambda n, evict: self._reserve(writer, n, replacing, evict)  # noqa: E731
            table = load(writer, reserve)
            meta = version_meta(key, "table", table.version, table.headers, table.crcs, pin) | table.extra
            meta["shape"] = [meta.get("length", 0)]
            meta.setdefault("dtype", ITEM_TYPES.get("table"))
            writer.write_meta(table.version, meta)
            publish(
                self.layout,
                writer,
                [(key, table.version)],
                overwrite=overwrite,
                lock_timeout=self.lock_timeout,
            )
        logger.info("put %s (table, %d bytes, version %s)", key, meta["nbytes"], table.version)
        return meta

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
                    f"`shmcache --team {self.team} put PATH --key KEY`"
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
                self._evict_version(key, version, wait=False, reason="budget") if evict else None
            ),
            replacing=replacing,
        )

    def _evict_version(
        self, key: str, version: str, wait: bool = True, reason: str = "request"
    ) -> int | None:
        """Unlink ``key`` if it still points at ``version`` and return the bytes freed;
        None if it no longer does (or, with ``wait=False``, if its lock is taken).
        ``reason`` is what :attr:`on_evict` is told."""
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
                freed = 0  # a damaged link to another entry's data: that data stays
            else:
                freed = remove_versions(self.layout, [version])  # a batch's entry: its directory
                release_version(self.root, key, version)  # this process lets go at once
        finally:
            lock.__exit__(None, None, None)
        if self.on_evict is not None:
            self.on_evict(key, freed, reason)
        return freed


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
