"""The daemon's shared state under churn: the entry list caught up from the generation table
(only changed slots re-read; inline when small, in a thread otherwise), ``/proc`` scans
shared by concurrent requests, and job bookkeeping that stays O(1) and small."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import temporary_root, wait_for

import shmcache
from shmcache._disk.layout import generation_slot

pytest.importorskip("fastapi")

from shmcache.service import jobs as jobs_module
from shmcache.service.errors import JobFinishedError
from shmcache.service.jobs import JobManager
from shmcache.service.settings import load_settings
from shmcache.service.state import Service


@pytest.fixture
def service() -> Iterator[Service]:
    with temporary_root() as root:
        shmcache.Store(root).put_array("seed", np.arange(3))  # a generation table to compare
        state = Service(load_settings({"root": root}, env={}))
        state.entry_view()
        try:
            yield state
        finally:
            state.jobs.shutdown()
            state.close()


def other_process_store(service: Service) -> shmcache.Store:
    """What another process writing the root looks like to the daemon: a Store of its own."""
    return shmcache.Store(service.store.root)


def listed(service: Service) -> dict[str, str]:
    return {entry.key: entry.version for entry in service.entry_view().entries}


def test_publishes_replacements_and_evictions_by_others_are_caught_up(service: Service) -> None:
    other = other_process_store(service)
    first = other.put_array("a/x", np.arange(4))
    assert listed(service)["a/x"] == first.version
    second = other.put_array("a/x", np.arange(5), overwrite=True)
    assert listed(service)["a/x"] == second.version
    assert service.entry_view().rows["a/x"].info.shape == (5,)
    other.evict("a/x")
    assert "a/x" not in listed(service)
    assert set(listed(service)) == {"seed"}


def test_only_changed_slots_are_read_again(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    other = other_process_store(service)
    for i in range(40):
        other.put_array(f"k{i}", np.arange(2))
    service.entry_view()
    read: list[str] = []
    from shmcache.service import state as state_module

    real = state_module.info_of
    monkeypatch.setattr(state_module, "info_of", lambda layout, v: read.append(v) or real(layout, v))
    published = other.put_array("k7", np.arange(3), overwrite=True)
    assert listed(service)["k7"] == published.version
    assert read == [published.version]  # one meta.json read, not forty


def test_keys_sharing_a_slot_are_both_checked(service: Service) -> None:
    other = other_process_store(service)
    first = "s0"
    slot = generation_slot(first)
    twin = next(f"s{i}" for i in range(1, 100_000) if generation_slot(f"s{i}") == slot)
    other.put_array(first, np.arange(2))
    other.put_array(twin, np.arange(2))
    assert {first, twin} <= set(listed(service))
    replaced = other.put_array(twin, np.arange(6), overwrite=True)
    other.evict(first)
    now = listed(service)
    assert first not in now and now[twin] == replaced.version


def test_small_changes_are_caught_up_inline_big_ones_in_a_thread(service: Service) -> None:
    other = other_process_store(service)
    other.put_array("one", np.arange(2))
    inline = service.view_now()
    assert inline is not None and "one" in inline.keys
    for i in range(40):  # forty slots changed: more than the event loop should take on
        other.put_array(f"many/{i}", np.arange(2))
    assert service.view_now() is None
    assert len([key for key in service.entry_view().keys if key.startswith("many/")]) == 40
    assert service.view_now() is service.entry_view()  # current again: served as it is


def test_a_caller_takes_a_catch_up_that_began_after_it_arrived(service: Service) -> None:
    other = other_process_store(service)
    other.put_array("late", np.arange(2))
    views = []
    threads = [threading.Thread(target=lambda: views.append(service.entry_view())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all("late" in view.keys for view in views)
    assert len({id(view) for view in views}) <= 2  # shared, not one re-read each


def test_listing_under_a_prefix(service: Service) -> None:
    other = other_process_store(service)
    for key in ("a", "a/b", "a/b/c", "a-b", "a.c", "ab", "a0", "b/a"):
        other.put_array(key, np.arange(1))
    view = service.entry_view()

    def under(prefix: str | None) -> list[str]:
        import json

        return [entry["key"] for entry in json.loads(view.json_under(prefix))]

    assert under("a") == ["a", "a/b", "a/b/c"]
    assert under("a/b") == ["a/b", "a/b/c"]
    assert under("b") == ["b/a"]
    assert under("zz") == [] and under("a/b/c/d") == []
    assert under(None) == sorted(["a", "a/b", "a/b/c", "a-b", "a.c", "ab", "a0", "b/a", "seed"])


def test_space_from_the_view(service: Service) -> None:
    other = other_process_store(service)
    other.put_array("big", np.zeros(1000))
    space = service.space()
    assert space.entries == 2 and space.used == sum(e.size for e in service.entries())


# ---------------------------------------------------------------------- /proc scans


def test_a_fresh_scan_sees_what_was_mapped_before_the_call(service: Service) -> None:
    other = other_process_store(service)
    info = other.put_array("mapped", np.arange(10))
    service.readers.fresh()  # an older scan, before the mapping
    array = shmcache.open_array("mapped", root=service.store.root)
    assert os.getpid() in service.readers.fresh().pids_by_version.get(info.version, set())
    del array


def _slowed_scans(service: Service, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Make each /proc scan take 50 ms longer (so that callers overlap); when each began."""
    scans: list[float] = []
    real = service.store.scan_mappings

    def slow_scan():  # type: ignore[no-untyped-def]
        scans.append(time.monotonic())
        time.sleep(0.05)
        return real()

    monkeypatch.setattr(service.store, "scan_mappings", slow_scan)
    return scans


def test_concurrent_callers_share_scans(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    scans = _slowed_scans(service, monkeypatch)
    threads = [threading.Thread(target=service.readers.fresh) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= len(scans) <= 3  # the first, then one for everyone who arrived during it


def test_stats_scan_is_at_most_max_age_old(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    first = service.readers.recent()
    assert service.readers.latest() is first and service.readers.recent() is first  # young enough
    service.readers.max_age = 0.0
    assert service.readers.latest() is None  # too old: never answered from
    scans = _slowed_scans(service, monkeypatch)
    service.readers.max_age = 60.0
    service.readers._last = (time.monotonic() - 61.0, first)  # as after a quiet minute
    threads = [threading.Thread(target=service.readers.deleted_bytes) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(scans) == 1  # a new scan before answering, shared by all who came together
    assert service.readers.recent() is not first


def test_a_scan_about_to_be_too_old_is_renewed_in_the_background(service: Service) -> None:
    readers = service.readers
    first = readers.fresh()
    readers.max_age, readers._took = 60.0, 10.0  # scans take 10 s: renew 20 s ahead
    readers._last = (time.monotonic() - 30.0, first)
    assert readers.latest() is first and not readers._background.locked()  # young enough: no scan
    readers._last = (time.monotonic() - 50.0, first)
    assert readers.latest() is first  # still answered at once...
    wait_for(lambda: readers._last is not None and readers._last[1] is not first, what="a background scan")


# ---------------------------------------------------------------------- jobs


def test_job_counts_and_history_stay_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_module, "_KEEP_FINISHED", 5)
    source = tmp_path / "src.npy"
    np.save(source, np.arange(4))
    with temporary_root() as root:
        manager = JobManager(shmcache.Store(root), workers=2)
        try:
            submitted = [manager.submit(f"j{i}", source)[0] for i in range(12)]
            for job in submitted:
                assert job.finished_event.wait(30)
            counts = manager.counts()
            assert counts["done"] == 5 and counts["queued"] == counts["running"] == 0
            assert len(manager.list()) == 5
            assert {job.id for job in manager.list()} <= {job.id for job in submitted}
            finished = manager.list()[0]
            assert finished.finished_event.is_set() and not finished.cancel_requested
            with pytest.raises(JobFinishedError):
                manager.cancel(finished.id)
            with pytest.raises(RuntimeError):
                finished.cancel_event.set()  # a finished job's shared event never changes
        finally:
            manager.shutdown()
