"""Checking a load's source before it is queued: absolute, resolved, allowed, loadable.

Paths are resolved with ``realpath`` (symlinks and ``..``) before the ``--allow-source``
check, so a symlink inside an allowed directory cannot point the daemon elsewhere; a refusal
names the source as given, never what it resolves to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from shmcache import Store
from shmcache._units import human_bytes
from shmcache.errors import CacheFullError, InvalidSourceError, KeyExistsError, SourceNotFoundError

from .errors import SourceNotAllowedError

__all__ = ["check_loadable", "is_up_to_date", "resolve_source"]


def resolve_source(source: str, allowed: Sequence[Path]) -> Path:
    """The real path of ``source``, if it is absolute, exists and lies in ``allowed``
    (an empty ``allowed`` allows everything the daemon can read)."""
    if "\x00" in source:
        raise InvalidSourceError("the source path contains a NUL character")
    if not os.path.isabs(source):
        raise InvalidSourceError(
            f"source {source!r} is not an absolute path; the daemon does not share your working "
            "directory, so resolve it first (e.g. os.path.abspath)"
        )
    # Check the resolved path before its existence: nobody may probe outside the allowed dirs.
    try:
        real = Path(os.path.realpath(source))
    except OSError as exc:  # e.g. a symlink loop
        raise InvalidSourceError(f"source {source} cannot be resolved: {exc.strerror or exc}") from None
    if allowed and not any(real == top or real.is_relative_to(top) for top in allowed):
        # Never where it resolves to: a link to /proc/self/cwd would map the daemon's files for a TCP client.
        shown = ", ".join(str(p) for p in allowed)
        raise SourceNotAllowedError(
            f"source {source} is outside the directories this daemon may load from: {shown}. "
            "Move the data there, or start the daemon with --allow-source for its directory"
        )
    if not real.exists():
        raise SourceNotFoundError(f"source {source} does not exist on the daemon's machine")
    return real


def check_loadable(
    store: Store, key: str, source: Path, overwrite: bool, allowed: Sequence[Path] = ()
) -> list[str]:
    """Validate every source file (headers, dtypes, key names), refuse loads that cannot
    fit, and existing keys unless ``overwrite``; returns the keys the load would publish.

    The store validates again when it loads; this only turns bad input into an immediate
    HTTP error instead of a failed job.
    """
    plan = store.plan_file(key, source)  # reads headers only
    if allowed:  # a directory may hold symlinks to files elsewhere
        for item in plan:
            resolve_source(item.file, allowed)
    keys = [item.key for item in plan]
    needed = sum(item.size for item in plan)
    if store.max_bytes is not None and needed > store.max_bytes:
        raise CacheFullError(
            f"{source} needs {human_bytes(needed)}, more than the daemon's whole budget of "
            f"{human_bytes(store.max_bytes)}; raise --max-bytes or load less"
        )
    st = os.statvfs(store.root)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise CacheFullError(
            f"{source} needs {human_bytes(needed)} but the file system of {store.root} has only "
            f"{human_bytes(free)} free; evict entries or enlarge /dev/shm (Docker: --shm-size or --ipc=host)"
        )
    if not overwrite:
        for planned in keys:
            if store.exists(planned):
                raise KeyExistsError(
                    f'entry {planned!r} already exists; pass "overwrite": true to replace it, '
                    "or evict it first (DELETE /v1/entries/{key})"
                )
    return keys


def is_up_to_date(store: Store, key: str, source: Path) -> bool:
    """Whether the entries under ``key`` were loaded from ``source`` as it is now
    (same files, sizes and modification times): a config preload can then be skipped."""
    entries = [e for e in store.list(key) if e.source is not None]
    if not entries:
        return False
    if source.is_dir():
        files = {str(p) for p in source.rglob("*") if p.suffix in (".npy", ".npz") and p.is_file()}
    else:
        files = {str(source)}
    seen = set()
    for entry in entries:
        assert entry.source is not None
        file = entry.source.rpartition("[")[0] if entry.source.endswith(".npy]") else entry.source
        if file not in files:
            return False
        try:
            st = os.stat(file)
        except OSError:
            return False
        if entry.source_fingerprint != {"size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return False
        seen.add(file)
    return seen == files
