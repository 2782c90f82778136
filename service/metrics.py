"""Prometheus metrics of one daemon, in a registry of its own (apps in one process never clash).

The gauges are read when scraped, through functions the service passes in: this module
knows nothing of the service's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shmcache import EntryInfo, StoreStats
from shmcache._store.ownership import owner_name, usage_by_owner

__all__ = ["EVICTION_REASONS", "ServiceMetrics"]

EVICTION_REASONS = ("request", "budget", "cleanup")
"""The ``reason`` labels of the eviction counters (``Store.on_evict``'s reasons), shown from 0."""
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _CacheCollector(Collector):
    """Gauges read from the store when scraped: entries, bytes, jobs by state."""

    def __init__(
        self,
        space: Callable[[], StoreStats],
        held_by_readers: Callable[[], int],
        job_counts: Callable[[], Mapping[str, int]],
    ) -> None:
        self.space = space
        self.held_by_readers = held_by_readers
        self.job_counts = job_counts

    def collect(self) -> Iterator[Metric]:
        space = self.space()
        yield GaugeMetricFamily("shmcache_entries", "Published entries.", value=space.entries)
        yield GaugeMetricFamily("shmcache_used_bytes", "Bytes held by published entries.", value=space.used)
        yield GaugeMetricFamily(
            "shmcache_capacity_bytes", "Size of the file system holding the root.", value=space.capacity
        )
        yield GaugeMetricFamily("shmcache_free_bytes", "Free bytes on that file system.", value=space.free)
        if space.budget is not None:
            yield GaugeMetricFamily("shmcache_budget_bytes", "The root's byte budget.", value=space.budget)
        yield GaugeMetricFamily(
            "shmcache_held_by_readers_bytes",
            "Bytes of evicted or replaced entries still mapped by live processes.",
            value=self.held_by_readers(),
        )
        jobs = GaugeMetricFamily(
            "shmcache_jobs", "Load jobs known to the daemon, by state.", labels=["state"]
        )
        for state, count in self.job_counts().items():
            jobs.add_metric([state], count)
        yield jobs


class _UserCollector(Collector):
    """Per-user gauges read when scraped: each owner's entries and bytes (``user`` is the
    owner's name, the uid where it has none)."""

    def __init__(self, entries: Callable[[], list[EntryInfo]]) -> None:
        self.entries = entries

    def collect(self) -> Iterator[Metric]:
        usage = usage_by_owner(self.entries())
        count = GaugeMetricFamily(
            "shmcache_user_entries", "Published entries, by who loaded them.", labels=["user"]
        )
        size = GaugeMetricFamily(
            "shmcache_user_bytes", "Bytes held by entries, by who loaded them.", labels=["user"]
        )
        for uid, use in sorted(usage.items(), key=lambda item: -1 if item[0] is None else item[0]):
            count.add_metric([owner_name(uid)], use.entries)
            size.add_metric([owner_name(uid)], use.bytes)
        yield count
        yield size


class ServiceMetrics:
    """Counters the service updates plus gauges read at scrape time: ``space()`` (the
    store's stats), ``held_by_readers()`` (bytes) and ``job_counts()`` (jobs by state)."""

    def __init__(
        self,
        space: Callable[[], StoreStats],
        held_by_readers: Callable[[], int],
        job_counts: Callable[[], Mapping[str, int]],
        entries: Callable[[], list[EntryInfo]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.loads = Counter(
            "shmcache_loads", "Load jobs finished, by outcome.", ["outcome"], registry=self.registry
        )
        for outcome in ("done", "failed", "cancelled"):
            self.loads.labels(outcome=outcome)
        self.loaded_bytes = Counter(
            "shmcache_loaded_bytes", "Bytes loaded by finished jobs.", registry=self.registry
        )
        self.evictions = Counter(
            "shmcache_evictions",
            "Entries the daemon evicted, by reason: request (an evict asked of it), budget (room "
            "made for a load or a member's put), cleanup (a link whose data vanished).",
            ["reason"],
            registry=self.registry,
        )
        self.evicted_bytes = Counter(
            "shmcache_evicted_bytes",
            "Bytes the daemon's evictions released, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason=reason)
            self.evicted_bytes.labels(reason=reason)
        self.cleanups = Counter("shmcache_cleanups", "Cleanup runs.", registry=self.registry)
        self.cleanup_freed_bytes = Counter(
            "shmcache_cleanup_freed_bytes", "Bytes freed by cleanup runs.", registry=self.registry
        )
        self.requests = Histogram(
            "shmcache_request_duration_seconds",
            "HTTP request latency, by method, route template and status.",
            ["method", "route", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_CacheCollector(space, held_by_readers, job_counts))
        self.member_puts = Counter(
            "shmcache_member_puts", "Puts through the write channel, by user.", ["user"],
            registry=self.registry,
        )
        self.member_put_bytes = Counter(
            "shmcache_member_put_bytes", "Bytes put through the write channel, by user.", ["user"],
            registry=self.registry,
        )
        if entries is not None:
            self.registry.register(_UserCollector(entries))

    def evicted(self, key: str, nbytes: int, reason: str) -> None:
        """Count one eviction a store of the daemon made (its ``Store.on_evict``)."""
        self.evictions.labels(reason=reason).inc()
        self.evicted_bytes.labels(reason=reason).inc(nbytes)

    def member_put(self, uid: int, nbytes: int) -> None:
        """Count one put a member made through the write channel."""
        user = owner_name(uid)
        self.member_puts.labels(user=user).inc()
        self.member_put_bytes.labels(user=user).inc(nbytes)
