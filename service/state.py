"""The daemon's state shared by the routes: store, jobs, metrics, and cheap cached views.

Listing reads every entry's ``meta.json``; ``mapped_by`` and ``/v1/stats`` need a
``/proc/*/maps`` scan. Control requests must stay in the millisecond range however many
entries there are and however fast loads and evictions come, so:

- the entry list is cached with a copy of the root's generation table (every publish and
  evict, by any process, rewrites slot 0 and the key's slot, after switching the link):
  while the table is unchanged the list is current. A change is caught up by one thread
  at a time, which every request waiting for it shares, and it re-reads only the keys
  whose slots changed (one walk of the entry tree, then one ``readlink`` per changed key). Re-reading
  every entry per request, with loads landing continuously, kept both cores busy and,
  one syscall per entry, left each re-read waiting for the GIL hundreds of times.
  ``last_used``, which changes without the table, is refreshed in the background every 30 s;
- ``/proc`` scans are shared too: a request that needs one gets the first scan that
  began after it arrived (so it sees every mapping made before its request), and
  ``/v1/stats`` and ``/metrics`` take one that began at most 2 s before they arrived
  (waiting, off the event loop, for a new one when the last is older).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass

import numpy as np

from shmcache import EntryInfo, Store, StoreStats
from shmcache._disk.fs import free_bytes, total_bytes
from shmcache._disk.generations import map_generations
from shmcache._disk.layout import Layout, generation_slot, read_version
from shmcache._disk.procmaps import MappingScan
from shmcache._store.budget import read_budget
from shmcache._store.catalog import held_by_batches, info_of, partial_bytes
from shmcache.errors import ShmCacheError

from .jobs import JobManager, LoadJob
from .members import policy_of
from .metrics import ServiceMetrics
from .schemas import Entry
from .settings import Settings

__all__ = [
    "SCAN_MAX_AGE_S",
    "EntryView",
    "MappingScans",
    "RootWatch",
    "Service",
    "entry_json",
    "entry_model",
    "limit_malloc_arenas",
    "record_configured_budget",
]

logger = logging.getLogger(__name__)

_ENTRIES_MAX_AGE_S = 30.0
SCAN_MAX_AGE_S = 2.0
"""How old (from its start) the ``/proc`` scan behind ``held_by_readers_bytes`` may be."""
_MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
_INLINE_CHANGES = 16
"""Catch up on the event loop when at most this many slots changed (about 0.1 ms each)..."""
_INLINE_ENTRIES = 5000
"""... and the root holds at most this many entries (one ``listdir`` of them): two thread
hops, each a wait for the GIL under load, cost more than that."""


@dataclass(frozen=True)
class _Row:
    """One entry as listed: its record and its JSON, rendered once per version."""

    info: EntryInfo
    json: bytes
    slot: int
    """The key's slot in the generation table."""

    @classmethod
    def of(cls, info: EntryInfo) -> _Row:
        return cls(info, entry_json(info), generation_slot(info.key))


@dataclass(frozen=True)
class EntryView:
    """A snapshot of the root's entries, each entry's JSON rendered once."""

    table: bytes | None
    """The root's generation table as it was before the entries were read (None: no table yet)."""
    started: float
    """``time.monotonic()`` when the read began: it reflects every change made before."""
    at: float
    """When ``last_used`` was last read for every entry."""
    rows: dict[str, _Row]
    keys: list[str]
    """Sorted; ``entries`` and ``json`` are in the same order."""
    entries: list[EntryInfo]
    json: list[bytes]
    used: int

    @classmethod
    def of(cls, table: bytes | None, started: float, at: float, rows: dict[str, _Row]) -> EntryView:
        keys = sorted(rows)
        ordered = [rows[key] for key in keys]
        return cls(
            table=table,
            started=started,
            at=at,
            rows=rows,
            keys=keys,
            entries=[row.info for row in ordered],
            json=[row.json for row in ordered],
            used=sum(row.info.size for row in ordered),
        )

    def json_under(self, prefix: str | None) -> bytes:
        """A JSON array of the entries that are ``prefix`` or lie under it (a bisection:
        the keys under ``prefix/`` are contiguous in sorted order, and ``0`` follows ``/``)."""
        if not prefix:
            return b"[" + b",".join(self.json) + b"]"
        first = bisect_left(self.keys, prefix)
        chosen = self.json[first : first + 1] if self.keys[first : first + 1] == [prefix] else []
        chosen += self.json[bisect_left(self.keys, prefix + "/") : bisect_left(self.keys, prefix + "0")]
        return b"[" + b",".join(chosen) + b"]"


def entry_model(info: EntryInfo) -> Entry:
    data = asdict(info)
    data["shape"] = list(info.shape) if info.shape is not None else None
    return Entry(**data)


def entry_json(info: EntryInfo) -> bytes:
    return entry_model(info).model_dump_json().encode()


def _changed_slots(table: bytes, before: bytes) -> set[int]:
    now, then = np.frombuffer(table, dtype=np.uint64), np.frombuffer(before, dtype=np.uint64)
    return set(np.flatnonzero(now != then).tolist())


def _caught_up(layout: Layout, previous: EntryView, changed: set[int] | None) -> dict[str, _Row]:
    """The entries now: ``previous`` rows whose slot is not in ``changed`` are kept as they
    are; other keys are read again (every key when ``changed`` is None: no table to compare).

    A key whose link changed after the table was copied bumps its slot afterwards, so the
    next catch-up reads it; one not yet listed whose slot did not change is such a key
    (switched, not yet bumped) and waits for that bump too.
    """
    links = layout.links_under("")
    rows: dict[str, _Row] = {}
    for key, link in links.items():
        row = previous.rows.get(key)
        if changed is not None and (row.slot if row is not None else generation_slot(key)) not in changed:
            if row is not None:
                rows[key] = row
            continue
        version = read_version(link)
        if version is None:
            continue  # evicted since the listing
        if row is None or row.info.version != version:
            info = info_of(layout, version)
            if info is None or info.key != key:
                continue  # replaced or evicted meanwhile: its bump brings the next catch-up
            row = _Row.of(info)
        rows[key] = row
    return rows


class MappingScans:
    """``/proc/*/maps`` scans (which processes map which versions) shared by the requests
    that need one, one scan at a time.

    A scan reads the maps of every process on the machine, and the kernel's cost grows with
    their mappings: here (2 cores, load 5-6) about 20 ms with 100 processes, 85 ms with
    1,000 bare ``python -c`` processes (39 mappings each), 0.6 s with 1,000 that imported
    numpy (310 each). So requests share scans: ``mapped_by`` takes the first scan that
    began after it arrived; ``/v1/stats`` and ``/metrics`` one that began at most
    ``max_age`` before they arrived, waiting for a new one when the last is older (the
    first request after a quiet period waits for one scan). While requests keep coming,
    the next scan starts in the background twice the last scan's duration before the
    current one gets too old, so they rarely wait.
    """

    def __init__(self, store: Store, max_age: float = SCAN_MAX_AGE_S) -> None:
        self.store = store
        self.max_age = max_age
        """How long before a request the scan :meth:`recent` answers from may have begun."""
        self._last: tuple[float, MappingScan] | None = None
        """When the last scan began (``time.monotonic()``), and the scan."""
        self._took = 0.0
        """How long the last scan took."""
        self._scanning = threading.Lock()
        self._background = threading.Lock()

    def fresh(self) -> MappingScan:
        """A scan that began after this call (it sees every mapping made before it).

        Callers that arrive during a scan wait for the next one, and share it.
        """
        return self._begun_since(time.monotonic())

    def recent(self) -> MappingScan:
        """A scan that began at most ``max_age`` before this call: the last one, else a new
        one (blocks for it: call it off the event loop), shared as :meth:`fresh`'s are."""
        scan = self.latest()
        return scan if scan is not None else self._begun_since(time.monotonic() - self.max_age)

    def latest(self) -> MappingScan | None:
        """The last scan if :meth:`recent` would answer it (never blocks), else None; one
        about to be too old has the next one started in the background."""
        last, now = self._last, time.monotonic()
        if last is None or last[0] < now - self.max_age:
            return None
        if last[0] < now - self.max_age + 2 * self._took and self._background.acquire(blocking=False):
            threading.Thread(target=self._scan_in_background, name="shmcache-scan", daemon=True).start()
        return last[1]

    def deleted_bytes(self) -> int:
        """Bytes of evicted or replaced entries still mapped, from a scan that began at most
        ``max_age`` before this call (blocks for a new one when the last is older)."""
        return self.recent().deleted_bytes

    def _begun_since(self, since: float) -> MappingScan:
        """The last scan if it began at ``since`` or later, else a new one; a caller that
        waited for another's scan takes it if that one began late enough."""
        last = self._last
        if last is not None and last[0] >= since:
            return last[1]
        with self._scanning:
            last = self._last
            if last is not None and last[0] >= since:
                return last[1]
            started = time.monotonic()
            scan = self.store.scan_mappings()
            self._last, self._took = (started, scan), time.monotonic() - started
            return scan

    def _scan_in_background(self) -> None:
        try:
            self.fresh()
        finally:
            self._background.release()


def record_configured_budget(store: Store, settings: Settings) -> None:
    """Make a budget given to the daemon (``--max-bytes``/``--max-fraction``, from a flag, the
    environment or the config file; a team's ``budget`` in the teams file) the root's,
    which every writer keeps. The daemon's setting wins over a different recorded one, and
    says so in the log; a daemon given no budget keeps the one the root records, except a
    team's: a budget the teams file set goes when the file no longer sets one (an admin
    who removed the line expects no budget after the restart, not the old one)."""
    configured = settings.budget_bytes(total_bytes(store.root))
    recorded = read_budget(store.layout)
    from_teams_file = f"teams file [teams.{settings.team}]" if settings.team is not None else None
    if configured is None:
        if recorded is not None and recorded.set_by == from_teams_file:
            logger.warning(
                "the teams file no longer sets a budget for team %s: the budget of %d bytes it set "
                "is removed", settings.team, recorded.max_bytes,
            )
            store.set_budget(None, set_by=from_teams_file)
        elif recorded is not None:
            logger.info("budget of %s: %d bytes, recorded in the root (set by %s)",
                        store.root, recorded.max_bytes, recorded.set_by)
        return
    set_by = from_teams_file or (
        "shmcache serve --max-fraction" if settings.max_fraction is not None else "shmcache serve --max-bytes"
    )
    if recorded is not None and recorded.max_bytes == configured and recorded.set_by == set_by:
        return
    if recorded is not None and recorded.max_bytes != configured:
        logger.warning(
            "the root %s recorded a budget of %d bytes (set by %s); the daemon's setting replaces it "
            "with %d bytes", store.root, recorded.max_bytes, recorded.set_by, configured,
        )
    store.set_budget(configured, set_by=set_by)


def limit_malloc_arenas(arenas: int = _MALLOC_ARENAS) -> None:
    """Cap glibc's malloc arenas for this process (no-op elsewhere).

    glibc gives threads arenas of their own, up to 8 per core, and memory freed in one is
    not reused by the others; the daemon starts threads all the time (a checksum thread
    per load, the request pool growing and shrinking), so its RSS crept up by 15% in a
    40 s soak of loads and evictions, against 6% with two arenas. The GIL serializes most
    allocations anyway, so more arenas buy little.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):  # pragma: no cover - a libc without mallopt
        pass


class RootWatch:
    """Whether the root a daemon serves is still the one it started on.

    ``rm -rf`` of a running daemon's root takes its entries, socket and pid file: the
    daemon can no longer be reached on its socket, another daemon may start on a recreated
    root, and every load and listing would fail with a misleading error. The daemon does not
    recreate the root (it could not take the pid file back safely); it answers 503 with
    :meth:`problem` until it has stopped, and stops with that message (exit status 1).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        st = os.stat(layout.root)
        self._identity = (st.st_dev, st.st_ino)

    def problem(self) -> str | None:
        """None while the root is intact, else what happened and what to do (three ``stat`` calls)."""
        root = self.layout.root
        try:
            st = os.stat(root)
        except FileNotFoundError:
            what = "was removed"
        except OSError as exc:
            what = f"can no longer be read ({exc.strerror})"
        else:
            if (st.st_dev, st.st_ino) != self._identity:
                what = "was replaced by another directory"
            else:
                missing = [p.name for p in (self.layout.entries, self.layout.objects) if not p.is_dir()]
                if not missing:
                    return None
                dirs = "directory" if len(missing) == 1 else "directories"
                what = f"lost its {' and '.join(f'{name}/' for name in missing)} {dirs}"
        return (
            f"the cache root {root} {what} while the daemon was running (its entries, socket and pid "
            "file with it); the daemon stops: start `shmcache serve` again to recreate the root"
        )


class Service:
    """Everything a request handler needs; one per app."""

    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        limit_malloc_arenas()
        self.settings = settings
        self.policy = policy_of(settings)
        """What each member may do (a team's rules; none for a personal root)."""
        Store(settings.root).prepare()
        if store is None:
            # Requests wait at most 5 s on another process's lock (then 503); loads lock_timeout.
            store = Store(settings.root, lock_timeout=5.0)
        self.store = store
        record_configured_budget(store, settings)
        self.load_store = Store(
            store.root, max_bytes=store.max_bytes, lock_timeout=settings.load_lock_timeout()
        )
        self.metrics = ServiceMetrics(
            space=self.space,
            held_by_readers=lambda: self.readers.deleted_bytes(),
            job_counts=lambda: self.jobs.counts(),
            entries=lambda: self.entries(),
        )
        for counted in (store, self.load_store):  # explicit, budget and cleanup evictions alike
            counted.on_evict = self.metrics.evicted
        self.jobs = JobManager(
            self.load_store,
            workers=settings.load_workers,
            max_load_rate=settings.max_load_rate,
            on_finish=self._job_finished,
            allowed_dirs=settings.allow_dirs,
        )
        self.readers = MappingScans(store)
        self.root_watch = RootWatch(store.layout)
        self.started = time.time()
        self._generations: memoryview | None = None
        self._view: EntryView | None = None
        self._reading = threading.Lock()
        self._touching = threading.Lock()

    def _job_finished(self, job: LoadJob) -> None:
        self.metrics.loads.labels(outcome=job.state).inc()
        if job.state == "done":
            self.metrics.loaded_bytes.inc(job.bytes_done)
            if self.settings.huge_pages:  # in a thread, off the job manager's lock: 1-3 s a GiB
                target, args = self._huge_pages, (list(job.keys),)
                threading.Thread(target=target, args=args, name="shmcache-huge", daemon=True).start()

    def _huge_pages(self, keys: list[str]) -> None:
        """Put the loaded entries on huge pages (``--huge-pages``); a key evicted or replaced
        meanwhile is skipped, a kernel that declines is logged once per load at debug."""
        done = 0
        for key in keys:
            try:
                done += self.store.huge_pages(key)
            except ShmCacheError as exc:
                logger.debug("huge pages for %s: %s", key, exc)
        logger.info("huge pages: %d bytes of %d entries", done, len(keys))

    def generation_table(self) -> bytes | None:
        """A copy of the root's generation table (8 KiB), None while the root has none."""
        table = self._generations  # one read: close() may drop it meanwhile (two threads may
        if table is None:  # both map it at first: one mapping is then dropped, no harm)
            mapped = map_generations(Layout(self.store.root))
            if mapped is None:
                return None
            table = self._generations = mapped[0]
        return table.tobytes()

    # ------------------------------------------------------------------ the entry list

    def entry_view(self) -> EntryView:
        """All entries, current as of this call (``last_used`` at most 30 s old).

        A changed root is caught up before answering (a client sees its own loads and
        evictions) by one thread at a time: a caller that waited while another caught up
        takes that view if it began after the caller arrived.
        """
        arrival = time.monotonic()
        view = self.current_view()
        if view is not None:
            return view
        with self._reading:
            view = self._view
            if view is not None and (view.started >= arrival or view.table == self.generation_table()):
                return view
            return self._read_entries(view)

    def view_now(self) -> EntryView | None:
        """The current view without waiting (for the event loop): the cached one, or one
        caught up here when that is quick (few changed slots, nobody else catching up);
        None when it would take longer: then :meth:`entry_view` in a thread."""
        view = self.current_view()
        if view is not None:
            return view
        if not self._reading.acquire(blocking=False):
            return None
        try:
            started, previous, table = time.monotonic(), self._view, self.generation_table()
            if previous is None or previous.table is None or table is None:
                return None
            if len(previous.rows) > _INLINE_ENTRIES:
                return None
            changed = _changed_slots(table, previous.table)
            if len(changed) > _INLINE_CHANGES:
                return None
            return self._install(previous, table, changed, started)
        finally:
            self._reading.release()

    def current_view(self) -> EntryView | None:
        """The cached view if the root has not changed since it was read, else None
        (cheap: never touches the disk)."""
        view = self._view
        if view is None or view.table != self.generation_table():
            return None
        if time.monotonic() - view.at > _ENTRIES_MAX_AGE_S and self._touching.acquire(blocking=False):
            threading.Thread(target=self._touch_in_background, name="shmcache-list", daemon=True).start()
        return view

    def _read_entries(self, previous: EntryView | None) -> EntryView:
        """Catch up with the root (under ``_reading``): the first time through ``Store.list``."""
        started = time.monotonic()
        table = self.generation_table()
        if previous is None:
            view = EntryView.of(table, started, started, {i.key: _Row.of(i) for i in self.store.list()})
            self._view = view
            return view
        changed = None
        if table is not None and previous.table is not None:
            changed = _changed_slots(table, previous.table)
        return self._install(previous, table, changed, started)

    def _install(
        self, previous: EntryView, table: bytes | None, changed: set[int] | None, started: float
    ) -> EntryView:
        """Catch ``previous`` up with ``table`` and make it the view (under ``_reading``)."""
        view = EntryView.of(table, started, previous.at, _caught_up(self.store.layout, previous, changed))
        self._view = view
        return view

    def _touch_in_background(self) -> None:
        """Re-read every entry (``last_used`` moves without a generation change), then
        update the rows whose version is still the one listed."""
        try:
            at = time.monotonic()
            fresh = {info.key: info for info in self.store.list()}
            with self._reading:
                view = self._view
                if view is None:
                    return
                rows = dict(view.rows)
                for key, row in view.rows.items():
                    info = fresh.get(key)
                    if info is not None and info.version == row.info.version and info != row.info:
                        rows[key] = _Row.of(info)
                self._view = EntryView.of(view.table, view.started, at, rows)
        finally:
            self._touching.release()

    def entries(self) -> list[EntryInfo]:
        """All entries, sorted by key (see :meth:`entry_view`)."""
        return self.entry_view().entries

    def space(self, view: EntryView | None = None) -> StoreStats:
        """``Store.stats()`` from an entry view (default: the current one), no re-read of every entry."""
        if view is None:
            view = self.entry_view()
        linked = [(entry.version, entry.size) for entry in view.entries]
        held = sum(held_by_batches(self.store.layout, linked).values())  # one stat per batch
        return StoreStats(
            root=str(self.store.root),
            capacity=total_bytes(self.store.root),
            used=view.used + held,
            free=free_bytes(self.store.root),
            budget=self.store.budget,
            entries=len(view.entries),
            packed_held=held,
            partial_bytes=partial_bytes(self.store.layout),  # one listing of tmp/, nearly empty
        )

    def budget_warning(self) -> str | None:
        """Why the root's budget cannot work (above the file system's size), without reading
        any entry (the daemon says it at start, before the entry view is read)."""
        root = self.store.root
        return StoreStats(
            root=str(root), capacity=total_bytes(root), used=0, free=0, budget=self.store.budget, entries=0
        ).budget_warning

    def close(self) -> None:
        self._generations = None  # unmapped when the last reader lets go of it

