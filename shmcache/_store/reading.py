"""Opening entries: resolve a key to its current version, attach it, and keep it warm.

Each process keeps what it attached, per key, with the key's generation slot value at
the time (see ``_disk/generations``). A warm open compares that one mapped slot and
returns the same object in well under a microsecond; a publish or evict of the key
changes its slot, and only that key's next open goes back to the disk.

Nothing is read from a root that another user could have planted (``_disk/trust``): the
first slow open checks the root once and keeps its inode; the sweep notices a root
replaced under us and has it checked again.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from .._disk.attach import COPY_ON_WRITE, WRITABLE, attach_array
from .._disk.dtypes import for_numpy, raw_bits
from .._disk.generations import CHANGING, map_generations
from .._disk.keys import validate_key
from .._disk.layout import ARRAY_FILE, META_FILE, Layout, generation_slot
from .._disk.meta import damaged, read_entry_meta, read_meta
from .._disk.trust import check_root
from ..errors import CorruptEntryError, KeyNotFoundError, ShmCacheError, UnsupportedDataError

__all__ = ["Reader", "forget_attachments", "reader_of", "release_version"]

_RESOLVE_RETRIES = 100
_SWEEP_INTERVAL_S = 1.0
_RECHECK_PER_SWEEP = 1000  # warm keys readlinked per sweep whatever their slot says

# A warm entry: (slot value when resolved, the generation table, slot, version, object).
_Hit = tuple[int, memoryview, int, str, Any]


class Reader:
    """The read side of one root in this process: attach caches and the open paths."""

    def __init__(self, layout: Layout, team: str | None = None) -> None:
        self.layout = layout
        self.team = team  # what a "put it first" hint names instead of the root
        self._root_str = str(layout.root)
        self._table: memoryview | None = None
        self._table_inode = -1
        self._root_id: tuple[int, int] | None = None  # (device, inode) of the root once trusted
        self._arrays: dict[str, _Hit] = {}
        self._handles: dict[str, _Hit] = {}
        self._last_sweep = 0.0
        self._recheck_at = [0, 0]  # round-robin position of the sweep in each cache
        _READERS.add(self)

    def forget(self) -> None:
        """Drop every cached attachment (only arrays the program still holds stay mapped)."""
        self._arrays.clear()
        self._handles.clear()

    def release(self, key: str, version: str) -> None:
        """Drop the cached attachment of ``key`` if it is of ``version`` (just evicted)."""
        for cache in (self._arrays, self._handles):
            hit = cache.get(key)
            if hit is not None and hit[3] == version:
                del cache[key]

    # ------------------------------------------------------------------ arrays

    def open_array(self, key: str, raw: bool = False) -> np.ndarray:
        """The read-only array of ``key`` (the same object while the key is unchanged).

        Over a copy-on-write mapping (``_disk/attach``): a write that gets past numpy's
        flag stays in this process; ``open_private_array`` is the writable one. ``raw``: a
        bfloat16/float8 entry as its bits (uint16/uint8), with or without ml_dtypes (not kept
        warm: the warm array is the typed one)."""
        try:
            hit = self._arrays.get(key)
        except TypeError:  # unhashable: let validation explain
            hit = None
        if hit is not None and hit[1][hit[2]] == hit[0] and not raw:
            return hit[4]  # type: ignore[no-any-return]
        return self._open_array_slowly(key, raw)

    def _open_array_slowly(self, key: str, raw: bool = False) -> np.ndarray:
        # Links exist only for valid keys, and "/" <-> "~" is the only renaming, so a key
        # without "~" that resolves is valid: validate only when it does not.
        if not isinstance(key, str) or "~" in key:
            validate_key(key)
        table, slot, link = self._start_resolving(key, self._arrays)
        for _ in range(_RESOLVE_RETRIES):
            generation = table[slot] if table is not None else 0  # read before the link
            try:  # read_version inlined: this is the cold-open path
                version = os.readlink(link).partition("/objects/")[2]
            except (OSError, ValueError):  # missing, or a name no key could have
                validate_key(key)
                found = self.layout.find_entry(key)  # a walk into a swapped-out tree, a flat root
                if found is None:
                    raise self.not_found(key) from None
                version = found[1]
            hit = self._arrays.get(key)
            if hit is not None and hit[3] == version and not raw:
                array = hit[4]
            else:
                try:
                    array = attach_array(self._root_str, version, ARRAY_FILE, key)
                except FileNotFoundError:
                    self._explain_missing_array(key, version)
                    continue  # replaced or evicted between readlink and open: resolve again
                except (CorruptEntryError, ValueError, TypeError) as exc:
                    _raise_if_damaged(self.layout, key, version, exc)
                    continue
                if raw:
                    return raw_bits(array)
                if array.dtype.names is not None:  # bfloat16/float8 bits: ml_dtypes, or why not
                    array = for_numpy(array, key)
            if table is not None and generation < CHANGING:  # not while a directory put switches
                self._arrays[key] = (generation, table, slot, version, array)
            return array  # type: ignore[no-any-return]
        raise ShmCacheError(f"entry {key!r} kept changing while being opened; try again")

    def _explain_missing_array(self, key: str, version: str) -> None:
        """Raise if ``version`` has no array file for a reason other than a race."""
        meta = read_meta(self.layout, version)
        if meta is not None and meta.kind != "array":
            from .._containers.shared import wrong_kind

            raise wrong_kind(key, meta.kind, "array")
        if self.layout.entry_version(key) == version:
            if "." in version.partition("/")[2]:  # packed: its bytes are in the batch's manifest
                manifest = self.layout.object_file(version, ARRAY_FILE)
                why = "`shmcache cleanup` removes entries whose data vanished"
                raise damaged(key, f"its data ({manifest}) is missing ({why})")
            where = self.layout.version_dir(version)
            vanished = "" if where.is_dir() else " (`shmcache cleanup` removes entries whose data vanished)"
            raise damaged(key, f"its data ({ARRAY_FILE}) is missing from {where}{vanished}")

    def open_private_array(self, key: str, *, huge_pages: bool = False) -> np.ndarray:
        """A writable copy-on-write array of ``key`` on a mapping of its own (for tensors):
        reads share the cache's pages, writes stay in this array. Raises
        ``MappingRefusedError`` where the kernel refuses the mapping (strict overcommit).
        ``huge_pages``: on 2 MiB pages where the kernel allows (``_disk/huge_map.py``)."""
        validate_key(key)
        self.trust_root()
        for _ in range(_RESOLVE_RETRIES):
            version = self.layout.entry_version(key)
            if version is None:
                raise self.not_found(key)
            try:
                return attach_array(
                    self._root_str, version, ARRAY_FILE, key, mode=WRITABLE, huge_pages=huge_pages
                )
            except FileNotFoundError:
                self._explain_missing_array(key, version)
            except (CorruptEntryError, ValueError, TypeError) as exc:
                _raise_if_damaged(self.layout, key, version, exc)
        raise ShmCacheError(f"entry {key!r} kept changing while being opened; try again")

    def open_array_version(
        self, key: str, version: str, *, private: bool = False, huge_pages: bool = False
    ) -> np.ndarray:
        """``key``'s array of ``version`` exactly, whatever the key holds now: what a
        Dataset sized from that version maps in each worker, so that no worker reads a
        later version. Shared read-only (bfloat16/float8 as their bits), or ``private`` as
        ``open_private_array``. ``KeyNotFoundError`` once that version was replaced or evicted."""
        validate_key(key)
        self.trust_root()
        mode = WRITABLE if private else COPY_ON_WRITE
        try:
            return attach_array(self._root_str, version, ARRAY_FILE, key, mode=mode, huge_pages=huge_pages)
        except FileNotFoundError:
            pass
        except (CorruptEntryError, ValueError, TypeError) as exc:
            _raise_if_damaged(self.layout, key, version, exc)
        raise KeyNotFoundError(f"entry {key!r}: its version {version} was replaced or evicted")

    # ------------------------------------------------------------------ any kind

    def open(self, key: str, kind: str | None = None, raw: bool = False) -> Any:
        """An entry of ``kind`` (any kind when None): an array or its container; ``raw``:
        a bfloat16/float8 array as its bits, not kept warm (what ``verify`` reads).

        The link is read once and ``meta.json`` at most once.
        """
        if kind == "array" and not raw:
            return self.open_array(key)
        hit = self._handles.get(key) if isinstance(key, str) else None
        if hit is not None and hit[1][hit[2]] == hit[0] and (kind is None or hit[4]._ref.kind == kind):
            return hit[4]
        if kind is None and not raw:
            hit = self._arrays.get(key) if isinstance(key, str) else None
            if hit is not None and hit[1][hit[2]] == hit[0]:
                return hit[4]
        validate_key(key)
        # The containers' read side: imported by the first open of a non-array kind, so
        # that a process that opens arrays alone never loads it (nor json, bisect).
        from .._containers.shared import open_version, wrong_kind

        table, slot, _ = self._start_resolving(key, self._handles)
        for _ in range(_RESOLVE_RETRIES):
            generation = table[slot] if table is not None else 0
            version = self.layout.entry_version(key)
            if version is None:
                raise self.not_found(key)
            meta = read_entry_meta(self.layout, key, version)
            if meta is None:
                continue  # replaced or evicted meanwhile: resolve again
            found = meta.kind
            if kind is not None and found != kind:
                raise wrong_kind(key, found, kind)
            cache = self._arrays if found == "array" else self._handles
            hit = cache.get(key)
            if hit is not None and hit[3] == version and not raw:
                opened = hit[4]
            else:
                try:
                    if found == "array":
                        opened = attach_array(self._root_str, version, ARRAY_FILE, key)
                        opened = raw_bits(opened) if raw else for_numpy(opened, key)
                    else:
                        opened = open_version(self._root_str, key, version, found, meta)
                except (FileNotFoundError, KeyNotFoundError) as exc:
                    if found == "array" and self.layout.entry_version(key) == version:
                        self._explain_missing_array(key, version)
                    _raise_if_damaged(self.layout, key, version, exc)
                    continue  # evicted while being opened: resolve again
                except UnsupportedDataError:
                    raise  # the wrong kind asked for, or bfloat16 without ml_dtypes
                except (CorruptEntryError, LookupError, ValueError, TypeError, AttributeError) as exc:
                    _raise_if_damaged(self.layout, key, version, exc)
                    continue
            if table is not None and generation < CHANGING and not raw:  # nor while a directory put switches
                cache[key] = (generation, table, slot, version, opened)
            return opened
        raise ShmCacheError(f"entry {key!r} kept changing while being opened; try again")

    # ------------------------------------------------------------------ housekeeping

    def not_found(self, key: str) -> KeyNotFoundError:
        names = self.layout.names_under(key) if isinstance(key, str) else []
        if names:  # put_file of a directory made a group of entries, not one entry
            shown = ", ".join(f"{key}/{name}" for name in names[:3]) + (", ..." if len(names) > 3 else "")
            return KeyNotFoundError(
                f"{key!r} is a group of {len(names)} entries ({shown}), not one entry: open one with "
                f"open_array({key + '/' + names[0]!r}), or all with open_group({key!r})"
            )
        if self.team is not None:
            return KeyNotFoundError(
                f"no entry {key!r} in team {self.team}'s cache {self._root_str}; put it first (shmcache."
                f"put_array / put_file with team={self.team!r}, or `shmcache --team {self.team} put`)"
            )
        return KeyNotFoundError(
            f"no entry {key!r} in cache {self._root_str}; put it first "
            "(shmcache.put_array / put_file, or `shmcache put`)"
        )

    def trust_root(self) -> None:
        """Refuse (``CacheRootError``) a root that is a symlink, another user's, or writable
        by others, before anything is read from it. Checked once per root directory."""
        if self._root_id is None:
            self._root_id = check_root(self._root_str, self.layout.owner)

    def _generation_table(self) -> memoryview | None:
        if self._table is None:
            mapped = map_generations(self.layout)
            if mapped is not None:
                self._table, self._table_inode = mapped
        return self._table

    def check_root_identity(self) -> bool:
        """Start afresh if the root was deleted and recreated under us (the mapped
        generation table would otherwise never change again, and whoever recreated it
        must be checked again); True if it was."""
        root_id: tuple[int, int] | None = None
        inode = -1
        try:
            st = os.lstat(self._root_str)
            root_id = (st.st_dev, st.st_ino)
            inode = os.stat(self.layout.generation).st_ino
        except OSError:  # missing, or the root is not a directory (prepare explains)
            pass
        replaced = self._root_id is not None and root_id != self._root_id
        if replaced or (self._table is not None and inode != self._table_inode):
            self._root_id = None
            self._table = None
            self.forget()
            return True
        return False

    def _start_resolving(self, key: str, cache: dict[str, _Hit]) -> tuple[memoryview | None, int, str]:
        """What a slow open needs: the generation table, the key's slot (from its stale hit
        in ``cache`` when there is one) and its link; sweeps stale attachments now and then."""
        if time.monotonic() - self._last_sweep >= _SWEEP_INTERVAL_S:
            self._sweep_stale()
        if self._root_id is None:
            self.trust_root()
        table = self._table if self._table is not None else self._generation_table()
        stale = cache.get(key)
        slot = stale[2] if stale is not None else generation_slot(key)
        return table, slot, self.layout.entry_link(key)

    def _sweep_stale(self) -> None:
        """Drop this process's attachments to versions that are no longer current.

        Their memory can only return to the system once no process maps them.
        """
        self._last_sweep = time.monotonic()
        self.check_root_identity()
        for n, cache in enumerate((self._arrays, self._handles)):
            hits = list(cache.items())
            at = self._recheck_at[n] % len(hits) if hits else 0
            self._recheck_at[n] = at + _RECHECK_PER_SWEEP
            for i, (key, hit) in enumerate(hits):
                # an unchanged slot: still current, as the warm open trusts (no readlink:
                # a process holding 100,000 keys would pay 100,000 of them every sweep),
                # except a round-robin slice of them: a writer killed between its link
                # swap and its generation bump leaves the slot unchanged and the key moved
                due = (i - at) % len(hits) < _RECHECK_PER_SWEEP
                if (due or hit[1][hit[2]] != hit[0]) and self.layout.entry_version(key) != hit[3]:
                    cache.pop(key, None)


def _raise_if_damaged(layout: Layout, key: str, version: str, exc: BaseException) -> None:
    """Raise :func:`damaged` for what opening ``version`` of ``key`` raised, unless the link
    moved meanwhile (a replace or evict raced the open: the caller resolves again). An
    evict unlinks the link before it removes files, so a link that still points at the
    version means its files are missing or wrong for good."""
    if layout.entry_version(key) != version:
        return
    if isinstance(exc, CorruptEntryError) and "`shmcache verify`" in str(exc):
        raise exc
    if isinstance(exc, FileNotFoundError | KeyNotFoundError):
        what = f"a file its {META_FILE} lists is missing from {layout.version_dir(version)}"
    elif isinstance(exc, CorruptEntryError):
        what = str(exc).removeprefix(f"entry {key!r}").lstrip(": ")
    else:
        what = f"its files do not make a readable entry ({type(exc).__name__}: {exc})"
    raise damaged(key, what) from exc


_READERS: weakref.WeakSet[Reader] = weakref.WeakSet()
_BY_ROOT: weakref.WeakValueDictionary[str, Reader] = weakref.WeakValueDictionary()


def reader_of(layout: Layout) -> Reader:
    """The one reader of ``layout``'s root for the module functions in this process (while
    anything holds it): their open path and ``get_store()``'s ``Store`` share its
    attachments, so ``shmcache.open_array(k) is get_store().open_array(k)`` without loading
    the store. A ``Store`` of your own keeps a reader of its own (dropping it drops them)."""
    name = str(layout.root)
    reader = _BY_ROOT.get(name)
    if reader is None:
        reader = _BY_ROOT.setdefault(name, Reader(layout))
    return reader


def release_version(root: Path, key: str, version: str) -> None:
    """Drop every reader's cached attachment of ``key`` at ``version`` in this process, once
    that version is evicted: its memory returns as soon as the program holds none of its
    arrays, not at some later open."""
    for reader in list(_READERS):
        if reader.layout.root == root:
            reader.release(key, version)


def forget_attachments(root: Path) -> None:
    """Drop every reader's cached attachments of ``root`` in this process, so that only
    arrays the program still holds keep entries mapped (and unevictable)."""
    for reader in list(_READERS):
        if reader.layout.root == root:
            reader.forget()
    gc.collect()  # cycles could keep a dropped array (and its mapping) alive
