"""The config's ``[[datasets]]`` at the daemon's start: load each, skip it, or keep what
was put under its key since.

A restart must not put yesterday's files back over a refresh made by hand (``shmcache put
NEW --key K --overwrite``). ``<root>/preloads.json`` records, per key, the sources the
config has preloaded there (URLs without their secrets). At a later start, entries under
the key that came from none of them (nor from the config's source now) were put by
someone since: they are kept, and the log says so and how to load the preload again. A
root without the record (its first start with this daemon) loads as before, and starts
recording.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shmcache import EntryInfo, Store
from shmcache._sources.urls import is_url
from shmcache.errors import ShmCacheError

from .setting_fields import DatasetSpec
from .sources import from_source, is_up_to_date, shown_source

if TYPE_CHECKING:
    from .state import Service

__all__ = ["start_preloads"]

logger = logging.getLogger(__name__)

_MAX_RECORD = 1 << 20  # a record past this is not the daemon's: ignored (start as without one)
_SOURCES_KEPT = 8  # per key: the config's last sources (a changed config loads the new one)


def start_preloads(service: Service) -> None:
    """Queue the config's datasets that need loading; say why each other one is not."""
    store = service.store
    recorded = _read(store)
    for spec in service.settings.datasets:
        source = shown_source(spec.source)
        try:
            known = None if recorded is None else recorded.get(spec.key, [])
            why_not = _why_not_load(store, spec, known)
            if why_not is None:
                job, _ = service.jobs.submit(spec.key, spec.source, pin=spec.pin, overwrite=True)
                logger.info("preload %s from %s: job %s", spec.key, source, job.id)
            else:
                logger.log(why_not[0], "preload %s: %s", spec.key, why_not[1])
        except (ShmCacheError, OSError) as exc:
            logger.error("preload %s from %s: %s", spec.key, source, exc)
            continue
        if recorded is None:
            recorded = {}
        if source not in recorded.setdefault(spec.key, []):  # whether loaded, queued or kept
            recorded[spec.key] = [*recorded[spec.key], source][-_SOURCES_KEPT:]
    try:
        _write(store, recorded or {})
    except OSError as exc:
        logger.warning("cannot record the preloads' sources in %s: %s", store.layout.preloads, exc)


def _why_not_load(store: Store, spec: DatasetSpec, known: list[str] | None) -> tuple[int, str] | None:
    """``(log level, why)`` when the preload is not to be loaded now, else None. ``known``:
    the sources recorded for the key (None: no record in this root at all)."""
    source = shown_source(spec.source)
    if isinstance(spec.source, Path) and not spec.source.exists():
        return logging.WARNING, f"source {source} does not exist; skipped"
    if is_up_to_date(store, spec.key, spec.source):
        return logging.INFO, f"{source} unchanged since it was loaded; skipped"
    if known is None:
        return None
    newer = _put_since(store, spec.key, (source, *known))
    if newer is None:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newer.created))
    return logging.WARNING, (
        f"kept {newer.key}, put from {newer.source or 'memory (put_array)'} at {when}, not from "
        f"the preload's {source}; to load the preload again, evict {spec.key} and restart "
        f"(or put {source} under it yourself)"
    )


def _put_since(store: Store, key: str, sources: tuple[str, ...]) -> EntryInfo | None:
    """The newest entry under ``key`` loaded from none of ``sources``, or None."""
    others = [
        e
        for e in store.list(key)
        if e.source is None or not any(from_source(e.source, _as_source(s)) for s in sources)
    ]
    return max(others, key=lambda e: e.created, default=None)


def _as_source(text: str) -> Path | str:
    return text if is_url(text) else Path(text)


def _read(store: Store) -> dict[str, list[str]] | None:
    """The record, or None where the root has none (its first start with this daemon)."""
    try:
        with open(store.layout.preloads, "rb") as fp:
            data = json.loads(fp.read(_MAX_RECORD))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s (%s): preloads load as on a first start", store.layout.preloads, exc)
        return None
    if not isinstance(data, dict):
        return None
    return {
        k: [v for v in values if isinstance(v, str)]
        for k, values in data.items()
        if isinstance(k, str) and isinstance(values, list)
    }


def _write(store: Store, recorded: dict[str, list[str]]) -> None:
    """Replace the record whole (a reader sees the old one or the new one)."""
    path = store.layout.preloads
    staging = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, store.layout.file_mode)
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(recorded, fp, indent=1, sort_keys=True)
        os.replace(staging, path)
    except BaseException:
        try:
            os.unlink(staging)
        except OSError:
            pass
        raise
