"""The file-source side of ``Store``'s puts: ``put_file`` of a local file or directory, a
``save_to_disk`` folder, a table file, tar shards or a URL, and ``plan_file``, its dry run.
Each path plans and checks its sources (``_sources``) and writes through the room, writer
and publish of :class:`~shmcache._store.putting.Putting`, which it extends."""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from .._containers.table_write import write_arrow_table
from .._disk.entry_tree import crash_point
from .._disk.fs import descriptors_typed
from .._disk.keys import validate_key
from .._disk.layout import ARRAY_FILE
from .._disk.writer import VersionWriter
from .._sources.dispatch import classify_source, plan_source
from .._sources.files import copy_planned, plan_sources, planned_bytes, release_planned
from .._sources.hf_datasets import open_hf_table, plan_hf_folder
from .._sources.planned import Planned
from .._sources.table_batches import LoadedTable, Reserve
from .._sources.tables import load_table_source
from .._sources.tar_shards import ShardSource, plan_shards
from .gc_pause import gc_paused
from .putting import _PAGE, Putting
from .records import PlannedEntry
from .writing import ITEM_TYPES, publish, publish_batch, version_meta, write_batch, write_container

__all__ = ["PuttingFiles"]

logger = logging.getLogger("shmcache._store.store")


class PuttingFiles(Putting):
    """``Putting`` and the puts whose data comes from files, directories, shards or URLs."""

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
        exception it raises cancels the load, and nothing is published: every call, the last
        (``bytes_done == bytes_total``) included, comes before the publish, so a put that
        raised never left an entry behind. Returns the published keys.

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
            return self._put_table_file(
                key, Path(path), builtins.list(allowed_dirs), overwrite, pin, progress
            )
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

                def reserve(nbytes: int, count: int, i: int = i) -> None:
                    nonlocal held
                    held += nbytes + _PAGE * (count + 1)
                    self._reserve(writer, held, keys[: i + 1] if overwrite else ())  # all the writer holds

                # checked unchanged after the writes; mapped, not populated: the encoding and the
                # copy (two threads) map the pages in
                with open_hf_table(split, allowed, populate=False) as (table, extra):
                    version = writer.new_version()
                    what = f"dataset folder {split.folder}"
                    headers, crcs, columns = write_arrow_table(table, what, writer, version, reserve)
                meta = version_meta(split.key, "table", version, headers, crcs, pin) | columns | dict(extra)
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
        path: Path,
        allowed: builtins.list[str | os.PathLike[str]],
        overwrite: bool,
        pin: bool,
        progress: Callable[[int, int], None] | None,
    ) -> builtins.list[str]:
        """``put_file`` of a local table file, read batch by batch (progress: the file's
        bytes read, after each batch, and all of them once written, before the publish: an
        error the last call raises cancels the put as any other does, never follows a
        published entry)."""

        def load(writer: VersionWriter, reserve: Reserve) -> LoadedTable:
            table = load_table_source(path, writer, reserve, allowed, progress)
            if progress is not None:
                size = int(table.extra["source_fingerprint"]["size"])
                progress(size, size)
            return table

        self._put_loaded_table(key, load, overwrite, pin)
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

            advance = _progress_counter(progress, plan.object_bytes)

            def load(writer: VersionWriter, reserve: Reserve) -> LoadedTable:
                advance(0)
                return load_remote_table(plan, writer, reserve, advance, part_size)

            self._put_loaded_table(key, load, overwrite, pin)
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
