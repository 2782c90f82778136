"""Checking a load's source before it is queued: absolute, resolved, allowed, loadable.

Paths are resolved with ``realpath`` (symlinks and ``..``) before the ``--allow-source``
check, so a symlink inside an allowed directory cannot point the daemon elsewhere; a refusal
names the source as given, never what it resolves to. Whatever the kernel refuses about a path
(too long, a lone surrogate, a loop, no permission) is the client's error (4xx), and messages
carry long paths shortened.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

from shmcache import Store
from shmcache._disk.meta import read_meta
from shmcache._error_table import HTTP, fix
from shmcache._sources.dispatch import Loaded, is_current
from shmcache._sources.tar_shards import is_shard_source
from shmcache._sources.urls import is_url, local_path_of, redact_url, url_allowed
from shmcache._units import human_bytes
from shmcache.errors import (
    CacheFullError,
    InvalidSourceError,
    KeyExistsError,
    ShmCacheError,
    SourceNotFoundError,
)

from .errors import SourceNotAllowedError, short

__all__ = ["check_loadable", "from_source", "is_up_to_date", "resolve_source", "shown_source"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR)


def resolve_source(source: str, allowed: Sequence[Path | str]) -> Path | str:
    """The real path of ``source``, if it is absolute, exists and lies in ``allowed``
    (an empty ``allowed`` allows everything the daemon can read); or ``source`` itself if
    it is a URL under one of the URL prefixes of ``allowed`` (none: no URL is allowed)."""
    if "\x00" in source:
        raise InvalidSourceError("the source path contains a NUL character")
    if is_url(source):
        local = local_path_of(source)
        if local is None:
            return _allowed_url(source, [p for p in allowed if isinstance(p, str)])
        source = local
    given = short(source)
    try:
        os.fsencode(source)
    except UnicodeEncodeError:
        raise InvalidSourceError(
            f"source {given!a} is not a file name this machine can encode (a lone surrogate?)"
        ) from None
    if not os.path.isabs(source):
        raise InvalidSourceError(
            f"source {given!r} is not an absolute path; the daemon does not share your working "
            "directory, so resolve it first (e.g. os.path.abspath)"
        )
    # Check the resolved path before its existence: nobody may probe outside the allowed dirs.
    try:
        real = Path(os.path.realpath(source))
    except OSError as exc:  # e.g. a symlink loop
        raise _unusable(given, exc) from None
    dirs = [top for top in allowed if isinstance(top, Path)]
    if allowed and not any(real == top or real.is_relative_to(top) for top in dirs):
        # Never where it resolves to: a link to /proc/self/cwd would map the daemon's files for a TCP client.
        raise SourceNotAllowedError(
            f"source {given} is outside the directories this daemon may load from: "
            f"{', '.join(str(p) for p in allowed)}. "
            "Move the data there, or start the daemon with --allow-source for its directory"
        )
    try:
        os.stat(_fixed_part(real) if is_shard_source(source) else real)
    except OSError as exc:
        raise _unusable(given, exc) from None
    return real


def _fixed_part(pattern: Path) -> Path:
    """The directory a shard pattern's names are in (``/data/shards`` of
    ``/data/shards/{000..099}.tar``): what must exist before the load expands it."""
    while any(c in pattern.name for c in "*?[{") and pattern != pattern.parent:
        pattern = pattern.parent
    return pattern


def _allowed_url(url: str, prefixes: Sequence[str]) -> str:
    """``url`` if it lies under one of the URL prefixes; the daemon loads it with its own
    credentials, so a URL carrying some (user information, a query) is refused: it would be
    kept in job records."""
    shown = short(redact_url(url))
    if redact_url(url) != url:
        raise InvalidSourceError(
            f"source {shown}: the daemon loads URLs with its own credentials (its environment, "
            "config files or instance role); send the URL without user information or query"
        )
    if not url_allowed(url, prefixes):
        raise SourceNotAllowedError(
            f"source {shown} is not under a URL prefix this daemon may load from"
            + (f" ({', '.join(prefixes)})" if prefixes else " (it allows none)")
            + ". Start the daemon with --allow-source for its prefix (e.g. s3://bucket/datasets)"
        )
    return url


def _unusable(shown: str, exc: OSError) -> InvalidSourceError:
    """The client's error for a path the kernel refused (never a 500, never the path whole)."""
    if exc.errno in _NOT_FOUND:
        return SourceNotFoundError(f"source {shown} does not exist on the daemon's machine")
    if exc.errno == errno.ENAMETOOLONG:
        return InvalidSourceError(
            f"source {shown} is too long: a path is at most 4095 bytes and each name in it 255"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InvalidSourceError(f"the daemon's user may not read source {shown} (permission denied)")
    return InvalidSourceError(f"source {shown} cannot be used: {exc.strerror or type(exc).__name__}")


def _as_source_errors(check: Callable[_P, _R]) -> Callable[_P, _R]:
    """``check`` with the kernel's refusals of a source's files turned into client errors."""

    @functools.wraps(check)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return check(*args, **kwargs)
        except ShmCacheError:
            raise  # already says what is wrong (some are OSErrors too: KeyExistsError, CacheFullError)
        except OSError as exc:
            raise _unusable(short(str(exc.filename or "")), exc) from None

    return checked


@_as_source_errors
def check_loadable(
    store: Store,
    key: str,
    source: Path | str,
    overwrite: bool,
    allowed: Sequence[Path | str] = (),
    as_: str = "auto",
    dtype: str | None = None,
) -> list[str]:
    """Validate every source file (headers, dtypes, key names), refuse loads that cannot
    fit, and existing keys unless ``overwrite``; returns the keys the load would publish.

    The store validates again when it loads; this only turns bad input into an immediate
    HTTP error instead of a failed job.
    """
    dirs = [top for top in allowed if isinstance(top, Path)]
    plan = store.plan_file(key, source, allowed_dirs=dirs, as_=as_, dtype=dtype)  # headers only; no links out
    keys = [item.key for item in plan]
    needed = sum(item.size for item in plan)
    budget = store.budget
    if budget is not None and needed > budget:
        raise CacheFullError(
            f"{source} needs {human_bytes(needed)}, more than the root's whole budget of "
            f"{human_bytes(budget)}; raise it (`shmcache budget set SIZE`) or load less"
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
                    f"entry {planned!r} already exists; pass {fix('overwrite', HTTP)} to replace it, "
                    f"or evict it first ({fix('evict', HTTP, key=planned)})"
                )
    return keys


def is_up_to_date(store: Store, key: str, source: Path | str) -> bool:
    """Whether the entries under ``key`` were loaded from ``source`` as it is now
    (same files, sizes and modification times; for a URL, the same objects, sizes and
    ETags): a config preload can then be skipped."""
    loaded = [
        Loaded(e.source, e.kind, e.source_fingerprint, functools.partial(_identity, store, e.version))
        for e in store.list(key)
        if e.source is not None
    ]
    return is_current(source, loaded)


def shown_source(source: Path | str) -> str:
    """A source as entries record it and logs and answers name it: a URL without its
    secrets (user information, query string)."""
    return redact_url(source) if isinstance(source, str) else str(source)


def from_source(recorded: str, source: Path | str) -> bool:
    """Whether an entry's recorded source (a file, a member ``file[name]``, an object URL)
    is ``source`` or lies under it (a directory, a URL prefix)."""
    if isinstance(source, str):
        return recorded == source or recorded.startswith(source.rstrip("/") + "/")
    file = recorded.rpartition("[")[0] if recorded.endswith("]") else recorded
    return Path(file) == source or Path(file).is_relative_to(source)


def _identity(store: Store, version: str) -> str | None:
    """The remote identity (ETag) a version recorded of its object."""
    meta = read_meta(store.layout, version)
    return None if meta is None else meta.source_identity
