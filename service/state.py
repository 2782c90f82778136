"""The daemon's state shared by the routes: store, jobs, metrics, and cheap cached views.

Listing reads every entry's ``meta.json``; ``/v1/stats`` also needs a ``/proc/*/maps``
scan. Control requests must stay in the millisecond range however many entries there
are, so both are cached: the entry list until slot 0 of the root's generation table
changes (every publish and evict, by any process, changes it; ``last_used``, which
changes without it, is refreshed in the background every 30 s), the mapping scan for at
most 2 s.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

from shmcache import EntryInfo, Store, StoreStats
from shmcache._disk.fs import free_bytes, total_bytes
from shmcache._disk.generations import map_generations
from shmcache._disk.layout import Layout

from .jobs import JobManager, LoadJob
from .metrics import ServiceMetrics
from .schemas import Entry
from .settings import Settings

__all__ = ["EntryView", "ReaderScan", "Service", "entry_json", "entry_model"]

_ENTRIES_MAX_AGE_S = 30.0
_SCAN_MAX_AGE_S = 2.0


@dataclass(frozen=True)
class EntryView:
    """A snapshot of the root's entries, with each entry's JSON rendered once."""

    generation: int
    at: float
    entries: list[EntryInfo]
    json: list[bytes]
    used: int

    @classmethod
    def of(cls, generation: int, entries: list[EntryInfo]) -> EntryView:
        return cls(
            generation=generation,
            at=time.monotonic(),
            entries=entries,
            json=[entry_json(e) for e in entries],
            used=sum(e.size for e in entries),
        )

    def json_under(self, prefix: str | None) -> bytes:
        """A JSON array of the entries that are ``prefix`` or lie under it."""
        if not prefix:
            return b"[" + b",".join(self.json) + b"]"
        under = prefix + "/"
        chosen = [
            data
            for entry, data in zip(self.entries, self.json, strict=True)
            if entry.key == prefix or entry.key.startswith(under)
        ]
        return b"[" + b",".join(chosen) + b"]"


def entry_model(info: EntryInfo) -> Entry:
    data = asdict(info)
    data["shape"] = list(info.shape) if info.shape is not None else None
    return Entry(**data)


def entry_json(info: EntryInfo) -> bytes:
    return entry_model(info).model_dump_json().encode()


class ReaderScan:
    """Bytes that live processes still map of evicted/replaced entries (stale-while-revalidate)."""

    def __init__(self, store: Store, max_age: float = _SCAN_MAX_AGE_S) -> None:
        self.store = store
        self.max_age = max_age
        self._value = 0
        self._at: float | None = None
        self._lock = threading.Lock()
        self._refreshing = False

    def deleted_bytes(self) -> int:
        if self._at is None:
            self._refresh()
        elif time.monotonic() - self._at > self.max_age:
            with self._lock:
                start, self._refreshing = not self._refreshing, True
            if start:
                threading.Thread(target=self._refresh, name="shmcache-scan", daemon=True).start()
        return self._value

    def _refresh(self) -> None:
        try:
            self._value = self.store.scan_mappings().deleted_bytes
            self._at = time.monotonic()
        finally:
            with self._lock:
                self._refreshing = False


class Service:
    """Everything a request handler needs; one per app."""

    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        Store(settings.root).prepare()
        if store is None:
            probe = Store(settings.root)
            budget = settings.budget_bytes(probe.stats().capacity)
            # Requests wait at most 5 s on another process's lock (then 503); loads 60 s.
            store = Store(settings.root, max_bytes=budget, lock_timeout=5.0)
        self.store = store
        self.load_store = Store(store.root, max_bytes=store.max_bytes, lock_timeout=60.0)
        self.metrics = ServiceMetrics(
            space=self.space,
            held_by_readers=lambda: self.readers.deleted_bytes(),
            job_counts=lambda: self.jobs.counts(),
        )
        self.jobs = JobManager(
            self.load_store,
            workers=settings.load_workers,
            max_load_rate=settings.max_load_rate,
            on_finish=self._job_finished,
            allowed_dirs=settings.allow_source,
        )
        self.readers = ReaderScan(store)
        self.started = time.time()
        self._generations: memoryview | None = None
        self._view: EntryView | None = None
        self._lock = threading.Lock()
        self._refreshing = False

    def _job_finished(self, job: LoadJob) -> None:
        self.metrics.loads.labels(outcome=job.state).inc()
        if job.state == "done":
            self.metrics.loaded_bytes.inc(job.bytes_done)

    def generation(self) -> int:
        """The root's change counter: slot 0 of the generation table, rewritten on every
        publish and evict (-1 while the root has no table)."""
        if self._generations is None:
            mapped = map_generations(Layout(self.store.root))
            if mapped is None:
                return -1
            self._generations = mapped[0]
        return int(self._generations[0])

    def entry_view(self) -> EntryView:
        """All entries, current as of the root's generation (``last_used`` at most 30 s old).

        A changed root is re-read at once (a client sees its own loads and evictions); a
        merely old view is served while a background thread refreshes it.
        """
        return self.current_view() or self._refresh_entries(self.generation())

    def current_view(self) -> EntryView | None:
        """The cached view if the root has not changed since it was read, else None."""
        view = self._view
        if view is None or view.generation != self.generation():
            return None
        if time.monotonic() - view.at > _ENTRIES_MAX_AGE_S:
            with self._lock:
                start, self._refreshing = not self._refreshing, True
            if start:
                threading.Thread(
                    target=self._refresh_in_background, name="shmcache-list", daemon=True
                ).start()
        return view

    def _refresh_in_background(self) -> None:
        try:
            self._refresh_entries(self.generation())
        finally:
            with self._lock:
                self._refreshing = False

    def _refresh_entries(self, generation: int) -> EntryView:
        view = EntryView.of(generation, self.store.list())
        self._view = view
        return view

    def entries(self) -> list[EntryInfo]:
        """All entries, sorted by key (see :meth:`entry_view`)."""
        return self.entry_view().entries

    def forget_entries(self) -> None:
        self._view = None

    def space(self) -> StoreStats:
        """``Store.stats()`` from the cached entry view (no re-read of every entry)."""
        view = self.entry_view()
        return StoreStats(
            root=str(self.store.root),
            capacity=total_bytes(self.store.root),
            used=view.used,
            free=free_bytes(self.store.root),
            budget=self.store.max_bytes,
            entries=len(view.entries),
        )

    def close(self) -> None:
        self._generations = None  # unmapped when the last reader lets go of it
