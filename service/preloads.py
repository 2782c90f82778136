"""The config's ``[[datasets]]`` at the daemon's start: load each, skip it, or keep what
was put under its key since.

A restart must not put yesterday's files back over a refresh made by hand (``shmcache put
NEW --key K --overwrite``). ``<root>/preloads.json`` records, per key, the source the
config preloaded there. At the next start, entries under the key that came from neither
the config's source nor the one recorded (a changed config: load the new source) were put
by someone since: they are kept, and the log says so and how to load the preload again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shmcache import EntryInfo, Store
from shmcache.errors import ShmCacheError

from .setting_fields import DatasetSpec
from .sources import from_source, is_up_to_date

if TYPE_CHECKING:
    from .state import Service

__all__ = ["start_preloads"]

logger = logging.getLogger(__name__)

_MAX_RECORD = 1 << 20  # a record past this is not the daemon's: ignored (start as without one)


def start_preloads(service: Service) -> None:
    """Queue the config's datasets that need loading; say why each other one is not."""
    store = service.store
    recorded = _read(store)
    for spec in service.settings.datasets:
        try:
            why_not = _why_not_load(store, spec, recorded.get(spec.key))
            if why_not is not None:
                logger.log(why_not[0], "preload %s: %s", spec.key, why_not[1])
                continue
            job, _ = service.jobs.submit(spec.key, spec.source, pin=spec.pin, overwrite=True)
            logger.info("preload %s from %s: job %s", spec.key, spec.source, job.id)
            recorded[spec.key] = str(spec.source)
            _write(store, recorded)
        except (ShmCacheError, OSError) as exc:
            logger.error("preload %s from %s: %s", spec.key, spec.source, exc)


def _why_not_load(store: Store, spec: DatasetSpec, before: str | None) -> tuple[int, str] | None:
    """``(log level, why)`` when the preload is not to be loaded now, else None."""
    if isinstance(spec.source, Path) and not spec.source.exists():
        return logging.WARNING, f"source {spec.source} does not exist; skipped"
    if is_up_to_date(store, spec.key, spec.source):
        return logging.INFO, f"{spec.source} unchanged since it was loaded; skipped"
    sources = (spec.source,) if before is None else (spec.source, before)
    newer = _put_since(store, spec.key, sources)
    if newer is None:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newer.created))
    return logging.WARNING, (
        f"kept {newer.key}, put from {newer.source or 'memory (put_array)'} at {when}, not from "
        f"the preload's {spec.source}; to load the preload again, evict {spec.key} and restart "
        f"(or put {spec.source} under it yourself)"
    )


def _put_since(store: Store, key: str, sources: tuple[Path | str, ...]) -> EntryInfo | None:
    """The newest entry under ``key`` loaded from none of ``sources``, or None."""
    others = [
        e for e in store.list(key) if e.source is None or not any(from_source(e.source, s) for s in sources)
    ]
    return max(others, key=lambda e: e.created, default=None)


def _read(store: Store) -> dict[str, str]:
    try:
        with open(store.layout.preloads, "rb") as fp:
            data = json.loads(fp.read(_MAX_RECORD))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s (%s): preloads load as on a first start", store.layout.preloads, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write(store: Store, recorded: dict[str, str]) -> None:
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
