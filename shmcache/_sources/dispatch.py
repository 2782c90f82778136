"""One dispatch over every kind of source ``put_file`` takes: a URL (``remote``), a table
file (``tables``), files packed as blobs (``blobs``), or array files and directories of
them (``files``, whose ``PLANNERS`` name each suffix's planner). ``Store.put_file``,
``Store.plan_file`` (the dry run the daemon checks loads with) and the daemon's preloads
(is what was loaded still current?) all decide here, so a new kind is decided once."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .blobs import directory_fingerprint, plan_blobs, put_kind
from .files import array_files_under, plan_sources
from .planned import PlannedEntry
from .source_files import stat_fingerprint
from .tables import is_table_file, plan_table_file
from .token_files import refuse_dtype_for
from .urls import is_url, local_path_of

__all__ = ["Loaded", "Source", "classify_source", "is_current", "plan_source"]

SourceKind = Literal["remote", "table", "blobs", "arrays"]


@dataclass(frozen=True)
class Source:
    """What ``put_file(key, location, as_=...)`` makes: ``kind``, and where it reads from
    (a URL for ``remote``; a local path otherwise, ``file://`` URLs made paths)."""

    kind: SourceKind
    location: str | os.PathLike[str]


def classify_source(path: str | os.PathLike[str], as_: str = "auto", dtype: Any = None) -> Source:
    """The kind of source ``path`` is: a URL, a table file, blobs (``as_``, or a directory
    without array files) or array files (a raw token file when ``dtype`` is given)."""
    refuse_dtype_for(path, dtype)
    if is_url(path):
        local = local_path_of(str(path))
        if local is None:
            return Source("remote", str(path))
        path = local
    kind = put_kind(Path(path), as_)
    if kind != "blobs" and is_table_file(path) and not os.path.isdir(path) and dtype is None:  # one table
        return Source("table", path)
    return Source("blobs" if kind == "blobs" else "arrays", path)


def plan_source(
    key: str,
    path: str | os.PathLike[str],
    *,
    allowed: Sequence[str | os.PathLike[str]] = (),
    as_: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
    dtype: Any = None,
) -> list[PlannedEntry]:
    """What ``put_file(key, path)`` would publish, validated (headers, dtypes, key names)
    without copying anything (``key`` is valid)."""
    source = classify_source(path, as_, dtype)
    if source.kind == "remote":
        from .remote_files import plan_remote, plan_remote_table  # threads: URLs only

        plan = plan_remote(key, str(source.location), storage_options, dtype=dtype)
        if plan.is_table:
            return plan_remote_table(key, plan)
        return [PlannedEntry(i.key, i.source, i.url, i.checked_header.file_size) for i in plan.items]
    if source.kind == "table":
        return [plan_table_file(key, Path(source.location), allowed)]
    if source.kind == "blobs":
        with plan_blobs(source.location, f"blobs for key {key!r}", allowed) as blobs:
            pass
        return [PlannedEntry(key, str(source.location), str(source.location), blobs.size)]
    return [
        PlannedEntry(p.key, p.source, p.copy_from, p.header.file_size)
        for p in plan_sources(key, Path(source.location), allowed, dtype)
    ]


@dataclass(frozen=True)
class Loaded:
    """What an entry recorded of where it was loaded from (its ``meta.json``)."""

    source: str
    kind: str
    fingerprint: Mapping[str, Any] | None
    identity: Callable[[], str | None]
    """The remote object's identity (ETag), read only for a URL source."""


def is_current(source: Path | str, loaded: Sequence[Loaded]) -> bool:
    """Whether ``loaded`` (the entries under a key that record a source) came from
    ``source`` as it is now: the same files, sizes and modification times; for a URL
    (a ``str``), the same objects, sizes and ETags. What lets a preload be skipped."""
    if not loaded:
        return False
    if isinstance(source, str):
        from .remote import remote_identities

        now = remote_identities(source)
        objects = {e.source.rpartition("[")[0] if e.source.endswith("]") else e.source: e for e in loaded}
        return {url: ((e.fingerprint or {}).get("size"), e.identity()) for url, e in objects.items()} == now
    if len(loaded) == 1 and loaded[0].kind == "blobs":  # a packed directory: one fingerprint
        entry = loaded[0]
        return entry.source == str(source) and entry.fingerprint == directory_fingerprint(source)
    try:
        files = {str(p) for p in array_files_under(source)} if source.is_dir() else {str(source)}
    except OSError:  # a directory that cannot be listed: load again, and say why there
        return False
    seen = set()
    for entry in loaded:
        file = entry.source  # a member of a multi-array file: "<file>[<member>]"
        if file not in files and file.endswith("]"):
            file = file.rpartition("[")[0]
        if file not in files:
            return False
        try:
            st = os.stat(file)
        except OSError:
            return False
        if entry.fingerprint != stat_fingerprint(st):
            return False
        seen.add(file)
    return seen == files
