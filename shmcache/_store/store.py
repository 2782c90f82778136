"""The store: one cache root's public operations, as a thin facade over the modules that
do the work (``reading``, ``putting``, ``putting_files`` and ``writing``, ``_sources``, ``space``,
``catalog``, ``maintenance``). The on-disk format is ``_disk/layout``'s.

Publishing renames a finished version into ``objects/`` and then swaps the entry's
symlink in one ``rename``: a reader sees the old version or the new one, never a
partial one. Replaced and evicted versions are unlinked, never rewritten, so processes
that still map them keep reading them.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._containers.encode import content_digest, encode_any, same_content
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
from .._disk.fs import descriptors_typed
from .._disk.keys import key_in_prefix, validate_key
from .._disk.layout import Layout, default_root, packed_range
from .._disk.meta import read_entry_meta, read_meta
from .._disk.procmaps import MappingScan, scan_mappings
from .._sources.urls import redact_url
from .._team.config import checked_team, team_of
from ..errors import InvalidRequestError, KeyExistsError, KeyNotFoundError, UnsupportedDataError
from .budget import checked_budget, write_budget
from .catalog import info_of, iter_infos, store_stats
from .loading import CacheVersion, cache_version_token, last_failure, recording_failure
from .locks import DEFAULT_LOCK_TIMEOUT, STORE_TIMEOUT, StoreTimeout, snapshot_lock
from .maintenance import remove_dead_writers_leftovers, verify_entry
from .putting import _as_storable_array
from .putting_files import PuttingFiles
from .reading import Reader
from .records import EntryInfo, StoreStats
from .space import budget_in_force

__all__ = ["Store"]

logger = logging.getLogger(__name__)


class Store(PuttingFiles):
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

    ``team`` (or ``$SHMCACHE_TEAM`` without a ``root``): the root of that team, as the
    administrator's root-owned teams file declares it, trusted only when owned by the
    team's service account and group (``docs/team.md``); not with ``root``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        team: str | None = None,
    ) -> None:
        owner: tuple[int, int] | None = None
        self.team = team_of(root, team)
        if self.team is not None:  # the root and its account come from the teams file alone
            config = checked_team(self.team)
            root, owner = config.root, (config.uid, config.gid)
        self.root = Path(os.path.abspath(root if root is not None else default_root()))
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
        ):
            raise InvalidRequestError(f"max_bytes must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.layout = Layout(self.root, owner)
        self._root_str = str(self.root)
        self._prepared = False
        self._reader = Reader(self.layout, team=self.team)
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

    def open_array(self, key: str, *, raw: bool = False) -> np.ndarray:
        """A read-only array over the entry's shared mapping (a plain ``ndarray``).

        A bfloat16/float8 entry is an ``ml_dtypes`` array (``UnsupportedDataError`` without
        ml_dtypes); ``raw=True`` gives its bits as uint16/uint8 instead.

        Repeated opens in one process return the attached array in well under a
        microsecond until this key is published or evicted again. numpy refuses writes;
        one that gets past it (an in-place op on a ``torch.from_numpy`` tensor of it)
        lands in this process's private copy of the touched pages, never in the cache
        (and this array shows it); ``shmcache.torch.as_tensor`` makes tensors of their own.
        """
        return self._reader.open_array(key, raw)

    def open_private_array(self, key: str, *, huge_pages: bool = False) -> np.ndarray:
        """A writable copy-on-write array over the entry (a mapping of its own, no copy):
        writes stay in this array. What ``shmcache.torch`` builds tensors on.
        ``MappingRefusedError`` where the kernel refuses the mapping (strict overcommit).
        ``huge_pages``: mapped on 2 MiB pages where the kernel allows (docs/huge-pages.md)."""
        return self._reader.open_private_array(key, huge_pages=huge_pages)

    def open_array_version(
        self, key: str, version: str, *, private: bool = False, huge_pages: bool = False
    ) -> np.ndarray:
        """``key``'s array of ``version`` (``Dataset`` s read the version they were sized
        from); ``KeyNotFoundError`` once it was replaced or evicted."""
        return self._reader.open_array_version(key, version, private=private, huge_pages=huge_pages)

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
            current = None if version is None else read_meta(self.layout, version)
            if current is not None and same_content(current.content_hash, kind, files, digest):
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
        meta = None if version is None else read_meta(self.layout, version)
        if meta is None or meta.cache_version != wanted:
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
    ) -> np.ndarray | SharedGroup | SharedTable:
        """Get-or-create from a URL: open ``key``, or load ``url`` once per machine.

        The per-node form of :meth:`cache`: every rank of a node calls it, one takes the
        key's lock and downloads, the others wait and open what it published (an array for
        one ``.npy`` or token object, a table for table objects, a group for the entries of
        a checkpoint, an archive or a prefix). A failed load is raised by the
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

    def _open_cached(self, key: str) -> np.ndarray | SharedGroup | SharedTable | None:
        """The array (or table) under ``key``, or the group of entries under it, or None."""
        try:
            return self.open_array(key)
        except KeyNotFoundError:
            pass
        except UnsupportedDataError:  # a table object's entry
            return self.open(key)  # type: ignore[no-any-return]
        try:
            return self.open_group(key)
        except KeyNotFoundError:
            return None

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

    def huge_pages(self, key: str) -> int:
        """Put the ``.npy`` files of ``key``'s current version that hold a 2 MiB page or more
        on huge pages (``MADV_COLLAPSE``: Linux >= 6.1, no root); returns the bytes now on
        them, 0 where the kernel declines (never an error for that). What
        ``CachedDataset(huge_pages=True)`` does at its first use, done by whoever should pay
        for it: a daemon after each load (``huge_pages``), whose memory cgroup the kernel
        then charges for the pages, instead of the first training job's."""
        from .._disk.huge_map import collapse_file

        version = self.info(key).version
        if packed_range(version) is not None:
            return 0  # packed into its batch's manifest: a few KiB, no huge page to fill
        directory = self.layout.version_dir(version)
        with os.scandir(directory) as found:
            files = [f.path for f in found if f.name.endswith(".npy") and f.is_file(follow_symlinks=False)]
        return sum(collapse_file(path).collapsed for path in files)

    def mapped_by(self, key: str) -> builtins.list[int]:
        """PIDs of live processes that map the current version of ``key`` (a ``/proc`` scan)."""
        version = self.info(key).version
        return sorted(scan_mappings(self.layout.objects).pids_of(version))

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
        self._reader.trust_root()  # another user's root: say so, not EACCES on its tmp/
        if not self.layout.tmp.is_dir():
            return 0
        self._prepare()
        return remove_dead_writers_leftovers(
            self.layout, lambda key, version: self._evict_version(key, version, reason="cleanup")
        )

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
